"""Policy losses (PPO clip, dual clip, GSPO, CISPO, SAPO, GPG, DPPO), the clipped value loss, and loss aggregation
modes.

Policy losses share one signature so a trainer can switch by name::

    loss, metrics = compute_policy_loss("gspo", logprobs, old_logprobs, advantages, mask, clip_low=3e-4)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_rlhf.algorithms.functional import masked_mean, masked_sum
from lightning_rlhf.algorithms.registry import Registry

__all__ = [
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "LossAggregation",
    "MicroBatchAggregation",
    "PolicyLoss",
    "PolicySettings",
    "aggregate_loss",
    "compute_policy_loss",
    "policy_loss_cispo",
    "policy_loss_clipped",
    "policy_loss_dppo_kl",
    "policy_loss_dppo_tv",
    "policy_loss_dual_clip",
    "policy_loss_gpg",
    "policy_loss_gspo",
    "policy_loss_sapo",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
    "uses_global_token_count",
    "value_loss_clipped",
]


class LossAggregation(Protocol):
    """Signature shared by all registered loss aggregations: ``[B, T]`` per-token ``loss`` and binary ``mask`` in, a
    scalar out. ``num_tokens`` serves ``"token-mean"``, ``max_len`` ``"seq-mean-token-sum-norm"`` (the others ignore
    them). Each runs on the controller or a worker (pure functions)."""

    def __call__(
        self, loss: Tensor, mask: Tensor, *, num_tokens: Tensor | float | None = None, max_len: int | None = None
    ) -> Tensor: ...


LOSS_AGGREGATIONS: Registry[LossAggregation] = Registry("loss aggregation")


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(
    loss: Tensor, mask: Tensor, *, num_tokens: Tensor | float | None = None, max_len: int | None = None
) -> Tensor:
    """Sum of valid-token losses over ``num_tokens`` (default ``mask.sum()``; at least 1). With the global token
    count of the (mini-)batch as ``num_tokens``, the losses of micro-batches and ranks sum to the exact global mean.

    Runs on: controller or worker (pure function).
    """
    del max_len
    total = masked_sum(loss, mask)
    denom = mask.bool().sum() if num_tokens is None else num_tokens
    denom_t = torch.as_tensor(denom, device=total.device).to(total.dtype).clamp_min(1.0)
    return total / denom_t


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss: Tensor, mask: Tensor, *, num_tokens: Tensor | float | None = None, max_len: int | None = None
) -> Tensor:
    """Per-sequence sum over valid tokens, then mean over all ``B`` sequences (``0`` if ``B == 0``).
    Runs on: controller or worker (pure function)."""
    del num_tokens, max_len
    seq_losses = masked_sum(loss, mask, dim=-1)  # [B]
    return seq_losses.sum() / max(seq_losses.shape[0], 1)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss: Tensor, mask: Tensor, *, num_tokens: Tensor | float | None = None, max_len: int | None = None
) -> Tensor:
    """Per-sequence mean over valid tokens, then mean over sequences with a non-empty mask (``0`` if none).
    Runs on: controller or worker (pure function)."""
    del num_tokens, max_len
    seq_means = masked_mean(loss, mask, dim=-1)  # [B]
    non_empty = mask.bool().any(dim=-1)  # [B]
    return masked_mean(seq_means, non_empty)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, *, num_tokens: Tensor | float | None = None, max_len: int | None = None
) -> Tensor:
    """Dr.GRPO's length-unbiased aggregation (Liu et al., 2025, "Understanding R1-Zero-Like Training"):
    ``1/B * sum_i 1/max_len * sum_t loss_{i,t}``, no sequence divided by its own length. Pass the same ``max_len``
    (e.g. the rollout's maximum response length) to every micro-batch; default ``T`` (at least 1). ``0`` if ``B == 0``.

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If ``max_len`` is given and not positive.
    """
    del num_tokens
    if max_len is not None and max_len <= 0:
        raise ValueError(f"`max_len` must be > 0 for 'seq-mean-token-sum-norm', got {max_len}.")
    divisor = max(mask.shape[-1], 1) if max_len is None else max_len
    seq_losses = masked_sum(loss, mask, dim=-1)  # [B]
    return seq_losses.sum() / (divisor * max(seq_losses.shape[0], 1))


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    *,
    mode: str = "token-mean",
    num_tokens: Tensor | float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduces a ``[B, T]`` per-token loss to a scalar with the :class:`LossAggregation` registered as ``mode``.

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If ``mode`` is unknown.
    """
    return LOSS_AGGREGATIONS.get(mode)(loss, mask, num_tokens=num_tokens, max_len=max_len)


def uses_global_token_count(mode: str) -> bool:
    """Whether aggregation ``mode`` divides by the mini-batch's token count over all ranks (``"token-mean"``: a
    collective per mini-batch); the others average per-sequence values, each micro-batch weighted by its rows.

    Runs on: any process. Raises the registry's error for an unknown mode.
    """
    LOSS_AGGREGATIONS.get(mode)
    return mode == "token-mean"


@dataclass(frozen=True)
class MicroBatchAggregation:
    """How one micro-batch's loss joins its mini-batch's loss under aggregation ``mode``, so that the gradients
    summed over micro-batches and averaged over ranks (FSDP) equal those of the whole mini-batch at once.

    - ``"token-mean"``: each micro-batch divides its token sum by ``num_tokens``, the per-rank share of the
      mini-batch's global token count (FSDP averages over ranks); the losses are then summed unscaled.
    - per-sequence modes: each micro-batch's loss is a mean over its rows, scaled by ``share`` (its rows over
      the mini-batch's rows on this rank, as many on every rank; for ``"seq-mean-token-mean"``, which averages over
      the rows with a loss token, its rows with one over the per-rank share of the mini-batch's rows with one on all
      ranks, which the ranks need not hold as many of).

    Runs on: every worker rank (the training engine makes one per micro-batch; the role's loss uses it).
    """

    mode: str
    num_tokens: Tensor | None
    """Per-rank share of the mini-batch's global token count (``"token-mean"``), else None."""
    share: float
    """Rows of this micro-batch over rows of its mini-batch on this rank (for ``"seq-mean-token-mean"``: its rows
    with a loss token over the per-rank share of the mini-batch's on all ranks)."""
    max_len: int | None = None
    """The constant length of ``"seq-mean-token-sum-norm"`` (e.g. the rollout's ``max_new_tokens``)."""
    counts: bool = True
    """False for a stand-in micro-batch that only keeps a rank's FSDP collectives in step with the others (its loss
    is multiplied by 0): the loss should not report metrics from it."""
    parts: int | None = 1
    """The micro-batches of this rank's mini-batch that count: the mean of their :meth:`report` values is the
    mini-batch's value on this rank. None where rows were left out (``trainable``): each reports its own mean."""

    def aggregate(self, loss: Tensor, mask: Tensor) -> Tensor:
        """``loss`` ``[B, T]`` reduced to this micro-batch's part of the mini-batch loss (before ``scale``)."""
        return aggregate_loss(loss, mask, mode=self.mode, num_tokens=self.num_tokens, max_len=self.max_len)

    @property
    def loss_kwargs(self) -> dict[str, Any]:
        """``agg``, ``num_tokens`` and ``max_len`` for the registered policy and value losses."""
        return {"agg": self.mode, "num_tokens": self.num_tokens, "max_len": self.max_len}

    @property
    def scale(self) -> float:
        """Factor on the aggregated loss before ``backward``."""
        return 1.0 if self.num_tokens is not None else self.share

    def report(self, value: Tensor, mask: Tensor) -> Tensor:
        """A detached aggregated value as a metric: this micro-batch's part of the mini-batch's value times ``parts``,
        so that the mean over the micro-batches, and then over the ranks, is the whole mini-batch's value however it
        is cut; with ``parts`` None, this micro-batch's own value."""
        if self.parts is not None:
            return value.detach() * (self.scale * self.parts)
        if self.num_tokens is None:
            return value.detach()
        return value.detach() / (mask.sum().clamp(min=1) / self.num_tokens)


@dataclass(frozen=True)
class PolicySettings:
    """The keyword settings every registered policy loss accepts (each loss reads those it uses); an unknown one
    is a ``TypeError`` naming it. Runs on: any process."""

    clip_low: float = 0.2
    """Lower clip ``epsilon`` (ratio >= ``1 - clip_low``)."""
    clip_high: float = 0.2
    """Upper clip ``epsilon`` (ratio <= ``1 + clip_high``); ``> clip_low`` is DAPO's clip-higher."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant ``c`` (``"dual_clip"`` only; > 1, the paper uses 3)."""
    tau_pos: float = 1.0
    """SAPO's gate temperature on tokens with a positive advantage (``"sapo"`` only; > 0)."""
    tau_neg: float = 1.05
    """SAPO's gate temperature on tokens with a negative advantage (``"sapo"`` only; > 0)."""
    dppo_kl_threshold: float = 0.05
    """DPPO's bound on the binary KL of a token's probability (``"dppo_kl"`` only; > 0)."""
    dppo_tv_threshold: float = 0.2
    """DPPO's bound on the change of a token's probability (``"dppo_tv"`` only; in (0, 1))."""
    agg: str = "token-mean"
    """Loss aggregation mode (see ``LOSS_AGGREGATIONS``)."""
    num_tokens: Tensor | float | None = None
    """Optional global token count for ``"token-mean"``."""
    max_len: int | None = None
    """Optional constant length divisor for ``"seq-mean-token-sum-norm"``."""


class PolicyLoss(Protocol):
    """Signature shared by all registered policy losses: ``logprobs`` ``[B, T]`` (the current policy's, requiring
    grad), ``old_logprobs`` ``[B, T]`` (the behaviour policy's), ``advantages`` ``[B, T]``, ``response_mask``
    ``[B, T]`` (binary, valid response tokens), and :class:`PolicySettings` as keywords. Returns ``(loss,
    metrics)``: a differentiable scalar loss and detached scalar metrics, at least ``"pg_clipfrac"`` (the fraction of
    valid tokens where the clipped branch is strictly larger) and ``"ppo_kl"`` (masked mean of ``old_logprobs -
    logprobs``)."""

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, **settings: Any
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _clipped_loss(
    ratio: Tensor, log_ratio: Tensor, advantages: Tensor, mask: Tensor, settings: PolicySettings, *, dual: bool = False
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's pessimistic per-token loss ``max(-A * r, -A * clamp(r, 1 - clip_low, 1 + clip_high))`` (with ``dual``:
    ``min(that, -A * clip_ratio_c)`` where ``A < 0``), aggregated, with the metrics of :class:`PolicyLoss`."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
    per_token = ppo = torch.maximum(unclipped, clipped)
    if dual:
        bound = -advantages * settings.clip_ratio_c
        negative = advantages < 0
        per_token = torch.where(negative, torch.minimum(ppo, bound), ppo)
    loss = aggregate_loss(per_token, mask, mode=settings.agg, num_tokens=settings.num_tokens, max_len=settings.max_len)
    with torch.no_grad():
        metrics = {"pg_clipfrac": masked_mean((clipped > unclipped).to(per_token.dtype), mask)}
        if dual:
            metrics["pg_clipfrac_lower"] = masked_mean((negative & (ppo > bound)).to(per_token.dtype), mask)
        metrics["ppo_kl"] = masked_mean(-log_ratio, mask)
    return loss, metrics


@POLICY_LOSSES.register("vanilla")
def policy_loss_clipped(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, **settings: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate objective (Schulman et al., 2017) with ``ratio = exp(clamp(logprobs - old_logprobs,
    -20, 20))`` and an asymmetric clip range: a :class:`PolicyLoss`. DAPO's "clip-higher" (Yu et al., 2025) is this
    loss with ``clip_high > clip_low``.

    Runs on: controller or worker (pure function).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    return _clipped_loss(ratio, log_ratio, advantages, response_mask, PolicySettings(**settings))


@POLICY_LOSSES.register("dual_clip")
def policy_loss_dual_clip(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, **settings: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO (Ye et al., 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning"): ``"vanilla"``'s loss bounded by ``-A * clip_ratio_c`` where ``A < 0``, so a ratio grown far beyond
    ``clip_ratio_c`` under a negative advantage gives a bounded loss (zero gradient); a :class:`PolicyLoss`. One
    more metric, ``"pg_clipfrac_lower"``: the fraction of valid tokens where ``A < 0`` and the bound is active.

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If ``clip_ratio_c <= 1``.
    """
    config = PolicySettings(**settings)
    if not config.clip_ratio_c > 1.0:
        raise ValueError(f"Policy loss 'dual_clip' requires `clip_ratio_c` > 1, got {config.clip_ratio_c}.")
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    return _clipped_loss(ratio, log_ratio, advantages, response_mask, config, dual=True)


@POLICY_LOSSES.register("gspo")
def policy_loss_gspo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, **settings: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """Group Sequence Policy Optimization (GSPO; Zheng et al., 2025): PPO clipping on the sequence ratio
    ``s_i = exp(mean_t (logprobs - old_logprobs))`` (geometric mean over valid tokens); a :class:`PolicyLoss`.

    The token form ``s_{i,t} = sg[s_i] * exp(logprobs_t - sg[logprobs_t])`` (``sg``: stop-gradient; ``log sg[s_i]``
    clamped to ``[-20, 20]``) has value ``s_i`` and each token's own gradient: with ``agg="seq-mean-token-mean"``
    it is the paper's objective and gradient ``s_i * A_i * mean_t grad(logprobs_t)`` exactly (GSPO-token: the same
    with token-level advantages). GSPO's clip ranges are much smaller (the paper: ``clip_low=3e-4``,
    ``clip_high=4e-4``), not set here. ``"pg_clipfrac"`` counts clipped sequences by their tokens.

    Runs on: controller or worker (pure function).
    """
    log_ratio = logprobs - old_logprobs
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1).detach().clamp(-20.0, 20.0)  # [B]
    ratio = torch.exp(seq_log_ratio.unsqueeze(-1) + (logprobs - logprobs.detach()))  # value s_i, grad per token
    return _clipped_loss(ratio, log_ratio, advantages, response_mask, PolicySettings(**settings))


def _aggregate(per_token: Tensor, mask: Tensor, settings: PolicySettings) -> Tensor:
    return aggregate_loss(per_token, mask, mode=settings.agg, num_tokens=settings.num_tokens, max_len=settings.max_len)


def _metrics(flagged: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """:class:`PolicyLoss`'s metrics: ``"pg_clipfrac"``, the share of valid tokens ``flagged`` (clipped, gated or
    masked), and ``"ppo_kl"``."""
    with torch.no_grad():
        return {"pg_clipfrac": masked_mean(flagged.to(log_ratio.dtype), mask), "ppo_kl": masked_mean(-log_ratio, mask)}


def _ratio(logprobs: Tensor, old_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """``(ratio, log_ratio)``: ``exp(clamp(logprobs - old_logprobs, -20, 20))`` and the log-ratio itself."""
    log_ratio = logprobs - old_logprobs
    return torch.exp(log_ratio.clamp(-20.0, 20.0)), log_ratio


@POLICY_LOSSES.register("cispo")
def policy_loss_cispo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, **settings: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025, arXiv:2506.13585): the importance weight is clipped and detached, never the token's
    gradient: ``loss_t = -sg(clamp(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logprobs_t``, so every token keeps the
    gradient ``-clip(r_t) * A_t * grad(logprobs_t)``, where PPO's clip would zero it; a :class:`PolicyLoss`. The paper
    bounds the weight above only: ``clip_low=1`` removes the lower bound (with ``clip_low < 1``, as verl's, both).
    ``"pg_clipfrac"``: the fraction of tokens whose weight was clipped.

    Runs on: controller or worker (pure function).
    """
    config = PolicySettings(**settings)
    ratio, log_ratio = _ratio(logprobs, old_logprobs)
    weight = ratio.detach().clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    loss = _aggregate(-advantages * weight * logprobs, response_mask, config)
    return loss, _metrics(weight != ratio.detach(), log_ratio, response_mask)


@POLICY_LOSSES.register("sapo")
def policy_loss_sapo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, **settings: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Soft Adaptive Policy Optimization; Gao et al., 2025, arXiv:2511.20347): a smooth gate in place of the
    hard clip, ``loss_t = -f(r_t) * A_t`` with ``f(r) = (4 / tau) * sigmoid(tau * (r - 1))`` and ``tau = tau_pos``
    where ``A_t > 0``, else ``tau_neg``; a :class:`PolicyLoss`. On-policy (``r = 1``) its gradient is the policy
    gradient (``f'(1) = 1``); off-policy it decays as ``4 s (1 - s)`` with ``s = sigmoid(tau (r - 1))``, faster for
    negative advantages (``tau_neg > tau_pos``). The paper aggregates ``"seq-mean-token-mean"``. ``"pg_clipfrac"``: the
    fraction of tokens whose gate weight fell below one half.

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If ``tau_pos`` or ``tau_neg`` is not positive.
    """
    config = PolicySettings(**settings)
    if not (config.tau_pos > 0 and config.tau_neg > 0):
        raise ValueError(
            f"Policy loss 'sapo' requires tau_pos > 0 and tau_neg > 0, got {config.tau_pos}, {config.tau_neg}."
        )
    ratio, log_ratio = _ratio(logprobs, old_logprobs)
    tau = torch.where(advantages > 0, config.tau_pos, config.tau_neg).to(logprobs.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = _aggregate(-advantages * gate * (4.0 / tau), response_mask, config)
    weak = 4.0 * gate.detach() * (1.0 - gate.detach()) < 0.5  # the gradient's weight, d f / d r = 4 s (1 - s)
    return loss, _metrics(weak, log_ratio, response_mask)


@POLICY_LOSSES.register("gpg")
def policy_loss_gpg(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, **settings: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Group Policy Gradient; Chu et al., 2025, arXiv:2504.02546): the plain policy gradient, no ratio and no
    clip, ``loss_t = -A_t * logprobs_t``; a :class:`PolicyLoss` (pair it with the ``"gpg"`` advantage estimator). It
    is on-policy: with stale samples (``ppo_epochs > 1``, asynchronous rollouts) nothing corrects for their age.
    ``"pg_clipfrac"`` is 0.

    Runs on: controller or worker (pure function).
    """
    config = PolicySettings(**settings)
    loss = _aggregate(-advantages * logprobs, response_mask, config)
    return loss, _metrics(torch.zeros_like(response_mask, dtype=torch.bool), logprobs - old_logprobs, response_mask)


def _dppo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: PolicySettings,
    divergence: Tensor,
    threshold: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO's masked objective: ``-r_t * A_t`` except on tokens whose ``divergence`` passed ``threshold`` in the
    direction the advantage pushes (``A > 0`` and ``r > 1``, or ``A < 0`` and ``r < 1``): those give no gradient and
    still count in the aggregation."""
    ratio, log_ratio = _ratio(logprobs, old_logprobs)
    with torch.no_grad():
        pushed = ((advantages > 0) & (ratio > 1.0)) | ((advantages < 0) & (ratio < 1.0))
        blocked = (divergence > threshold) & pushed
    loss = _aggregate(torch.where(blocked, torch.zeros_like(ratio), -advantages * ratio), mask, config)
    return loss, _metrics(blocked, log_ratio, mask)


@POLICY_LOSSES.register("dppo_kl")
def policy_loss_dppo_kl(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, **settings: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (Divergence PPO; "Rethinking the Trust Region in LLM Reinforcement Learning", 2026,
    arXiv:2602.04879): the trust region is a bound on how far the sampled token's probability moved, not on the
    ratio. With ``p = exp(old_logprobs)`` and ``q = exp(logprobs)``, the binary KL ``D = p log(p/q) + (1 - p)
    log((1 - p)/(1 - q))``; a token with ``D > dppo_kl_threshold`` moved in its advantage's direction gives no
    gradient, the others ``-r_t * A_t``; a :class:`PolicyLoss`. Unlike the ratio, ``D`` is small for a rare token whose
    probability doubles and large for a likely one that loses a little. ``"pg_clipfrac"``: the masked fraction.

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If ``dppo_kl_threshold`` is not positive.
    """
    config = PolicySettings(**settings)
    if not config.dppo_kl_threshold > 0:
        raise ValueError(f"Policy loss 'dppo_kl' requires dppo_kl_threshold > 0, got {config.dppo_kl_threshold}.")
    with torch.no_grad():
        tiny = torch.finfo(torch.float32).tiny
        p = old_logprobs.float().exp().clamp(tiny, 1 - 1e-7)
        q = logprobs.detach().float().exp().clamp(tiny, 1 - 1e-7)
        divergence = p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))
    return _dppo(logprobs, old_logprobs, advantages, response_mask, config, divergence, config.dppo_kl_threshold)


