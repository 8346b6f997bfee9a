"""``RolloutSamples``: every n steps, a few of the step's rollouts in a jsonl file in the run folder and, with a
``WandbLogger``, as a ``wandb.Table`` (what TRL logs as its completions table)."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_rlhf.batch import Batch
from lightning_rlhf.callbacks.history import run_folder, step_of
from lightning_rlhf.data.vision import VISION_COLUMN

__all__ = ["SAMPLE_COLUMNS", "RolloutSamples", "conversation_text", "sample_rows"]

#: the fields of each sample, in the jsonl rows and the wandb table
SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward")


def conversation_text(messages: list[dict[str, Any]]) -> str:
    """An episode's messages as readable text, one ``[role] content`` block per message (a tool message names its
    tool): the wandb table's ``conversation`` column. Runs on: controller (rank 0)."""
    parts = []
    for m in messages:
        role = f"tool {m['name']}" if m.get("role") == "tool" and m.get("name") else m.get("role")
        parts.append(f"[{role}] {m.get('content', '')}")
    return "\n".join(parts)


THUMBNAIL = 128
"""The longest side, in pixels, of the thumbnails of a sample's images (``samples.jsonl``'s ``images``, the table)."""


def sample_rows(rollout: Batch, count: int, *, step: int) -> list[dict[str, Any]]:
    """``count`` rows spread evenly over ``rollout`` (several prompts, not one prompt's group), as dicts with
    :data:`SAMPLE_COLUMNS` (empty strings for a missing column); episodes add ``episode`` (the messages), ``turns`` and
    ``tool_calls``; prompts with images add ``images`` (the PIL images). Runs on: controller (rank 0)."""
    size = len(rollout)
    count = min(count, size)
    index = [i * size // count for i in range(count)]
    prompts, completions = rollout.columns.get("prompt"), rollout.columns.get("completion")
    scores = rollout["scores"].tolist()
    rows = [
        {
            "step": step,
            "prompt": str(prompts[i]) if prompts is not None else "",
            "completion": str(completions[i]) if completions is not None else "",
            "reward": float(scores[i]),
        }
        for i in index
    ]
    vision = rollout.columns.get(VISION_COLUMN)
    if vision is not None:
        for row, i in zip(rows, index, strict=True):
            row["images"] = list(vision[i].images) if vision[i] is not None else []
    episodes = rollout.columns.get("episode")
    if episodes is not None:
        for row, i in zip(rows, index, strict=True):
            row["episode"] = list(episodes[i])
            row["turns"] = int(rollout["turns"][i])
            row["tool_calls"] = int(rollout["tool_calls"][i])
    return rows


class RolloutSamples(L.Callback):
    """After every ``every_n_steps``-th step (the steps ``n-1, 2n-1, ...`` of ``metrics.csv``), append
    ``num_samples`` of its rollouts (:func:`sample_rows`) to ``<run folder>/samples.jsonl``, one JSON object per
    line, and, with a ``WandbLogger``, log them as a ``wandb.Table`` under ``table_key`` (episodes add a
    ``conversation`` column, the messages as text).

    Runs on: every rank; rank 0 writes. Reads ``last_rollout``, which ``RLHFModule.log_step`` sets on the
    controller: a custom ``training_step`` that does not call ``log_step`` must set it (a ``Batch`` with
    ``scores`` and the ``prompt``/``completion`` columns).

    Args:
        every_n_steps: write after every n-th RL step.
        num_samples: rollouts per write, spread over the batch.
        filename: the jsonl file, in the run folder (the first logger's ``log_dir``) unless absolute.
        table_key: the wandb key of the table.
    """

    def __init__(
        self, every_n_steps: int = 10, num_samples: int = 4, filename: str = "samples.jsonl", table_key: str = "samples"
    ) -> None:
        if every_n_steps < 1 or num_samples < 1:
            raise ValueError(
                f"RolloutSamples(every_n_steps={every_n_steps}, num_samples={num_samples}): both must be >= 1."
            )
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.filename = filename
        self.table_key = table_key
        self.path: str | None = None
        self._warned = False

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Write the samples of every n-th step. Runs on: every rank; rank 0 writes."""
        step = step_of(trainer)
        if not trainer.is_global_zero or (step + 1) % self.every_n_steps:
            return
        rollout = getattr(pl_module, "last_rollout", None)
        if not isinstance(rollout, Batch) or "scores" not in rollout:
            if not self._warned:
                rank_zero_warn(
                    f"RolloutSamples: `{type(pl_module).__name__}.last_rollout` holds no scored rollout, so no "
                    "samples are written. HINT: call `self.log_step(rollout, ...)` in training_step, or set "
                    "`self.last_rollout` to a Batch with `scores` and the `prompt`/`completion` columns."
                )
                self._warned = True
            return
        rows = sample_rows(rollout, self.num_samples, step=step)
        self.path = os.path.join(run_folder(trainer), self.filename)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        thumbnails = _save_thumbnails(rows, os.path.dirname(self.path), step)
        with open(self.path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                columns = list(SAMPLE_COLUMNS)
                data = [[row[c] for c in columns] for row in rows]
                if "episode" in rows[0]:
                    columns.append("conversation")
                    for line, row in zip(data, rows, strict=True):
                        line.append(conversation_text(row["episode"]))
                if thumbnails is not None:  # the first image of each prompt, beside its completion
                    import wandb

                    columns.append("image")
                    for line, images in zip(data, thumbnails, strict=True):
                        line.append(wandb.Image(images[0]) if images else None)
                logger.log_table(self.table_key, columns=columns, data=data, step=step)


def _save_thumbnails(rows: list[dict[str, Any]], folder: str, step: int) -> list[list[Any]] | None:
    """Thumbnails (:data:`THUMBNAIL` pixels at most) of the rows' ``images``, written as PNG files under
    ``folder/sample_images/``; each row's ``images`` becomes their paths relative to ``folder``. Returns the thumbnails
    per row (None when the rows have no images). Runs on: controller (rank 0)."""
    if not rows or "images" not in rows[0]:
        return None
    os.makedirs(os.path.join(folder, "sample_images"), exist_ok=True)
    out: list[list[Any]] = []
    for r, row in enumerate(rows):
        kept, paths = [], []
        for k, image in enumerate(row["images"]):
            small = image.copy()
            small.thumbnail((THUMBNAIL, THUMBNAIL))
            path = os.path.join("sample_images", f"step{step}-{r}-{k}.png")
            small.save(os.path.join(folder, path))
            kept.append(small)
            paths.append(path)
        row["images"] = paths
        out.append(kept)
    return out
