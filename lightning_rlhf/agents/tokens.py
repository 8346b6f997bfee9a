"""Token in, token out: an observation's ids are the chat template's *delta* for the new messages (docs/agents.md),
found by rendering a stand-in conversation with and without them and keeping the ids after the stand-in's last
end-of-turn token (the newline Qwen's template writes after ``<|im_end|>`` belongs to the delta).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2.exceptions import TemplateError

__all__ = ["ChatDelta", "check_chat_template", "render_chat"]

_STAND_IN = [{"role": "user", "content": "0"}, {"role": "assistant", "content": "0"}]


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, generation: bool, **kwargs: Any) -> list[int]:
    """``messages`` rendered to ids by the chat template (``generation``: with the generation prompt). Runs on: any
    process."""
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=generation, return_dict=False, **kwargs
    )
    if isinstance(out, Mapping):  # some tokenizers return a BatchEncoding whatever return_dict says
        out = out["input_ids"]
    return [int(i) for i in out]


class ChatDelta:
    """The observation ids of a tokenizer's chat template, ``chat_kwargs`` (``tools=``, ``enable_thinking=``...)
    going to every render (twice per observation). Runs on: the process that runs the rollout (a worker)."""

    def __init__(self, tokenizer: Any, **chat_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.chat_kwargs = chat_kwargs
        base = render_chat(tokenizer, _STAND_IN, generation=False, **chat_kwargs)
        prefix = base[: self._end_of_turn_at(base) + 1]
        self.end_of_turn_id = prefix[-1]
        # The turns before the stand-in answer must render alike once messages follow; the answer itself may not
        # (Qwen3's drops an empty <think> block from an answer that is no longer the last): the observation starts
        # after the answer's end-of-turn token, the same count of them in.
        self._head = render_chat(tokenizer, _STAND_IN[:1], generation=False, **chat_kwargs)
        self._ends = prefix.count(self.end_of_turn_id)

    def _end_of_turn_at(self, ids: Sequence[int]) -> int:
        """Where the stand-in assistant turn's end-of-turn token is: the last special token the template wrote."""
        start = len(render_chat(self.tokenizer, _STAND_IN[:1], generation=True, **self.chat_kwargs))
        special = set(self.tokenizer.all_special_ids)
        ends = [i for i in range(start, len(ids)) if ids[i] in special]
        if not ends:
            raise ValueError(
                f"the tokenizer's chat template ends an assistant turn with no special token (rendered: "
                f"{self.tokenizer.decode(ids[start:])!r}), so an episode cannot tell where a turn ends. HINT: use a "
                "chat template whose assistant turns end with the EOS token (e.g. <|im_end|>, </s>)."
            )
        return ends[-1]

    def observation_ids(self, messages: Sequence[Mapping[str, Any]], *, last_id: int | None = None) -> list[int]:
        """The ids that follow a sampled assistant turn for ``messages`` (``tool`` or ``user`` turns), ending with
        the generation prompt. ``last_id``: the turn's last sampled id; when it is not the end-of-turn token (the
        turn stopped at another stop token), the end-of-turn token comes first, as context."""
        full = render_chat(self.tokenizer, [*_STAND_IN, *messages], generation=True, **self.chat_kwargs)
        ends = [i for i, t in enumerate(full) if t == self.end_of_turn_id]
        if full[: len(self._head)] != self._head or len(ends) < self._ends:
            raise ValueError(
                "the tokenizer's chat template renders the turns before new messages differently once they are "
                "added (it is not prefix-preserving), so observations cannot be tokenized alone. HINT: use a "
                "template that renders earlier turns the same whatever follows (Qwen2.5's, Llama 3's, the demo's)."
            )
        delta = full[ends[self._ends - 1] + 1 :]
        return delta if last_id in (None, self.end_of_turn_id) else [self.end_of_turn_id, *delta]


def check_chat_template(tokenizer: Any, *, tool_turns: bool = True, **chat_kwargs: Any) -> ChatDelta:
    """Check, before any rollout, that the chat template is prefix-preserving and (``tool_turns``: the environment
    has tools) renders a ``tool`` message (its content appears in the delta); returns the :class:`ChatDelta`. Runs
    on: the controller at set-up, and each rollout worker. Raises ValueError with what to change."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "an environment needs a chat template: the tokenizer has none. HINT: use an instruct model's tokenizer, "
            "or set tokenizer.chat_template."
        )
    delta = ChatDelta(tokenizer, **chat_kwargs)
    if not tool_turns:
        return delta
    marker = "7261"
    try:
        ids = delta.observation_ids([{"role": "tool", "name": "probe", "content": marker}])
    except TemplateError as err:  # Gemma-3's (roles must alternate), Mistral's (a call id of 9 characters)
        raise ValueError(
            f"the tokenizer's chat template cannot render a 'tool' message after an assistant turn ({err}), and the "
            "environment has tools. HINT: have the environment answer with 'user' messages (no tools), or use a "
            "template with a tool turn (Qwen2.5's, Qwen3's, Llama 3's)."
        ) from err
    if marker not in tokenizer.decode(ids):
        raise ValueError(
            "the tokenizer's chat template drops 'tool' messages (a tool result did not appear in the rendered "
            "turn), so the model would never see its tools' results. HINT: use a template that renders the 'tool' "
            "role (Qwen2.5's does), or have the environment answer with 'user' messages."
        )
    return delta
