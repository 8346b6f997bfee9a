"""Chat prompts: a column of messages (``[{"role": "user", "content": "..."}, ...]``) rendered with the
tokenizer's chat template. Runs on: any process, in ``PromptDataModule.setup``, before any model is loaded.
"""

from __future__ import annotations

from typing import Any

__all__ = ["chat_prompt_text", "check_messages", "render_chat", "template_kwargs"]

_SHAPE = (
    "a non-empty list of {'role': str, 'content': str or a list of {'type': 'text' | 'image', ...} items} dicts with "
    "at least one 'user' message"
)


def content_text(content: Any) -> str:
    """A message's text: its content, or the text items of a content list (images and other items left out). Runs
    on: any process."""
    if isinstance(content, list):
        return "".join(str(item.get("text") or "") for item in content if item.get("type") == "text")
    return str(content)


def _is_content(content: Any) -> bool:
    """Text, or a list of typed items (``{"type": "text", "text": ...}``, ``{"type": "image"}``): what chat templates
    of vision-language models take."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(i, dict) and isinstance(i.get("type"), str) for i in content)


def check_messages(value: Any, *, column: str, row: int, which: str) -> list[dict[str, Any]]:
    """``value`` if it is a chat (see ``_SHAPE``) whose last user message has text; else a ``ValueError`` that names the
    column, the row and what is wrong with it. Runs on: any process."""
    problem = None
    if isinstance(value, str):
        problem = "it is a string (a csv column or JSON text?)"
    elif not isinstance(value, list | tuple) or not value:
        problem = f"it is {type(value).__name__} {value!r:.80}"
    else:
        for j, message in enumerate(value):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                problem = f"message {j} is {message!r:.80}, without a text 'role'"
            elif not _is_content(message.get("content")) and not (
                message.get("content") is None and message.get("tool_calls")
            ):  # an assistant turn that only calls tools may have no content
                problem = f"message {j} ({message['role']!r}) has content {message.get('content')!r:.80}, not text"
            if problem:
                break
        else:
            users = [content_text(m["content"]) for m in value if m["role"] == "user"]
            if not users:
                problem = f"no message has role 'user' (roles: {[m['role'] for m in value]})"
            elif not users[-1].strip():
                problem = "the last 'user' message is empty"
    if problem:
        raise ValueError(
            f"PromptDataModule(messages_column={column!r}): row {row} of the {which} data is not a chat: {problem}. "
            f"Expected {_SHAPE}, e.g. [{{'role': 'user', 'content': '3+4='}}]. HINT: store chats in .jsonl or "
            ".parquet (csv holds text only), or fix such rows with datasets.Dataset.map before training."
        )
    return list(value)


def chat_prompt_text(messages: list[dict[str, Any]]) -> str:
    """The text reward functions receive as the ``prompt`` of a chat: the content of its last user message (the
    chat itself stays in its column). Runs on: any process."""
    return content_text([m["content"] for m in messages if m["role"] == "user"][-1])


def template_kwargs(owner: str, value: Any) -> dict[str, Any]:
    """``value`` as the extra variables of every chat template render (``{}`` for None), or a ``ValueError`` naming
    ``owner``'s setting and the fix when it is not a dict of names. Runs on: the process that builds the data."""
    if value is not None and (not isinstance(value, dict) or not all(isinstance(k, str) for k in value)):
        raise ValueError(
            f"{owner}(chat_template_kwargs={value!r}): expected a dict of template variables by name. HINT: "
            "chat_template_kwargs={'enable_thinking': False}."
        )
    return dict(value or {})


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    row: int,
    which: str,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template (and ``chat_template_kwargs``), ending with
    the generation prompt (the model's turn starts next). Runs on: any process. Raises ``ValueError`` when the tokenizer
    has no chat template or the template rejects the conversation (many insist that roles alternate)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"PromptDataModule: the {which} prompts are chats (messages_column, or chat_template=True), but the "
            "tokenizer has no chat template. HINT: use an instruct model's tokenizer (PromptDataModule(tokenizer="
            "...)), or plain-text prompts."
        )
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
    except Exception as err:
        raise ValueError(
            f"PromptDataModule: the tokenizer's chat template failed on row {row} of the {which} data: "
            f"{type(err).__name__}: {err}. HINT: fix the conversation (e.g. alternate user/assistant roles)."
        ) from err
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
