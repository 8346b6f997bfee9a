"""Pieces of constrained and filtered RL: DAPO's informative-group test and Safe-RLHF's Lagrange multiplier.

Runs on: controller (pure tensor math and a Python-float state, no host syncs in the tensor functions).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["LagrangeMultiplier", "informative_groups", "lagrangian_advantages"]


def informative_groups(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """DAPO's dynamic-sampling test: a group whose samples all got the same score has zero group-relative
    advantage everywhere, so it adds no gradient; such groups are dropped and more prompts are sampled.

    Returns ``(groups, informative)`` of ``[B]`` ``scores`` and ``group_ids``: ``[G]`` the distinct group ids in
    first-seen order, and ``[G]`` bool, True where the group's scores are not all equal.
    """
    groups, inverse = torch.unique(group_ids, sorted=False, return_inverse=True)
    # first-seen order, so the caller keeps prompts in the order they were generated
    first = torch.full((len(groups),), len(group_ids), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(len(group_ids)), reduce="amin")
    order = torch.argsort(first)
    s = scores.float()
    high = torch.full((len(groups),), -math.inf).scatter_reduce(0, inverse, s, reduce="amax")
    low = torch.full((len(groups),), math.inf).scatter_reduce(0, inverse, s, reduce="amin")
    return groups[order], (high > low)[order]


def lagrangian_advantages(reward_advantages: Tensor, cost_advantages: Tensor, *, multiplier: float) -> Tensor:
    """Safe-RLHF's combined advantage ``(A_r - lambda * A_c) / (1 + lambda)`` (Dai et al., 2024, eq. 12).

    Dividing by ``1 + lambda`` keeps the advantage's scale fixed as the multiplier grows, so the PPO clip and
    the learning rate keep their meaning. ``A_c``: the cost's advantages (higher = less safe).
    """
    return (reward_advantages - multiplier * cost_advantages) / (1.0 + multiplier)


class LagrangeMultiplier:
    """The multiplier of the constraint ``E[cost] <= cost_limit``, learned by gradient ascent on ``log lambda``.

    The Lagrangian's gradient with respect to ``log lambda`` is ``lambda * (E[cost] - cost_limit)``: the
    multiplier grows while the policy's mean cost is over the limit and shrinks once it is below, which moves
    the weight of the cost term in :func:`lagrangian_advantages` up and down. Safe-RLHF steps ``log lambda``
    with Adam; a plain step keeps the controller's state to one float and was enough here.

    Runs on: controller (Python floats).

    Args:
        init: starting multiplier (> 0; the update is multiplicative, so 0 would stay 0).
        lr: step size on ``log lambda``.
        cost_limit: the constraint's threshold ``d`` on the mean cost per sample.
        max_value: upper bound on the multiplier (None: unbounded).
    """

    def __init__(self, *, init: float, lr: float, cost_limit: float, max_value: float | None = None) -> None:
        if init <= 0:
            raise ValueError(f"LagrangeMultiplier(init={init}) must be > 0 (it is updated in log space).")
        if lr < 0:
            raise ValueError(f"LagrangeMultiplier(lr={lr}) must be >= 0.")
        if max_value is not None and max_value < init:
            raise ValueError(f"LagrangeMultiplier(max_value={max_value}) must be >= init ({init}).")
        self._log = math.log(init)
        self.lr = lr
        self.cost_limit = cost_limit
        self.max_log = math.inf if max_value is None else math.log(max_value)

    @property
    def value(self) -> float:
        """The current multiplier ``lambda``."""
        return math.exp(self._log)

    def update(self, mean_cost: float) -> float:
        """One ascent step from this step's mean cost; returns the new multiplier.

        Example:
            >>> lag = LagrangeMultiplier(init=1.0, lr=0.5, cost_limit=0.0)
            >>> round(lag.update(0.2), 6)  # log lambda += 0.5 * 1.0 * (0.2 - 0.0)
            1.105171
        """
        self._log = min(self._log + self.lr * self.value * (mean_cost - self.cost_limit), self.max_log)
        return self.value

    def state_dict(self) -> dict[str, float]:
        """``{"log_value": log lambda}`` for checkpoints."""
        return {"log_value": self._log}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._log = float(state["log_value"])
