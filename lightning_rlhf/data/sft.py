"""Supervised (SFT) data: prompt/answer pairs or chats, tokenized with a loss mask on the answers only (docs/sft.md).

Each SFT batch is a :class:`~lightning_rlhf.batch.Batch` with ``input_ids``, ``attention_mask`` and ``loss_mask``
(``[B, T]``, right-padded) and every dataset column as a Python list.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import check_sequence_length
from lightning_rlhf.data.chat import check_messages
from lightning_rlhf.data.prompts import PromptDataModule, keep_within

__all__ = ["SFT_COLUMNS", "SFTDataModule", "collate_sft", "encode_chat", "encode_prompt_answer", "tool_turns"]

SFT_COLUMNS = frozenset({"input_ids", "attention_mask", "loss_mask"})
"""Batch tensors an SFT batch carries; a dataset column with one of these names is refused."""


def _eos_id(tokenizer: Any) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"SFT data: the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no EOS token, so the model "
            "could not learn where an answer ends. HINT: set tokenizer.eos_token (e.g. '</s>' or '<|im_end|>') "
            "and save the tokenizer beside the model."
        )
    return int(eos)


def encode_prompt_answer(tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of ``prompt + answer + EOS``, with the loss on the answer and the EOS only.

    Runs on: any process (pure). The prompt has the tokenizer's special tokens (as RL prompts), the answer none."""
    prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    answer_ids = [*tokenizer(answer, add_special_tokens=False)["input_ids"], _eos_id(tokenizer)]
    return prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)


