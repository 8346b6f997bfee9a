"""Advantage estimators: GAE (PPO), group-relative (GRPO, GPG, RLOO, REINFORCE++-baseline), REINFORCE++, ReMax.

Every estimator takes one :class:`AdvantageInputs` so a trainer can switch by name::

    advantages, returns = compute_advantages("grpo", token_rewards=r, response_mask=m, group_ids=g)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_rlhf.algorithms.functional import masked_whiten
from lightning_rlhf.algorithms.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "compute_advantages",
    "estimator_inputs",
    "gae_advantages",
    "gpg_advantages",
    "grpo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
]

_NEEDS = {
    "values": "[B, T] critic values",
    "group_ids": "[B] integer group per sequence",
    "baselines": "[B] greedy-response score per prompt",
}


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator reads: the step's rewards and masks, the optional per-estimator inputs, and the
    settings (each estimator reads the ones it uses; its docstring says which). Runs on: any process."""

    token_rewards: Tensor
    """``[B, T]`` per-token rewards (usually the score on the last response token, minus any KL penalty)."""
    response_mask: Tensor
    """``[B, T]`` binary mask of the tokens the estimator runs over (padding and observations are 0)."""
    values: Tensor | None = None
    """``[B, T]`` critic values (GAE), or None."""
    group_ids: Tensor | None = None
    """``[B]`` integer group (prompt) of each sequence (group-relative estimators), or None."""
    baselines: Tensor | None = None
    """``[B]`` score of the greedy response to each sequence's prompt (ReMax), or None."""
    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_by_std: bool = True
    """Divide by the group std (GRPO; False with the seq-mean-token-sum-norm aggregation is Dr.GRPO)."""
    eps: float = 1e-6
    """Added to the group std (GRPO)."""

    def need(self, name: str, estimator: str) -> Tensor:
        """The optional input ``name``, which ``estimator`` requires.

        Raises:
            ValueError: it is None, naming the estimator, the input and its shape."""
        value: Tensor | None = getattr(self, name)
        if value is None:
            raise ValueError(f"Advantage estimator {estimator!r} requires `{name}` ({_NEEDS[name]}).")
        return value

    @property
    def mask(self) -> Tensor:
        """The response mask as booleans."""
        return self.response_mask.bool()

    @property
    def rewards(self) -> Tensor:
        """The token rewards as floating point."""
        rewards = self.token_rewards
        return rewards if rewards.is_floating_point() else rewards.float()

    @property
    def scores(self) -> Tensor:
        """``[B]`` each sequence's masked reward sum (padding ignored, even if ``nan``)."""
        rewards = self.rewards
        return torch.where(self.mask, rewards, torch.zeros_like(rewards)).sum(dim=-1)


class AdvantageEstimator(Protocol):
    """Signature shared by all registered advantage estimators: ``(advantages [B, T], returns [B, T])`` of the
    inputs, both zero where ``response_mask`` is 0, computed without gradient; a ``ValueError`` naming the
    estimator and the input when an input it requires is None (:meth:`AdvantageInputs.need`). Each runs on the
    controller or a worker (pure functions)."""

    def __call__(self, inputs: AdvantageInputs, /) -> tuple[Tensor, Tensor]: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _backward_scan(rewards: Tensor, mask: Tensor, *, gamma: float, lam: float, values: Tensor | None) -> Tensor:
    """``A_t = r_t + gamma * V_{t+1} - V_t + gamma * lam * A_{t+1}`` backwards over time (``V = 0`` without
    ``values``: the discounted return ``G_t = r_t + gamma * G_{t+1}``), where ``t + 1`` is the next *valid* token
    (padding is skipped); the last valid token has next value and advantage ``0``. Zero on padding."""
    zero_row = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    next_value, next_adv = zero_row, zero_row
    out = torch.zeros_like(rewards)
    for t in range(rewards.shape[-1] - 1, -1, -1):
        m_t = mask[:, t]
        delta = rewards[:, t] if values is None else rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        out[:, t] = torch.where(m_t, adv_t, zero_row)
        if values is not None:  # padding is transparent: carry the successor's value/advantage through it
            next_value = torch.where(m_t, values[:, t], next_value)
        next_adv = torch.where(m_t, adv_t, next_adv)
    return out


