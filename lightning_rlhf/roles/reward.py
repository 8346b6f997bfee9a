"""The reward: a Python function over decoded text, or a transformers sequence-classification model."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.roles.base import Role, disable_dropout
from lightning_rlhf.strategy.dispatch import Dispatch, role_method

__all__ = ["RewardFn", "RewardFunctionError", "RewardRole"]

RewardFn = Callable[..., Sequence[float]]
"""``fn(prompts: list[str], completions: list[str], **dataset_columns) -> list[float]`` (TRL's convention)."""


class RewardFunctionError(RuntimeError):
    """The reward function raised, or returned something other than one finite number per completion."""


class RewardRole(Role):
    """Scores rollouts into ``scores`` ``[B]``.

    Runs on: every process; ``score`` runs on all ranks, each on its share of the rollouts.

    Args:
        reward: a reward function, or the path / hub id of a sequence-classification model with one output.
        tokenizer: the actor's tokenizer, to decode responses.
        micro_batch_size: samples per forward of a reward model on one rank.
        key: the column the scores go to (``scores``; a Safe-RLHF cost role writes ``costs``).
    """

    name = "reward"

    def __init__(self, reward: RewardFn | str, *, tokenizer: Any, micro_batch_size: int, key: str = "scores") -> None:
        super().__init__()
        self.key = key
        self.fn: RewardFn | None = None if isinstance(reward, str) else reward
        self.path = reward if isinstance(reward, str) else None
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self._model_tokenizer: Any = None

    def load(self) -> None:
        """Load the reward model, if the reward is one (every rank, before sharding)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if self.path is not None and self.model is None:
            model = AutoModelForSequenceClassification.from_pretrained(self.path, num_labels=1, dtype=torch.float32)
            disable_dropout(model)
            self.model = model.eval().requires_grad_(False)
            self._model_tokenizer = AutoTokenizer.from_pretrained(self.path)
            self._model_tokenizer.padding_side = "right"
            if self._model_tokenizer.pad_token is None:
                self._model_tokenizer.pad_token = self._model_tokenizer.eos_token
            if getattr(model.config, "pad_token_id", None) is None:
                model.config.pad_token_id = self._model_tokenizer.pad_token_id

    @role_method(Dispatch.DP_SPLIT)
    def score(self, batch: Batch) -> Batch:
        """Decode the responses into ``completion`` and score them into ``scores`` (or the role's ``key``).

        Runs on: every worker rank."""
        completions = [
            self.tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True)
            for row, m in zip(batch["responses"], batch["response_mask"], strict=True)
        ]
        batch["completion"] = completions
        prompts = list(batch["prompt"]) if "prompt" in batch else [""] * len(batch)
        if self.fn is not None:
            scores = self._call_fn(prompts, completions, batch)
        else:
            scores = self._score_model([p + c for p, c in zip(prompts, completions, strict=True)])
        batch[self.key] = scores
        return batch

    def _call_fn(self, prompts: list[str], completions: list[str], batch: Batch) -> torch.Tensor:
        assert self.fn is not None
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        extra = {k: v for k, v in batch.columns.items() if k not in ("prompt", "completion")}
        try:
            values = self.fn(prompts, completions, **extra)
        except Exception as err:
            raise RewardFunctionError(
                f"reward function `{name}` raised {type(err).__name__}: {err} "
                f"(called on {len(prompts)} completions; dataset columns passed: {sorted(extra)})"
            ) from err
        if not isinstance(values, Sequence | torch.Tensor) or isinstance(values, str):
            raise RewardFunctionError(
                f"reward function `{name}` returned {type(values).__name__}; expected a list of "
                f"{len(prompts)} floats, one per completion."
            )
        if len(values) != len(prompts):
            raise RewardFunctionError(
                f"reward function `{name}` returned {len(values)} values for {len(prompts)} completions; "
                "expected exactly one float per completion."
            )
        out = []
        for i, v in enumerate(values):
            try:
                f = float(v)
            except (TypeError, ValueError):
                f = math.nan
            if not math.isfinite(f):
                raise RewardFunctionError(
                    f"reward function `{name}` returned {v!r} for completion {i} "
                    f"(prompt {prompts[i]!r}, completion {completions[i]!r}); expected a finite float. "
                    "HINT: return 0.0 (or another fallback) for completions you cannot score."
                )
            out.append(f)
        return torch.tensor(out, dtype=torch.float32)

    def _score_model(self, texts: list[str]) -> torch.Tensor:
        assert self.model is not None
        device = next(self.model.parameters()).device
        scores = []
        with torch.no_grad():
            for start in range(0, len(texts), self.micro_batch_size):
                enc = self._model_tokenizer(
                    texts[start : start + self.micro_batch_size], return_tensors="pt", padding=True
                ).to(device)
                scores.append(self.model(**enc).logits[:, 0].float().cpu())
        return torch.cat(scores)
