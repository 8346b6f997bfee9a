"""Prompt data: a LightningDataModule over a ``datasets.Dataset`` and a loader whose position resumes exactly.

Each batch is a :class:`~lightning_rlhf.batch.Batch` with ``prompts`` / ``prompt_mask`` (left-padded token ids),
``uid`` (the prompt's index in the batch, used to group samples) and every dataset column as a Python list
(``prompt`` text, reference answers, ...), which reward functions receive by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_rlhf.batch import Batch

__all__ = ["RESERVED_COLUMNS", "PromptDataModule", "PromptLoader"]

RESERVED_COLUMNS = frozenset(
    {
        "prompts",
        "prompt_mask",
        "prompt_ids",
        "loss_mask",
        "baselines",
        "uid",
        "responses",
        "response_mask",
        "response_truncated",
        "completion",
        "scores",
        "costs",
        "cost_values",
        "cost_returns",
        "old_logprobs",
        "ref_logprobs",
        "rollout_logprobs",
        "values",
        "token_rewards",
        "advantages",
        "returns",
    }
)
"""Batch columns the framework writes; a dataset column with one of these names would be overwritten."""


class PromptLoader:
    """Shuffled (per epoch, seeded) batches of prompt rows, with a resumable position.

    Runs on: every process (all ranks read the same batches; only the controller's copy is used).
    Lightning saves :meth:`state_dict` in checkpoints and calls :meth:`load_state_dict` on resume. The
    position is that of the last batch the *trainer consumed* (the strategy reports it via
    :meth:`mark_consumed`), not of the last one fetched: Lightning fetches one batch ahead.
    """

    def __init__(
        self,
        rows: list[dict[str, Any]],
        *,
        batch_size: int,
        collate: Callable[[list[dict[str, Any]]], Batch],
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        self.rows = rows
        self.batch_size = batch_size
        self.collate = collate
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0  # epoch of the next iteration
        self._skip = 0  # batches of that epoch to skip (set on resume)
        self._position = (0, 0)  # (epoch, batches of it trained on), as reported by the strategy

    def __len__(self) -> int:
        n = len(self.rows)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + self._epoch)
            order = torch.randperm(len(self.rows), generator=gen).tolist()
        start, self._skip = self._skip, 0
        for b in range(start, len(self)):
            idx = order[b * self.batch_size : (b + 1) * self.batch_size]
            batch = self.collate([self.rows[i] for i in idx])
            batch.meta["data_position"] = (self._epoch, b)
            yield batch
        self._epoch += 1

    def sample(self, count: int, *, key: int) -> Batch:
        """``count`` prompt rows drawn at random, outside the epoch's order (DAPO's extra sampling rounds).

        Runs on: controller. The draw depends only on ``seed`` and ``key`` (the caller passes step and round),
        so a resumed run draws the same rows, and the epoch's position is not moved.
        """
        if count > len(self.rows):
            raise ValueError(f"PromptLoader.sample: {count} rows asked, the dataset has {len(self.rows)}.")
        gen = torch.Generator().manual_seed(self.seed * 100_003 + 1_000_000_007 * (key + 1))
        idx = torch.randperm(len(self.rows), generator=gen)[:count].tolist()
        return self.collate([self.rows[i] for i in idx])

    def mark_consumed(self, batch: Batch) -> None:
        """Record that ``batch`` was trained on. Runs on: every process, in the strategy's step."""
        pos = batch.meta.get("data_position")
        if pos is not None:
            epoch, index = pos
            self._position = (epoch + 1, 0) if index + 1 >= len(self) else (epoch, index + 1)

    def state_dict(self) -> dict[str, int]:
        """Position to resume from: epoch and batches consumed in it."""
        return {"epoch": self._position[0], "consumed": self._position[1]}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration skips the batches already consumed in the saved epoch."""
        self._epoch = int(state["epoch"])
        self._skip = int(state["consumed"])
        self._position = (self._epoch, self._skip)


class PromptDataModule(L.LightningDataModule):
    """Prompts from a ``datasets.Dataset`` or a local jsonl/json/parquet/csv file.

    Runs on: every process. Validation (column present, no empty prompts, length limit) happens in
    ``setup``, before any model is loaded.

    Args:
        train: a ``datasets.Dataset``, or the path of a data file.
        batch_size: prompts per RL step (the samples per step are ``batch_size * RolloutConfig.n``).
        prompt_column: the column holding the prompt text.
        max_prompt_length: longest prompt in tokens; longer ones are dropped (``overlong="filter"``, logged with
            a count) or rejected (``overlong="error"``).
        overlong: what to do with prompts over ``max_prompt_length``.
        tokenizer: tokenizer path; None takes the LightningModule's tokenizer.
        chat_template: render each prompt as one user message with the tokenizer's chat template (for
            instruct models); reward functions still receive the plain prompt text.
        shuffle: reshuffle every epoch (seeded).
        seed: shuffling seed.
    """

    def __init__(
        self,
        train: Any,
        *,
        batch_size: int = 8,
        prompt_column: str = "prompt",
        max_prompt_length: int = 512,
        overlong: str = "filter",
        tokenizer: str | None = None,
        chat_template: bool = False,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"PromptDataModule(batch_size={batch_size}) must be >= 1.")
        if overlong not in ("filter", "error"):
            raise ValueError(f"PromptDataModule(overlong={overlong!r}): expected 'filter' or 'error'.")
        self.train = train
        self.batch_size = batch_size
        self.prompt_column = prompt_column
        self.max_prompt_length = max_prompt_length
        self.overlong = overlong
        self.tokenizer_path = tokenizer
        self.chat_template = chat_template
        self.shuffle = shuffle
        self.seed = seed
        self._rows: list[dict[str, Any]] | None = None
        self._loader: PromptLoader | None = None
        self._tokenizer: Any = None

    def setup(self, stage: str) -> None:
        """Load, validate and tokenize the prompts. Runs on: every process, before models are loaded."""
        if self._rows is not None:
            return
        self._tokenizer = self._resolve_tokenizer()
        dataset = _load_dataset(self.train)
        col = self.prompt_column
        if col not in dataset.column_names:
            raise KeyError(
                f"PromptDataModule(prompt_column={col!r}): the dataset has no such column. "
                f"Columns: {dataset.column_names}. HINT: set prompt_column to the column holding the prompt text."
            )
        clash = sorted(set(dataset.column_names) & RESERVED_COLUMNS)
        if clash:
            raise ValueError(
                f"PromptDataModule: dataset columns {clash} clash with the rollout columns lightning_rlhf adds. "
                "HINT: rename them (datasets.Dataset.rename_column) before training."
            )
        rows, too_long = [], 0
        for i, row in enumerate(dataset):
            text = row[col]
            if not isinstance(text, str) or not text.strip():
                raise ValueError(
                    f"PromptDataModule: row {i} has an empty or non-text prompt in column {col!r} ({text!r}). "
                    "HINT: drop or fix such rows before training."
                )
            ids = self._encode(text)
            if len(ids) > self.max_prompt_length:
                if self.overlong == "error":
                    raise ValueError(
                        f"PromptDataModule: row {i} has {len(ids)} prompt tokens > max_prompt_length="
                        f"{self.max_prompt_length}. HINT: raise max_prompt_length or use overlong='filter'."
                    )
                too_long += 1
                continue
            rows.append({**row, "prompt_ids": ids})
        if too_long:
            rank_zero_info(
                f"PromptDataModule: dropped {too_long} of {len(dataset)} prompts longer than "
                f"max_prompt_length={self.max_prompt_length} tokens."
            )
        if len(rows) < self.batch_size:
            raise ValueError(
                f"PromptDataModule: {len(rows)} prompts left after filtering, fewer than batch_size="
                f"{self.batch_size}. HINT: lower batch_size or raise max_prompt_length."
            )
        self._rows = rows

    def _encode(self, text: str) -> list[int]:
        if not self.chat_template:
            return list(self._tokenizer(text, add_special_tokens=True)["input_ids"])
        if getattr(self._tokenizer, "chat_template", None) is None:
            raise ValueError(
                "PromptDataModule(chat_template=True): the tokenizer has no chat template. "
                "HINT: use an instruct model's tokenizer or chat_template=False."
            )
        rendered = self._tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(self._tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def _resolve_tokenizer(self) -> Any:
        if self.tokenizer_path is not None:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.tokenizer_path)
        module = self.trainer.lightning_module if self.trainer is not None else None
        tok = getattr(module, "tokenizer", None)
        if tok is None:
            raise ValueError("PromptDataModule needs a tokenizer: pass tokenizer=<path> or use it with an RLHFModule.")
        return tok

    def collate(self, rows: list[dict[str, Any]]) -> Batch:
        """Left-pad the prompt ids of ``rows`` into a Batch. Runs on: every process."""
        width = max(len(r["prompt_ids"]) for r in rows)
        pad = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        prompts = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["prompt_ids"])
            prompts[i, width - n :] = torch.tensor(r["prompt_ids"])
            mask[i, width - n :] = 1
        columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt_ids"}
        if self.prompt_column != "prompt":
            columns["prompt"] = columns[self.prompt_column]
        return Batch({"prompts": prompts, "prompt_mask": mask, "uid": torch.arange(len(rows))}, columns)

    def train_dataloader(self) -> PromptLoader:
        """The resumable prompt loader. Runs on: every process."""
        assert self._rows is not None, "call setup('fit') first"
        if self._loader is None:
            self._loader = PromptLoader(
                self._rows,
                batch_size=self.batch_size,
                collate=self.collate,
                shuffle=self.shuffle,
                seed=self.seed,
            )
        return self._loader


def _load_dataset(source: Any) -> Any:
    import datasets

    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise FileNotFoundError(f"PromptDataModule(train={path!r}): no such file.")
        ext = os.path.splitext(path)[1].lstrip(".")
        builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}.get(ext)
        if builder is None:
            raise ValueError(
                f"PromptDataModule(train={path!r}): unknown file type '.{ext}'. "
                "Expected .jsonl, .json, .parquet or .csv."
            )
        return datasets.load_dataset(builder, data_files=path, split="train")
    raise TypeError(
        f"PromptDataModule(train=...) expects a datasets.Dataset or a file path, got {type(source).__name__}."
    )
