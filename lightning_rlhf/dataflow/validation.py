"""Validation of an RL run: the held-out prompts generated with ``ValidationConfig``'s settings, scored, and
measured (``val/*``). ``RLHFModule.validation_step`` runs them; ``module`` is that
:class:`~lightning_rlhf.RLHFModule`.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_rlhf.algorithms import mean_at_n, pass_at_k
from lightning_rlhf.batch import Batch
from lightning_rlhf.roles import RewardRole

__all__ = ["validation_metrics", "validation_rollout"]


def validation_rollout(module: Any, batch: Batch, batch_idx: int = 0) -> Batch:
    """The validation prompts generated (``ValidationConfig.n`` samples each, or one greedy answer) and
    scored: ``len(batch) * n`` rows, prompt-major.

    Runs on: controller. A batch whose prompts do not split evenly over the ranks (the last one) is padded
    with copies of its first prompt for the role calls; their samples are dropped before returning.
    """
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
    """``val/score/mean`` (over samples), ``val/mean@N`` (mean over prompts of each prompt's mean score over
    its N samples), ``val/pass@k`` for each k (unbiased estimator; a sample passes when its score is above
    ``ValidationConfig.pass_threshold``) and ``val/response_length/mean``, of one validation rollout; and,
    as training logs them, each reward component's ``val/reward/<name>/mean`` (before its weight, so a
    weight-0 component is measured too) and ``val/reward/<name>/failed``.

    Runs on: controller. ``rollout`` holds N = ``ValidationConfig.n`` consecutive samples per prompt.
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
