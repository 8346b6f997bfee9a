"""Prompt data: a LightningDataModule of training and validation prompts and a loader whose position resumes exactly.

Each batch is a :class:`~lightning_rlhf.batch.Batch` with ``prompts`` / ``prompt_mask`` (left-padded token ids),
``uid`` (the prompt's index in the batch) and every dataset column as a list, which reward functions get by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_rlhf.batch import Batch
from lightning_rlhf.config.models import resolve_model_path
from lightning_rlhf.data.chat import chat_prompt_text, check_messages, render_chat, template_kwargs
from lightning_rlhf.data.sources import load_prompt_dataset, split_off
from lightning_rlhf.data.vision import VISION_COLUMN, PromptImages, check_image_prompts

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
        VISION_COLUMN,
    }
)
"""Batch columns the framework writes; a dataset column with one of these names would be overwritten."""


@dataclasses.dataclass(eq=False)
class PromptLoader:
    """Shuffled (per epoch, seeded) batches of prompt rows, with a resumable position.

    Runs on: every process (all ranks read the same batches; only the controller's copy is used). The position
    saved in checkpoints is that of the last batch the *trainer consumed* (:meth:`mark_consumed`), not of the last
    one fetched: Lightning fetches one batch ahead.
    """

    rows: list[dict[str, Any]] = dataclasses.field(repr=False)
    _: dataclasses.KW_ONLY
    batch_size: int
    collate: Callable[[list[dict[str, Any]]], Batch] = dataclasses.field(repr=False)
    shuffle: bool = True
    """Reshuffle every epoch (seeded by ``seed`` and the epoch)."""
    seed: int = 0
    drop_last: bool = True
    _epoch: int = dataclasses.field(default=0, init=False, repr=False)
    """Epoch of the next iteration."""
    _skip: int = dataclasses.field(default=0, init=False, repr=False)
    """Batches of that epoch to skip (set on resume)."""
    _position: tuple[int, int] = dataclasses.field(default=(0, 0), init=False, repr=False)
    """(epoch, batches of it trained on), as reported by the strategy."""

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

        Runs on: controller. The draw depends only on ``seed`` and ``key`` (the caller passes step and round), so a
        resumed run draws the same rows, and the epoch's position is not moved."""
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
    """Prompts for training and validation, from ``datasets`` objects, local files or folders, or hub datasets.

    Runs on: every process. Every check (files, columns, chat shapes, empty prompts, length limit, rows left)
    happens in ``setup``, on the training and the validation data alike, before any model is loaded. With an
    environment on the module, a row's prompt is the episode's first prompt as rendered, and the prompt column is
    optional (docs/agents.md).

    Args:
        train: a ``datasets.Dataset`` or ``DatasetDict``, a ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a
            folder, or a hub dataset name (``"openai/gsm8k"``). None, with an environment whose ``reset`` makes the
            prompts: ``batch_size`` placeholder rows, the run's length being ``Trainer(max_steps=...)``.
        val: the validation prompts, in any of the same forms; None: ``val_size`` or no validation.
        val_size: split validation prompts off ``train`` instead: a row count or a fraction in (0, 1), drawn with
            ``seed`` before any filtering (the same rows in every run and on every rank).
        batch_size: prompts per RL step (the samples per step are ``batch_size * RolloutConfig.n``).
        val_batch_size: prompts per validation batch (the last may be smaller); None: ``batch_size``.
        prompt_column: the column holding the prompt text.
        image_column: the column holding each prompt's images (a vision-language actor, docs/vision.md): one image or
            a list, each a ``datasets.Image`` value, a PIL image, a path or bytes. A text prompt becomes one user turn,
            its images first, rendered with the chat template; in a ``messages_column`` chat the ``{"type": "image"}``
            items take the row's images in order (their count must match). Each row then carries a
            :class:`~lightning_rlhf.data.vision.VisionInputs` in the batch's ``vision`` column.
        messages_column: the column holding each prompt as a chat (``[{"role": "user", "content": ...}, ...]``),
            rendered with the chat template and the generation prompt, instead of ``prompt_column``. Reward
            functions get the last user message as the ``prompt``, and the chat under this column's name.
        max_prompt_length: longest prompt in tokens (with an environment: the episode's rendered first prompt).
        overlong: prompts over ``max_prompt_length`` are dropped (``"filter"``, counted in the log) or refused
            (``"error"``).
        tokenizer: tokenizer path; None takes the LightningModule's tokenizer.
        chat_template: render each text prompt as one user message with the tokenizer's chat template (for
            instruct models); reward functions still receive the plain prompt text.
        chat_template_kwargs: extra variables for the chat template wherever it renders this data (e.g.
            ``{"enable_thinking": False}`` for Qwen3): prompts, episodes, SFT examples and a reward model's chats.
        dataset_config: configuration name of a hub dataset or folder (``"main"`` for GSM8K); None: its default.
        train_split: split of a hub dataset, folder or ``DatasetDict`` to train on (``"train[:1000]"`` works too).
        val_split: split of ``val`` when it is a hub dataset, folder or ``DatasetDict``.
        shuffle: reshuffle every epoch (seeded). Validation batches are never shuffled.
        seed: shuffling seed, and the seed of the ``val_size`` split.
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
        messages_column: str | None = None,
        image_column: str | None = None,
        max_prompt_length: int = 512,
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
        super().__init__()
        if train is None and (val_size is not None or val is not None):
            raise ValueError(
                f"{type(self).__name__}(train=None, val={val!r}, val_size={val_size!r}): without training data "
                "(an environment that makes its own prompts) there is nothing to validate on. HINT: pass train=, or "
                "leave val and val_size None."
            )
        if batch_size < 1:
            raise ValueError(f"PromptDataModule(batch_size={batch_size}) must be >= 1.")
        if val_batch_size is not None and val_batch_size < 1:
            raise ValueError(f"PromptDataModule(val_batch_size={val_batch_size}) must be None or >= 1.")
        if overlong not in ("filter", "error"):
            raise ValueError(f"PromptDataModule(overlong={overlong!r}): expected 'filter' or 'error'.")
        if val_size is not None:
            if val is not None:
                raise ValueError(
                    "PromptDataModule: pass either val=... (separate validation data) or val_size=... (split off "
                    "the training data), not both."
                )
            fraction = isinstance(val_size, float) and 0 < val_size < 1
            count = isinstance(val_size, int) and not isinstance(val_size, bool) and val_size >= 1
            if not (fraction or count):
                raise ValueError(
                    f"PromptDataModule(val_size={val_size!r}): expected a row count (int >= 1) or a fraction "
                    "(float in (0, 1)) of the training data."
                )
        for name, split in (("train_split", train_split), ("val_split", val_split)):
            if not isinstance(split, str):
                raise TypeError(
                    f"PromptDataModule({name}={split!r}) names a split of a hub dataset or folder (e.g. 'test'). "
                    "HINT: to split validation prompts off the training data, use val_size=<count or fraction>."
                )
        self.train = train
        self.val = val
        self.val_size = val_size
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.prompt_column = prompt_column
        self.messages_column = messages_column
        self.image_column = image_column
        self.max_prompt_length = max_prompt_length
        self.overlong = overlong
        self.tokenizer_path = tokenizer
        self.chat_template = chat_template
        self.chat_template_kwargs = template_kwargs(type(self).__name__, chat_template_kwargs)
        self.dataset_config = dataset_config
        self.train_split = train_split
        self.val_split = val_split
        self.shuffle = shuffle
        self.seed = seed
        self._rows: list[dict[str, Any]] | None = None
        self._val_rows: list[dict[str, Any]] | None = None
        self._loader: PromptLoader | None = None
        self._tokenizer: Any = None
        self._images: PromptImages | None = None  # with image_column: decoding, placeholders, processor inputs

    def setup(self, stage: str) -> None:
        """Load, check and tokenize the training and validation prompts. Runs on: every process, before models load."""
        if self._rows is not None:
            return
        self._tokenizer = self._resolve_tokenizer()
        if self.image_column is not None:
            self._images = self._prompt_images(self.image_column)
        train = self._placeholder_rows() if self.train is None else None
        if train is None:
            train = load_prompt_dataset(self.train, setting="train", config=self.dataset_config, split=self.train_split)
        val = None
        if self.val is not None:
            val = load_prompt_dataset(self.val, setting="val", config=self.dataset_config, split=self.val_split)
        elif self.val_size is not None:
            train, val = split_off(train, self.val_size, seed=self.seed)
        rows = self._prepare(train, "training", min_rows=self.batch_size)
        if val is not None:
            missing = sorted(set(train.column_names) - set(val.column_names))
            if missing:
                raise KeyError(
                    f"PromptDataModule(val=...): the validation data lacks the training columns {missing}. "
                    "HINT: reward functions receive the same columns during validation; add them to the "
                    "validation data."
                )
            self._val_rows = self._prepare(val, "validation", min_rows=1)
        self._rows = rows

    def _actor(self) -> Any:
        """The module's actor role (it owns the environment and renders episode prompts), None before a fit."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        return getattr(module, "actor", None)

    def _environment(self) -> Any:
        """The module's environment factory (one environment per episode), None without one."""
        return getattr(self._actor(), "environment", None)

    def _placeholder_rows(self) -> Any:
        """``batch_size`` rows without a prompt, for an environment that makes its own (``train=None``)."""
        import datasets

        if self._environment() is None:
            raise ValueError(
                "PromptDataModule(train=None): no training prompts, and the module has no environment to make them. "
                "HINT: pass the prompts (a datasets.Dataset, a file, a hub name), or give the module an environment "
                "whose reset() returns each episode's prompt."
            )
        max_steps = getattr(self.trainer, "max_steps", -1)
        if max_steps is None or max_steps < 0:
            raise ValueError(
                "PromptDataModule(train=None): the environment makes every prompt, so no dataset bounds the run. "
                "HINT: set Trainer(max_steps=...)."
            )
        return datasets.Dataset.from_dict({"prompt": [""] * self.batch_size})

    def _prepare(self, dataset: Any, which: str, *, min_rows: int) -> list[dict[str, Any]]:
        """Check ``dataset``'s columns and rows, tokenize (or render) the prompts, drop (or reject) overlong ones."""
        chat = self.messages_column is not None
        col = self.messages_column or self.prompt_column
        setting = "messages_column" if chat else "prompt_column"
        environment = self._environment()
        if col not in dataset.column_names and not (environment is not None and not chat):
            raise KeyError(
                f"PromptDataModule({setting}={col!r}): the {which} data has no such column. "
                f"Columns: {dataset.column_names}. HINT: set {setting} to the column holding the prompts."
            )
        clash = sorted(set(dataset.column_names) & RESERVED_COLUMNS)
        if clash:
            raise ValueError(
                f"PromptDataModule: {which} dataset columns {clash} clash with the rollout columns lightning_rlhf "
                "adds. HINT: rename them (datasets.Dataset.rename_column) before training."
            )
        if self.image_column is not None and self.image_column not in dataset.column_names:
            raise KeyError(
                f"PromptDataModule(image_column={self.image_column!r}): the {which} data has no such column. "
                f"Columns: {dataset.column_names}. HINT: set image_column to the column holding the images."
            )
        entries: list[tuple[int, dict[str, Any], str, list[int]]] = []
        for i, row in enumerate(dataset):
            if self._images is not None:
                i, row, text, ids = self._with_images(i, row, col, which)
            elif chat:
                messages = check_messages(row[col], column=col, row=i, which=which)
                text = chat_prompt_text(messages)
                ids = [] if environment is not None else self._render(messages, row=i, which=which)
            else:
                text = row.get(col)
                if environment is not None and text in (None, ""):  # the environment's reset makes the prompt
                    text = ""
                elif not isinstance(text, str) or not text.strip():
                    raise ValueError(
                        f"PromptDataModule: row {i} has an empty or non-text prompt in column {col!r} of the {which} "
                        f"data ({text!r:.80}). HINT: drop or fix such rows before training (a column of chats goes "
                        "in messages_column)."
                    )
                ids = [] if environment is not None else self._encode(text, row=i, which=which)
            entries.append((i, row, text, ids))
        what = "prompt tokens"
        if environment is not None:  # the episodes' first prompts, as the rollout renders them
            rendered = self._actor().episode_prompt_ids(
                self._tokenizer, [{**row, "prompt": text} for _, row, text, _ in entries], self.chat_template_kwargs
            )
            entries = [(i, row, text, ids) for (i, row, text, _), (ids, _) in zip(entries, rendered, strict=True)]
            what = "tokens in its episode's first prompt (reset's messages, system turn and tool schemas rendered)"
        return keep_within(
            ((i, len(ids), {**row, "prompt": text, "prompt_ids": ids}) for i, row, text, ids in entries),
            self,
            limit=self.max_prompt_length,
            setting=f"max_prompt_length={self.max_prompt_length}",
            knob="max_prompt_length",
            tokens=what,
            rows="prompts",
            which=which,
            total=len(dataset),
            min_rows=min_rows,
        )

    def _with_images(
        self, i: int, row: dict[str, Any], col: str, which: str
    ) -> tuple[int, dict[str, Any], str, list[int]]:
        """A row with images: its images decoded, its prompt rendered with one placeholder per image (a text prompt as
        one user turn, images first) and each placeholder repeated once per merged patch; the counts checked."""
        assert self._images is not None
        images = self._images.decode(row, index=i, which=which)
        if self.messages_column is not None:
            messages = check_messages(row[col], column=col, row=i, which=which)
            self._images.check_chat(messages, images, index=i, which=which)
            text = chat_prompt_text(messages)
        else:
            value = row.get(col)
            if not isinstance(value, str):
                raise ValueError(
                    f"PromptDataModule: row {i} has a non-text prompt in column {col!r} of the {which} data."
                )
            text = value
            messages = self._images.chat(text, images)
        ids = self._images.expand(self._render(messages, row=i, which=which), images, index=i, which=which)
        return i, {**row, self._images.column: images}, text, ids

    def _prompt_images(self, column: str) -> PromptImages:
        """The image half of the model's processor: from ``tokenizer=``'s folder, else the actor's."""
        from transformers import AutoImageProcessor

        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None:
            check_image_prompts(module, setting=f"image_column={column!r}")
        source = self.tokenizer_path or getattr(getattr(module, "actor", None), "path", None)
        if source is None:
            raise ValueError(
                f"PromptDataModule(image_column={column!r}) needs the model's image processor: pass "
                "tokenizer=<the model folder> or use it with an RLHFModule."
            )
        path = resolve_model_path(source, setting="PromptDataModule(image_column=...)", tokenizer_only=True)
        return PromptImages(column, self._tokenizer, AutoImageProcessor.from_pretrained(path))

    def _render(self, messages: list[dict[str, Any]], *, row: int, which: str) -> list[int]:
        return render_chat(
            self._tokenizer, messages, row=row, which=which, chat_template_kwargs=self.chat_template_kwargs
        )

    def _encode(self, text: str, *, row: int, which: str) -> list[int]:
        if self.chat_template:
            return self._render([{"role": "user", "content": text}], row=row, which=which)
        return list(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    def _resolve_tokenizer(self) -> Any:
        if self.tokenizer_path is not None:
            from transformers import AutoTokenizer

            setting = "PromptDataModule(tokenizer=...)"
            path = resolve_model_path(self.tokenizer_path, setting=setting, tokenizer_only=True)
            return AutoTokenizer.from_pretrained(path)
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
        if self._images is not None:  # the processor's inputs, made per batch (not kept for the whole dataset)
            columns[VISION_COLUMN] = self._images.inputs(rows)
        meta: dict[str, Any] = {"max_prompt_length": self.max_prompt_length}  # an episode's first prompt's bound
        if self.chat_template_kwargs:  # every render of a chat: episodes, a reward model's chats
            meta["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        if self.messages_column is not None or self.chat_template:  # a reward model renders the chat (RewardRole)
            meta |= {"chat_prompt": True, "messages_column": self.messages_column}
        return Batch({"prompts": prompts, "prompt_mask": mask, "uid": torch.arange(len(rows))}, columns, meta)

    def train_dataloader(self) -> PromptLoader:
        """The resumable prompt loader. Runs on: every process."""
        assert self._rows is not None, "call setup('fit') first"
        if self._loader is None:
            self._loader = PromptLoader(
                self._rows, batch_size=self.batch_size, collate=self.collate, shuffle=self.shuffle, seed=self.seed
            )
        return self._loader

    def val_dataloader(self) -> PromptLoader | list[Any]:
        """Every validation prompt, in order (its position is never saved); an empty list (Lightning then skips
        validation) when there are none. Runs on: every process."""
        if self._val_rows is None:
            return []
        return PromptLoader(
            self._val_rows,
            batch_size=self.val_batch_size or self.batch_size,
            collate=self.collate,
            shuffle=False,
            drop_last=False,
        )


def keep_within(
    items: Iterable[tuple[int, int, dict[str, Any]]],
    module: Any,
    *,
    limit: int | None,
    setting: str,
    knob: str,
    tokens: str,
    rows: str,
    which: str,
    total: int,
    min_rows: int,
) -> list[dict[str, Any]]:
    """The rows of ``items`` (``(row index, length, row)``) no longer than ``limit`` tokens: a longer one is dropped
    (``module.overlong="filter"``, counted in one log line) or refused (``"error"``), as are fewer than ``min_rows``
    left. ``setting``, ``knob``, ``tokens`` and ``rows`` are the messages' words for the limit (``max_length=512``),
    the setting to raise, what was counted and what a row is. Runs on: every process, in a data module's ``setup``.

    Raises:
        ValueError: a row over the limit with ``overlong="error"``, or too few rows left, naming the fix.
    """
    owner = type(module).__name__
    kept, too_long = [], 0
    for i, length, row in items:
        if limit is not None and length > limit:
            if module.overlong == "error":
                raise ValueError(
                    f"{owner}: row {i} has {length} {tokens} > {setting} ({which} data). HINT: raise {knob} or use "
                    "overlong='filter'."
                )
            too_long += 1
            continue
        kept.append(row)
    if too_long:
        rank_zero_info(f"{owner}: dropped {too_long} of {total} {which} {rows} longer than {setting} tokens.")
    if len(kept) < min_rows:
        least = f"batch_size={module.batch_size}" if which == "training" else "1"
        raise ValueError(
            f"{owner}: {len(kept)} {rows} left after filtering the {which} data, fewer than {least}. "
            f"HINT: lower batch_size, raise {knob.split(' ')[0]}, or check the data."
        )
    return kept
