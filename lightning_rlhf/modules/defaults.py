"""A ready module's own ``AlgorithmConfig``, and how one that a user passes is merged over it.

A passed ``algorithm`` does not replace a module's default whole (``DrGRPOModule(algorithm=AlgorithmConfig(
batching=...))`` stays Dr.GRPO). A config cannot say which fields were set, and the command line passes every
field, so a field counts as set when it differs from ``AlgorithmConfig``'s own default; unset ones take the module's
value (but :data:`PASSED_AS_GIVEN`). A set field that contradicts the module's algorithm is refused, naming the fix.
Settings are named by their path in the nested config: ``"advantage"``, ``"kl.coef"``, ``"loss.loss_agg"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from lightning_rlhf.algorithms import estimator_inputs
from lightning_rlhf.config import AlgorithmConfig, RolloutConfig

__all__ = ["PASSED_AS_GIVEN", "AlgorithmDefaults", "Rule", "set_fields"]

PASSED_AS_GIVEN = frozenset({"kl.coef", "filtering.overlong_buffer"})
"""Fields a passed config always decides: their default 0 is a choice (no KL term and no reference model; no
overlong punishment), so a module's own nonzero value applies only when no ``algorithm`` is passed."""


def _settings(config: AlgorithmConfig) -> dict[str, Any]:
    """Every setting of ``config`` by its path (``"advantage"``, ``"kl.coef"``, ...)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            out |= {f"{field.name}.{f.name}": getattr(value, f.name) for f in dataclasses.fields(value)}
        else:
            out[field.name] = value
    return out


def _config(settings: Mapping[str, Any]) -> AlgorithmConfig:
    """The config with these settings (paths as :func:`_settings` names them; the rest at their defaults)."""
    groups: dict[str, dict[str, Any]] = {}
    for path, value in settings.items():
        group, _, name = path.rpartition(".")
        groups.setdefault(group, {})[name] = value
    top = groups.pop("", {})
    return AlgorithmConfig(**top, **groups)


_BASE = _settings(AlgorithmConfig())


def set_fields(config: AlgorithmConfig) -> dict[str, Any]:
    """The settings of ``config`` (by path, ``"kl.coef"``) that differ from ``AlgorithmConfig``'s defaults: the
    ones a user set, as far as a config can tell (one set to its default value reads as unset). Runs on: any
    process."""
    return {name: value for name, value in _settings(config).items() if value != _BASE[name]}


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a module's algorithm needs of one ``field`` (by path) of the merged config: ``accepts(value, config)``
    is True when it fits; ``needs`` says what in words, ``fix`` what to do instead (the error's HINT)."""

    field: str
    accepts: Callable[[Any, AlgorithmConfig], bool]
    needs: str
    fix: str = "use GRPOModule (critic-free) or RLHFModule with an AlgorithmConfig of your own for another mix"


def equals(field: str, value: Any, fix: str | None = None) -> Rule:
    """A rule that ``field`` is exactly ``value`` (the module's defining choice). Runs on: any process."""
    rule = Rule(field, lambda v, _: v == value, repr(value))
    return rule if fix is None else dataclasses.replace(rule, fix=fix)


def critic_free(module: str) -> Rule:
    """A rule that the advantage estimator needs neither a critic's values nor ReMax's baselines: GRPO's dataflow
    computes neither. Runs on: any process."""
    return Rule(
        "advantage",
        lambda v, _: not estimator_inputs(v),
        "a critic-free estimator ('grpo', 'rloo', 'reinforce_plus_plus', ...): its dataflow computes no critic "
        "values and no baselines",
        fix=f"use PPOModule(critic=...) for 'gae', ReMaxModule for 'remax', or a critic-free estimator in {module}",
    )


@dataclasses.dataclass(frozen=True)
class AlgorithmDefaults:
    """A ready module's default ``AlgorithmConfig`` fields (``values``; one may be a function of the
    ``RolloutConfig``, as DAPO's overlong buffer) and the ``rules`` its algorithm imposes on the merged config."""

    module: str
    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rules: tuple[Rule, ...] = ()

    def resolve(self, passed: AlgorithmConfig | None, rollout: RolloutConfig | None = None) -> AlgorithmConfig:
        """The algorithm the module runs: its default when ``passed`` is None, else ``passed`` merged over it
        (see the module docstring). Runs on: every process, in the module's ``__init__``, before any model loads.

        Raises:
            ValueError: a field of ``passed`` contradicts the module's algorithm; names the field, its value, what
                the module needs and the fix.
        """
        if passed is not None and not isinstance(passed, AlgorithmConfig):
            raise ValueError(
                f"{self.module}(algorithm={passed!r}) is invalid: expected an AlgorithmConfig or None. "
                "HINT: algorithm=AlgorithmConfig(batching=BatchingConfig(micro_batch_size=8), ...); settings you "
                f"leave out keep {self.module}'s defaults."
            )
        rollout = rollout or RolloutConfig()
        values = {k: v(rollout) if callable(v) else v for k, v in self.values.items()}
        if passed is None:
            merged = _config(values)
        else:
            given = _settings(passed)
            keep = {k: v for k, v in values.items() if k not in PASSED_AS_GIVEN and given[k] == _BASE[k]}
            merged = _config(given | keep) if keep else passed
        settings = _settings(merged)
        for rule in self.rules:
            value = settings[rule.field]
            if not rule.accepts(value, merged):
                unset = f"; left unset it is {values[rule.field]!r}" if rule.field in values else ""
                raise ValueError(
                    f"{self.module}: AlgorithmConfig.{rule.field}={value!r} contradicts the module's algorithm, "
                    f"which needs {rule.field}: {rule.needs}{unset}. HINT: {rule.fix}."
                )
        return merged