def _whitened(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` whitened over the batch's valid tokens (``masked_whiten``), zero on padding."""
    return torch.where(mask, masked_whiten(x, mask), torch.zeros_like(x))


def _groups(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(inverse [B], counts [G], sums [G])``: each sequence's group index, each group's size and score sum."""
    uniq, inverse = torch.unique(group_ids.reshape(-1), return_inverse=True)  # inverse: [B] in [0, G)
    counts = torch.zeros(uniq.numel(), dtype=scores.dtype, device=scores.device)
    counts.index_add_(0, inverse, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, inverse, scores)
    return inverse, counts, sums


def _broadcast(per_seq: Tensor, mask: Tensor) -> Tensor:
    """Spreads a ``[B]`` value over the valid tokens of a ``[B, T]`` mask (zeros on padding)."""
    expanded = per_seq.unsqueeze(-1).expand(mask.shape)
    return torch.where(mask, expanded, torch.zeros_like(expanded))


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_advantages(inputs: AdvantageInputs, /) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016; :func:`_backward_scan`). ``returns = A + V``
    before whitening; the advantages are then whitened over valid tokens (always: ``norm_by_std`` is not read).

    Runs on: controller or worker (pure function). Reads ``values`` (required), ``gamma``, ``lam``.
    """
    values = inputs.need("values", "gae")
    with torch.no_grad():
        mask, rewards = inputs.mask, inputs.rewards
        vals = values.to(rewards.dtype)
        advs = _backward_scan(rewards, mask, gamma=inputs.gamma, lam=inputs.lam, values=vals)
        returns = torch.where(mask, advs + vals, torch.zeros_like(advs))
        advantages = _whitened(advs, mask)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(inputs: AdvantageInputs, /) -> tuple[Tensor, Tensor]:
    """Group-relative advantages (GRPO, Shao et al., 2024), outcome supervision: ``(score - mean_g) / (std_g +
    eps)`` (``score - mean_g`` without ``norm_by_std``), with the mean and unbiased std of the sequence's group
    ``g`` (a group of size 1: mean 0, std 1), on every valid token. Dr.GRPO is this with ``norm_by_std=False`` and
    the ``"seq-mean-token-sum-norm"`` loss aggregation.

    Runs on: controller or worker (pure function). Reads ``group_ids`` (required), ``norm_by_std``, ``eps``;
    ``returns`` equals ``advantages``.
    """
    group_ids = inputs.need("group_ids", "grpo")
    with torch.no_grad():
        mask, scores = inputs.mask, inputs.scores
        inverse, counts, sums = _groups(scores, group_ids)
        group_mean = sums / counts.clamp_min(1)
        sq_dev = (scores - group_mean[inverse]) ** 2
        group_ss = torch.zeros_like(counts).index_add_(0, inverse, sq_dev)
        group_std = torch.sqrt(group_ss / (counts - 1).clamp_min(1))
        is_group = (counts > 1)[inverse]  # [B]
        centred = scores - torch.where(is_group, group_mean[inverse], torch.zeros_like(scores))
        if inputs.norm_by_std:
            centred = centred / torch.where(is_group, group_std[inverse] + inputs.eps, torch.ones_like(scores))
        advantages = _broadcast(centred, mask)
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("gpg")
def gpg_advantages(inputs: AdvantageInputs, /) -> tuple[Tensor, Tensor]:
    """GPG's advantages (Group Policy Gradient; Chu et al., 2025, arXiv:2504.02546): GRPO's group-relative
    advantages scaled by ``alpha = B / B_valid``, where ``B_valid`` counts the samples of groups whose scores differ
    (the others have advantage 0 and give no gradient but still count in the loss's normalisation, which ``alpha``
    undoes). ``norm_by_std`` divides by the group's std as GRPO does (GPG's ``F_norm``; False: 1). A step whose groups
    all agree has ``alpha = 1`` (and advantages 0).

    Runs on: controller or worker (pure function). Reads ``group_ids`` (required), ``norm_by_std``, ``eps``;
    ``returns`` equals ``advantages``.
    """
    group_ids = inputs.need("group_ids", "gpg")
    advantages, _ = grpo_advantages(inputs)
    with torch.no_grad():
        inverse, counts, sums = _groups(inputs.scores, group_ids)
        spread = torch.zeros_like(counts).index_add_(0, inverse, (inputs.scores - (sums / counts)[inverse]).abs())
        valid = (spread > 0)[inverse]  # [B]: the sample's group has scores that differ
        alpha = valid.numel() / max(int(valid.sum()), 1) if bool(valid.any()) else 1.0
        advantages = advantages * alpha
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(inputs: AdvantageInputs, /) -> tuple[Tensor, Tensor]:
    """REINFORCE Leave-One-Out advantages (RLOO; Ahmadian et al., 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs"): the baseline is the mean score of the
    group's *other* ``k - 1`` samples, ``A_i = s_i - (sum_g - s_i) / (k - 1)``, on every valid token; ``0`` for a
    group of size 1 (no baseline). No std normalisation.

    Runs on: controller or worker (pure function). Reads ``group_ids`` (required); ``returns`` equals
    ``advantages``.
    """
    group_ids = inputs.need("group_ids", "rloo")
    with torch.no_grad():
        scores = inputs.scores
        inverse, counts, sums = _groups(scores, group_ids)
        count = counts[inverse]
        loo_mean = (sums[inverse] - scores) / (count - 1).clamp_min(1)
        per_seq = torch.where(count > 1, scores - loo_mean, torch.zeros_like(scores))
        advantages = _broadcast(per_seq, inputs.mask)
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus_advantages(inputs: AdvantageInputs, /) -> tuple[Tensor, Tensor]:
    """REINFORCE++ advantages (Hu, 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models"): the discounted returns ``G`` (:func:`_backward_scan`; ``token_rewards`` should hold
    any per-token KL penalty), whitened over the batch's valid tokens; ``returns`` is ``G`` unwhitened.

    Runs on: controller or worker (pure function). Reads ``gamma``.
    """
    with torch.no_grad():
        mask = inputs.mask
        returns = _backward_scan(inputs.rewards, mask, gamma=inputs.gamma, lam=1.0, values=None)
        advantages = _whitened(returns, mask)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs, /) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline advantages (Hu, 2025): ``score - mean_g`` (a group of size 1: mean 0) on every valid
    token as ``returns``, whitened over the batch's valid tokens as the advantages.

    Runs on: controller or worker (pure function). Reads ``group_ids`` (required).
    """
    group_ids = inputs.need("group_ids", "reinforce_plus_plus_baseline")
    with torch.no_grad():
        mask, scores = inputs.mask, inputs.scores
        inverse, counts, sums = _groups(scores, group_ids)
        count = counts[inverse]
        mean = torch.where(count > 1, sums[inverse] / count, torch.zeros_like(scores))
        returns = _broadcast(scores - mean, mask)
        advantages = _whitened(returns, mask)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("remax")
def remax_advantages(inputs: AdvantageInputs, /) -> tuple[Tensor, Tensor]:
    """ReMax advantages (Li et al., 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement
    Learning Method for Aligning Large Language Models"): ``A_i = s_i - b_i`` on every valid token, ``b_i`` the
    score of the greedy response to the same prompt, subtracted as given (score it as the samples). No
    normalisation.

    Runs on: controller or worker (pure function). Reads ``baselines`` (required); ``returns`` equals
    ``advantages``.
    """
    baselines = inputs.need("baselines", "remax")
    with torch.no_grad():
        scores = inputs.scores
        advantages = _broadcast(scores - baselines.to(scores.dtype).reshape(-1), inputs.mask)
    return advantages, advantages.clone()


_EXTRA_INPUTS: dict[str, frozenset[str]] = {"gae": frozenset({"values"}), "remax": frozenset({"baselines"})}


def estimator_inputs(name: str) -> frozenset[str]:
    """What advantage estimator ``name`` needs beyond rewards and group ids: ``"values"`` (a critic) for GAE,
    ``"baselines"`` (a per-prompt reference score) for ReMax; empty for the group-relative estimators.

    Runs on: any process (modules check their roles against it before any model loads).
    """
    ADVANTAGE_ESTIMATORS.get(name)
    return _EXTRA_INPUTS.get(name, frozenset())


def compute_advantages(name: str, inputs: AdvantageInputs | None = None, /, **given: Any) -> tuple[Tensor, Tensor]:
    """Runs the :class:`AdvantageEstimator` registered as ``name`` on ``inputs``, or on their fields as keywords.

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If ``name`` is unknown or required inputs are missing.
    """
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    data = AdvantageInputs(**given) if inputs is None else inputs
    if "token_rewards" in inspect.signature(estimator).parameters:  # written for the keyword form: still served
        return estimator(**{f.name: getattr(data, f.name) for f in fields(data)})  # type: ignore[call-arg]
    return estimator(data)
