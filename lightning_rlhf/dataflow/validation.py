"""Validation of an RL run: the held-out prompts generated with ``ValidationConfig``'s settings, scored, and
measured (``val/*``), for ``RLHFModule.validation_step`` (``module``)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_rlhf.algorithms import mean_at_n, pass_at_k
from lightning_rlhf.batch import Batch
from lightning_rlhf.roles import RewardRole

__all__ = ["validation_metrics", "validation_rollout"]


def validation_rollout(module: Any, batch: Batch, batch_idx: int = 0) -> Batch:
    """The validation prompts generated (``ValidationConfig.n`` samples each) and scored: ``len(batch) * n`` rows,
    prompt-major (a batch padded to split over the ranks drops the padding's samples). Runs on: controller."""
    cfg, size = module.validation_config, len(batch)
    pad = -size % module.trainer.world_size
    if pad:
        batch = batch.select(torch.cat([torch.arange(size), torch.zeros(pad, dtype=torch.long)]))
    rollout = module.generate_rollout(  # temperature 0: greedy, the same path as RolloutConfig.temperature=0
        batch,
        n=cfg.n,
        temperature=cfg.temperature,
        seed_offset=(batch_idx + 1) * 15_485_863,  # not the training stream's seeds at this step
    )
    rollout = module.reward.score(rollout)
    return rollout.select(torch.arange(size * cfg.n)) if pad else rollout


def validation_metrics(module: Any, rollout: Batch) -> dict[str, float]:
    """``val/score/mean``, ``val/mean@N``, ``val/pass@k`` for each k (a sample passes when its score is above
    ``ValidationConfig.pass_threshold``), ``val/response_length/mean`` and each reward component's
    ``val/reward/<name>/mean`` and ``/failed`` of one validation rollout (N consecutive samples per prompt).

    Runs on: controller.
    """
    cfg = module.validation_config
    scores = rollout["scores"].float().view(-1, cfg.n)  # [P, N]
    out = {"val/score/mean": float(scores.mean()), f"val/mean@{cfg.n}": float(mean_at_n(scores).mean())}
    passed = scores > cfg.pass_threshold
    out |= {f"val/pass@{k}": float(pass_at_k(passed, k=k).mean()) for k in cfg.ks}
    out["val/response_length/mean"] = float(rollout["response_mask"].float().sum(-1).mean())
    for role in module.roles().values():  # the components of the roles that scored it (the columns present)
        if isinstance(role, RewardRole):
            out |= {f"val/{k}": v for k, v in role.metrics(rollout).items()}
    return out
