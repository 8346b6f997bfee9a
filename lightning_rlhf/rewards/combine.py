"""Several rewards, each named, combined with weights into one score per sample.

``reward`` may be one function, one model path, or a mapping ``name -> function or model path``; the score is
``sum(weight[name] * component[name])`` (weights default to 1.0, as in TRL's ``reward_weights``). Each
component is logged on its own, so a format bonus cannot hide a falling correctness reward.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping

import torch

from lightning_rlhf.rewards.runner import RewardFn, reward_fn_name

__all__ = ["RewardComponent", "RewardSpec", "reward_components", "weighted_sum"]

RewardSpec = RewardFn | str | Mapping[str, RewardFn | str]
"""What ``RLHFModule(reward=...)`` accepts: a function, a model path, or ``{name: function or model path}``."""


@dataclasses.dataclass(frozen=True)
class RewardComponent:
    """One named reward: a function, or the path of a sequence-classification model, and its weight."""

    name: str
    source: RewardFn | str
    weight: float = 1.0

    @property
    def is_model(self) -> bool:
        """Whether the component is a reward model (a path) rather than a function."""
        return isinstance(self.source, str)


def reward_components(
    reward: RewardSpec, *, weights: Mapping[str, float] | None = None, setting: str = "reward"
) -> list[RewardComponent]:
    """The named components of ``reward``, in the mapping's order, with their ``weights`` (the others weigh 1.0);
    ``setting``: how the argument is named in error messages (e.g. ``RLHFModule(reward=...)``).

    Runs on: every process, when the module is built. A single function is named by its ``__name__``, a
    single model ``model``. At most one component may be a model (a role holds one model to shard); any
    number may be functions.

    Raises:
        ValueError: an empty mapping, a bad name, two models, or a weight for an unknown name.
        TypeError: a component that is neither callable nor a path.
    """
    if isinstance(reward, str):
        named: dict[str, RewardFn | str] = {"model": reward}
    elif callable(reward):
        named = {_metric_safe(reward_fn_name(reward)): reward}
    elif isinstance(reward, Mapping):
        named = dict(reward)
        if not named:
            raise ValueError(f"{setting}={{}} names no reward. HINT: pass {{'name': fn_or_model_path, ...}}.")
    else:
        raise TypeError(
            f"{setting} must be a function or a model path (or a dict of them by name), got {type(reward).__name__}."
        )
    for name, source in named.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"{setting}: reward name {name!r} is invalid: expected a non-empty string without '/'.")
        if not isinstance(source, str) and not callable(source):
            raise TypeError(f"{setting}[{name!r}] must be a function or a model path, got {type(source).__name__}.")
    models = [name for name, source in named.items() if isinstance(source, str)]
    if len(models) > 1:
        raise ValueError(
            f"{setting} has {len(models)} reward models ({models}); a reward role holds at most one model beside "
            "any number of functions. HINT: keep one model here and score the other with a second RewardRole "
            "(as SafeRLHFModule does for its cost), or wrap it in a function."
        )
    weights = dict(weights or {})
    for key, value in weights.items():
        if key not in named:
            close = difflib.get_close_matches(key, list(named), n=1)
            hint = f"Did you mean '{close[0]}'?" if close else f"The rewards are {list(named)}."
            raise ValueError(f"RewardConfig.weights names `{key}`, which is not a reward. HINT: {hint}")
        if not math.isfinite(value):
            raise ValueError(f"RewardConfig.weights[{key!r}]={value!r} is invalid: expected a finite number.")
    return [RewardComponent(name, source, float(weights.get(name, 1.0))) for name, source in named.items()]


def weighted_sum(scores: Mapping[str, torch.Tensor], weights: Mapping[str, float]) -> torch.Tensor:
    """``sum(weights[name] * scores[name])`` ``[B]`` float32 over the components (``weights`` names every one).

    Runs on: the reward worker (pure tensor math).
    """
    return torch.stack([weights[name] * s.float() for name, s in scores.items()]).sum(0)


def _metric_safe(name: str) -> str:
    """A function's name as a metric key part: ``<lambda>`` -> ``lambda``; no ``/``."""
    return name.strip("<>").replace("/", "_") or "reward"
