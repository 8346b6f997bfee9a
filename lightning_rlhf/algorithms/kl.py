"""Per-token KL estimators between the policy and a reference policy.

Following Schulman's "Approximating KL divergence" note, with ``logr = logprobs - ref_logprobs`` on tokens
sampled from the policy: ``k1 = logr`` (unbiased, high variance), ``k2 = logr**2 / 2`` (biased, low
variance), ``k3 = exp(-logr) + logr - 1`` (unbiased, low variance, always >= 0).

Also the KL coefficient controllers (fixed, and adaptive as in Ziegler et al., 2019), small stateful host
objects holding a Python float.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torch import Tensor

from lightning_rlhf.algorithms.registry import Registry

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "KLEstimator",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
]

KLEstimator = Callable[[Tensor, Tensor], Tensor]
"""A registered KL estimator: ``(logprobs [B, T], ref_logprobs [B, T]) -> [B, T]`` per-token estimate (not masked),
from the policy's and the reference's log-probabilities of the tokens sampled from the policy."""

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 estimator ``logprobs - ref_logprobs`` (a :data:`KLEstimator`). Runs on: controller or worker."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 estimator ``0.5 * (logprobs - ref_logprobs) ** 2`` (a :data:`KLEstimator`; non-negative). Runs on:
    controller or worker."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator ``exp(r) - r - 1`` with ``r = ref_logprobs - logprobs``.

    A :data:`KLEstimator` (non-negative, at most 10): ``r`` is clamped to ``[-20, 20]`` before ``exp`` and the
    result to ``[-10, 10]`` for stability. Runs on: controller or worker.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, *, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate with the :data:`KLEstimator` registered as ``estimator``.

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If ``estimator`` is unknown.
    """
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)


class KLController(Protocol):
    """Interface shared by the KL coefficient controllers."""

    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> float: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: Mapping[str, float]) -> None: ...


class _Coefficient:
    """The coefficient, as a property and in checkpoints (``{"value": coefficient}``; the rest is configuration)."""

    _value: float

    @property
    def value(self) -> float:
        """The current KL coefficient."""
        return self._value

    def state_dict(self) -> dict[str, float]:
        """Returns ``{"value": coefficient}`` for checkpointing."""
        return {"value": self._value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restores the coefficient saved by ``state_dict``."""
        self._value = float(state["value"])


class FixedKLController(_Coefficient):
    """A KL coefficient ``kl_coef`` (>= 0) that never changes; a :class:`KLController`.

    Runs on: controller (a Python float, no tensors).

    Raises:
        ValueError: If ``kl_coef < 0``.
    """

    def __init__(self, *, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"`kl_coef` must be >= 0, got {kl_coef}.")
        self._value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Returns the coefficient, unchanged."""
        del current_kl, n_steps
        return self._value

    def __repr__(self) -> str:
        return f"FixedKLController(value={self._value})"


class AdaptiveKLController(_Coefficient):
    """Adaptive KL coefficient (Ziegler et al., 2019, "Fine-Tuning Language Models from Human
    Preferences"), a proportional controller steering the observed KL towards ``target_kl`` (> 0), from
    ``init_kl_coef`` (>= 0); ``horizon`` (> 0, in samples): larger adapts slower.

    Runs on: controller (a Python float, no tensors; pass the KL already reduced to a float).

    Raises:
        ValueError: If an argument is out of range.

    Example:
        >>> ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
        >>> round(ctl.update(12.0, 1000), 6)  # error clipped to 0.2 -> 0.1 * (1 + 0.2 * 0.1)
        0.102
    """

    def __init__(self, *, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"`init_kl_coef` must be >= 0, got {init_kl_coef}.")
        if target_kl <= 0:
            raise ValueError(f"`target_kl` must be > 0, got {target_kl}.")
        if horizon <= 0:
            raise ValueError(f"`horizon` must be > 0, got {horizon}.")
        self._value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon`` after a step of
        ``n_steps`` samples whose KL (the quantity ``target_kl`` refers to) was ``current_kl``; returns it."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self._value *= 1.0 + error * n_steps / self.horizon
        return self._value

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self._value}, target_kl={self.target_kl}, horizon={self.horizon})"