def tool_turns(messages: list[dict[str, Any]], tools: Any) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """A chat's tool turns as chat templates take them: each tool call's ``arguments`` a dict (datasets store them as
    JSON text, since Arrow would merge different tools' argument keys), ``tools`` a list of JSON schemas. Runs on: any
    process (pure). Raises ValueError for arguments or tools that are not valid JSON."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as err:
            raise ValueError(
                f"SFT data: the 'tools' column holds text that is not JSON ({err}): {tools!r:.120}"
            ) from err
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                call = dict(call)
                inner = dict(call["function"]) if isinstance(call.get("function"), dict) else call
                if isinstance(inner.get("arguments"), str):
                    try:
                        inner["arguments"] = json.loads(inner["arguments"])
                    except ValueError as err:
                        raise ValueError(
                            f"SFT data: a tool call's arguments are text that is not JSON ({err}): "
                            f"{inner['arguments']!r:.120}. HINT: store them as a JSON object or its JSON text."
                        ) from err
                if inner is not call:
                    call["function"] = inner
                fixed.append(call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out, list(tools) if tools else None


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[Any] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a chat rendered with the tokenizer's chat template (with the JSON schemas
    ``tools`` and the extra variables ``chat_template_kwargs``), with the loss on every assistant turn (its content,
    tool calls and end-of-turn token, up to the first EOS; appended when missing) and nothing else.

    Runs on: any process (pure). Each assistant turn's prompt is the template of the turns before it with the
    generation prompt (as RL renders chat prompts); its answer is what the template adds for the turn.

    Raises:
        ValueError: the tokenizer has no chat template, the chat has no assistant turn or starts with one, or
            the template renders earlier turns differently once later turns follow (not prefix-stable).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"SFT data: the rows are chats (messages_column, or chat_template=True), but the tokenizer "
            f"{getattr(tokenizer, 'name_or_path', '')!r} has no chat template. HINT: use an instruct model's "
            "tokenizer (SFTDataModule(tokenizer=...)), set tokenizer.chat_template, or use prompt/answer columns."
        )
    eos = _eos_id(tokenizer)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or turns[0] == 0:
        raise ValueError(
            f"SFT data: a chat needs an assistant turn after at least one other message (roles: "
            f"{[m['role'] for m in messages]}). HINT: each row is [..., {{'role': 'user', ...}}, "
            "{'role': 'assistant', 'content': <what the model should write>}]."
        )
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # the text tokenized so far

    def render(chat: list[dict[str, Any]], generation_prompt: bool) -> str:
        kwargs = {"add_generation_prompt": generation_prompt, **(chat_template_kwargs or {})}
        return str(tokenizer.apply_chat_template(chat, tools=tools or None, tokenize=False, **kwargs))

    for i in turns:
        prompt, full = render(messages[:i], True), render(messages[: i + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ValueError(
                f"SFT data: the chat template is not prefix-stable at message {i} (it renders earlier turns "
                "differently once later ones follow), so the assistant turns cannot be located. HINT: keep one "
                "assistant turn per row (split long chats into one row per turn)."
            )
        context = prompt[len(done) :]
        part = list(tokenizer(context, add_special_tokens=False)["input_ids"]) if context else []
        ids.extend(part)
        mask.extend([0] * len(part))
        answer = list(tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"])
        end = answer.index(eos) + 1 if eos in answer else len(answer)
        trained = answer[:end] if eos in answer else [*answer, eos]
        ids.extend(trained)
        mask.extend([1] * len(trained))
        ids.extend(answer[end:])  # what the template writes after the EOS (e.g. a newline): context
        mask.extend([0] * len(answer[end:]))
        done = full
    return ids, mask


def collate_sft(rows: list[dict[str, Any]], *, pad_token_id: int) -> Batch:
    """Right-pad the ``input_ids`` / ``loss_mask`` of ``rows`` into a Batch (other columns as lists). Runs on: any."""
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = torch.tensor(r["input_ids"])
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(r["loss_mask"])
    columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("input_ids", "loss_mask")}
    return Batch({"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}, columns)


class SFTDataModule(PromptDataModule):
    """Supervised examples for :class:`~lightning_rlhf.modules.SFTModule`: prompt/answer columns or chats.

    Runs on: every process. Sources, splits, shuffling, the resumable loader and the arguments not listed here are
    those of :class:`~lightning_rlhf.data.PromptDataModule`; every check happens in ``setup``, before any model loads.

    Args:
        train: the training examples, in any of ``PromptDataModule``'s forms.
        val: held-out examples for ``val/loss``, in any of the same forms; None: ``val_size`` or no validation.
        batch_size: examples per training step (one optimizer step), a multiple of the number of processes.
        answer_column: the column holding the answer the model learns to write after the prompt (EOS appended).
        messages_column: the column holding each example as a chat (``[{"role": ..., "content": ...}, ...]``,
            with ``tool_calls`` and ``tool`` turns if any), trained on its assistant turns instead of the prompt and
            answer columns; needs a chat template. A ``tools`` column (TRL's convention) gives each row's tool
            schemas to the template; schemas and arguments may be JSON text (:func:`tool_turns`).
        max_length: longest example (prompt + answer) in tokens; None: the model's positions, which a value above
            is refused in ``setup``, before any data or model loads (a model does not train past its positions).
        overlong: examples over ``max_length`` are dropped (``"filter"``, counted in the log) or refused (``"error"``).
        chat_template: render each prompt/answer pair as a user and an assistant message with the tokenizer's
            chat template (for instruct models that RL will prompt with ``chat_template=True``).
    """

    def __init__(
        self,
        train: Any,
        *,
        val: Any = None,
        val_size: int | float | None = None,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        prompt_column: str = "prompt",
        answer_column: str = "answer",
        messages_column: str | None = None,
        max_length: int | None = None,
        overlong: str = "filter",
        tokenizer: str | None = None,
        chat_template: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        dataset_config: str | None = None,
        train_split: str = "train",
        val_split: str = "test",
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if max_length is not None and max_length < 1:
            raise ValueError(
                f"SFTDataModule(max_length={max_length}) must be >= 1 (tokens of the longest example). HINT: leave "
                "it None to take the model's positions."
            )
        super().__init__(
            train,
            val=val,
            val_size=val_size,
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            prompt_column=prompt_column,
            messages_column=messages_column,
            max_prompt_length=max_length or 0,  # unused by SFT (no prompts are generated from); see max_length
            overlong=overlong,
            tokenizer=tokenizer,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            dataset_config=dataset_config,
            train_split=train_split,
            val_split=val_split,
            shuffle=shuffle,
            seed=seed,
        )
        self.answer_column = answer_column
        self.max_length = max_length
        self._length_limit: int | None = max_length  # max_length, or the model's positions once set up

    def setup(self, stage: str) -> None:
        """Check ``max_length`` against the model's positions, then load, check and tokenize the examples.

        Runs on: every process, before any model loads (the length check reads only the model's config).

        Raises:
            ValueError: ``max_length`` exceeds the model's ``max_position_embeddings``.
        """
        if self._rows is None:
            self._check_model_positions()
        super().setup(stage)

    def _check_model_positions(self) -> None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        positions = getattr(module, "max_sequence_length", None)  # SFTModule: the actor's positions
        if not isinstance(positions, int):  # used on its own, or a model that states no limit: max_length as given
            return
        if self.max_length is None:
            self._length_limit = positions
            return
        model = getattr(getattr(module, "actor", None), "path", "the actor")
        check_sequence_length(
            prompt_length=self.max_length,
            max_new_tokens=0,
            limit=positions,
            engine="the model's max_position_embeddings",
            prompt_setting=f"up to SFTDataModule(max_length={self.max_length})",
            subject="Examples",
            hint=(
                f"set SFTDataModule(max_length=) to at most {positions} (`--data.max_length {positions}`), or leave it "
                f"None to take the model's positions; longer examples are dropped (overlong='filter') or refused "
                f"(overlong='error'). The model: {model!r}."
            ),
        )

    def _prepare(self, dataset: Any, which: str, *, min_rows: int) -> list[dict[str, Any]]:
        """Check ``dataset``'s columns and rows, tokenize each example with its loss mask, drop overlong ones."""
        chat = self.messages_column is not None
        needed = {"messages_column": self.messages_column} if chat else {}
        needed = needed or {"prompt_column": self.prompt_column, "answer_column": self.answer_column}
        for setting, col in needed.items():
            if col not in dataset.column_names:
                raise KeyError(
                    f"SFTDataModule({setting}={col!r}): the {which} data has no such column. Columns: "
                    f"{dataset.column_names}. HINT: set {setting} to the column holding the "
                    f"{'chats' if chat else setting.removesuffix('_column') + 's'}."
                )
        clash = sorted(set(dataset.column_names) & SFT_COLUMNS)
        if clash:
            raise ValueError(
                f"SFTDataModule: {which} dataset columns {clash} clash with the batch tensors SFT adds. HINT: "
                "rename them (datasets.Dataset.rename_column); SFTDataModule tokenizes the text itself."
            )
        limit = self._length_limit

        def encoded() -> Iterator[tuple[int, int, dict[str, Any]]]:
            for i, row in enumerate(dataset):
                ids, mask = self._encode_row(row, row_index=i, which=which)
                if not any(mask):
                    raise ValueError(f"SFTDataModule: row {i} of the {which} data has no token to train on.")
                yield i, len(ids), {**row, "input_ids": ids, "loss_mask": mask}

        return keep_within(
            encoded(),
            self,
            limit=limit,
            setting=f"max_length={limit}" if self.max_length is not None else f"the model's {limit} positions",
            knob="max_length (up to the model's positions)",
            tokens="tokens",
            rows="examples",
            which=which,
            total=len(dataset),
            min_rows=min_rows,
        )

    def _encode_row(self, row: dict[str, Any], *, row_index: int, which: str) -> tuple[list[int], list[int]]:
        tok = self._tokenizer
        if self.messages_column is not None:
            messages = check_messages(
                row[self.messages_column], column=self.messages_column, row=row_index, which=which
            )
            messages, tools = tool_turns(messages, row.get("tools"))
            return encode_chat(tok, messages, tools=tools, chat_template_kwargs=self.chat_template_kwargs)
        prompt, answer = row[self.prompt_column], row[self.answer_column]
        for value, col in ((prompt, self.prompt_column), (answer, self.answer_column)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(
                    f"SFTDataModule: row {row_index} has an empty or non-text value in column {col!r} of the "
                    f"{which} data ({value!r:.80}). HINT: drop or fix such rows (datasets.Dataset.filter)."
                )
        if self.chat_template:
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            return encode_chat(tok, chat, chat_template_kwargs=self.chat_template_kwargs)
        return encode_prompt_answer(tok, prompt, answer)

    def collate(self, rows: list[dict[str, Any]]) -> Batch:
        """Right-pad the examples of ``rows`` into a Batch (:func:`collate_sft`). Runs on: every process."""
        pad = self._tokenizer.pad_token_id
        return collate_sft(rows, pad_token_id=pad if pad is not None else _eos_id(self._tokenizer))