@POLICY_LOSSES.register("dppo_tv")
def policy_loss_dppo_tv(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, **settings: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (see ``"dppo_kl"``): the divergence is the change of the sampled token's probability,
    ``|exp(logprobs) - exp(old_logprobs)|``, bounded by ``dppo_tv_threshold``; a :class:`PolicyLoss`.

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If ``dppo_tv_threshold`` is not in (0, 1).
    """
    config = PolicySettings(**settings)
    if not 0 < config.dppo_tv_threshold < 1:
        raise ValueError(f"Policy loss 'dppo_tv' requires 0 < dppo_tv_threshold < 1, got {config.dppo_tv_threshold}.")
    with torch.no_grad():
        divergence = (logprobs.detach().float().exp() - old_logprobs.float().exp()).abs()
    return _dppo(logprobs, old_logprobs, advantages, response_mask, config, divergence, config.dppo_tv_threshold)


def compute_policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Runs the :class:`PolicyLoss` registered as ``name`` (``kwargs``: :class:`PolicySettings`).

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If ``name`` is unknown or an argument is invalid.
    """
    return POLICY_LOSSES.get(name)(logprobs, old_logprobs, advantages, response_mask, **kwargs)


def value_loss_clipped(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip: float = 0.2,
    agg: str = "token-mean",
    num_tokens: Tensor | float | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss ``0.5 * max((values - returns) ** 2, (v_clipped - returns) ** 2)`` with ``v_clipped =
    old_values + clamp(values - old_values, -clip, clip)``, all ``[B, T]``; aggregated as :class:`PolicySettings`.
    Returns ``(loss, {"vf_clipfrac": share of valid tokens where the clipped term is strictly larger})``.

    Runs on: controller or worker (pure function).
    """
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped = (values - returns) ** 2
    clipped = (v_clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    loss = aggregate_loss(per_token, response_mask, mode=agg, num_tokens=num_tokens, max_len=max_len)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((clipped > unclipped).to(per_token.dtype), response_mask)}
    return loss, metrics
