"""The standard metrics of a step's rollout (names as in verl), and the warning when the engine's sampling
distribution drifts from the trainer's; ``module`` is the :class:`~lightning_rlhf.RLHFModule` whose step it is."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

import lightning_rlhf.perf as perf
from lightning_rlhf.agents.rollout import episode_metrics
from lightning_rlhf.algorithms import masked_mean, rollout_probs_diff
from lightning_rlhf.batch import Batch, sampled_mask
from lightning_rlhf.compat.lightning import attached_trainer
from lightning_rlhf.roles import CriticRole, RewardRole

__all__ = [
    "REPLAYED_LOG_ARGS",
    "check_log_interval",
    "check_rollout_probs_diff",
    "rollout_metrics",
    "samples_of",
    "timer",
]

REPLAYED_LOG_ARGS = ("prog_bar", "logger", "on_step", "on_epoch", "batch_size", "reduce_fx")
"""The arguments of a controller's ``log`` call that the workers' replay of it keeps."""


def rollout_metrics(
    module: Any, rollout: Batch, step_seconds: float | None = None, *, timings: Mapping[str, float] | None = None
) -> dict[str, float]:
    """The standard per-step metrics of a scored rollout (names as in verl); with ``timings`` (the step's
    ``timing_s/*``) also :func:`lightning_rlhf.perf.step_perf_metrics`. Runs on: controller."""
    mask = rollout["response_mask"].float()
    lengths = mask.sum(-1)
    scores = rollout["scores"].float()
    out = {
        "critic/score/mean": float(scores.mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(rollout["response_truncated"].float().mean()),
    }
    for key in ("advantages", "returns", "values"):
        if key in rollout:
            out[f"critic/{key}/mean"] = float(masked_mean(rollout[key], rollout["response_mask"]))
    for role in module.roles().values():  # each reward's components: reward/<name>/mean, reward/<name>/failed
        if isinstance(role, RewardRole):
            out |= role.metrics(rollout)
    if step_seconds:
        tokens = float(rollout["prompt_mask"].sum() + mask.sum())
        out["perf/throughput"] = tokens / step_seconds / max(1, module.trainer.world_size)
    handoff = ("timing_s/update_weights", "timing_s/update_weights_wait", "perf/weight_sync_bytes")
    for key in (*handoff, "perf/weight_sync_gathered_bytes", "perf/weight_verify_s"):
        if key in rollout.meta:
            out[key] = float(rollout.meta[key])
    if "rollout_logprobs" in rollout and "old_logprobs" in rollout:  # the on-policy update reports its own
        diff = rollout_probs_diff(rollout["old_logprobs"], rollout["rollout_logprobs"], sampled_mask(rollout))
        out |= {f"training/{k}": float(v) for k, v in diff.items()}
    out |= episode_metrics(rollout)
    if timings is not None:  # parameter counts: DTensor numel is the full tensor's, so no collective
        trainer = attached_trainer(module)
        strategy = getattr(trainer, "strategy", None)
        take_memory = getattr(strategy, "take_memory", None)
        rank_peaks, call_memory = take_memory() if take_memory is not None else ({}, {})
        critics = [r.model for r in module.roles().values() if isinstance(r, CriticRole) and r.trainable]
        out |= perf.step_perf_metrics(
            prompt_tokens=float(rollout["prompt_mask"].sum()),
            response_tokens=float(mask.sum()),
            timings=timings,
            params={
                "actor": perf.trainable_parameters(module.actor.model) if "timing_s/update_actor" in timings else 0,
                "critic": sum(perf.trainable_parameters(m) for m in critics)
                if "timing_s/update_critic" in timings
                else 0,
            },
            epochs=module.algorithm.batching.ppo_epochs,
            device=getattr(strategy, "root_device", None) or torch.device("cpu"),
            dtype=getattr(strategy, "param_dtype", None) or torch.float32,
            world_size=trainer.world_size if trainer is not None else 1,
            rank_peaks=rank_peaks,
            call_memory=call_memory,
        )
    return out


def check_rollout_probs_diff(module: Any, metrics: dict[str, float], *, step: int) -> None:
    """Warn, once per run, the first time ``training/rollout_probs_diff_max`` exceeds
    ``RolloutConfig.max_probs_diff``, naming the likely causes, this run's own settings first.
    Runs on: controller (from :meth:`RLHFModule.log_step`)."""
    bound = module.rollout_config.max_probs_diff
    value = metrics.get("training/rollout_probs_diff_max")
    if bound is None or value is None or module._probs_diff_warned or not value > bound:
        return
    if metrics.get("training/staleness_max", 0.0) > 0:  # asynchronous: older weights sampled, by design
        return
    module._probs_diff_warned = True
    cfg = module.rollout_config
    causes = []
    if cfg.temperature > 0 and (cfg.top_p < 1 or cfg.top_k > 0):
        causes.append(
            f"top-k/top-p truncation: the engine samples from a truncated distribution (RolloutConfig.top_p="
            f"{cfg.top_p}, top_k={cfg.top_k}) while the loss scores the full one; set top_p=1.0, top_k=0"
        )
    dtype = getattr(getattr(attached_trainer(module), "strategy", None), "param_dtype", None)
    if dtype is not None and dtype != torch.float32:
        causes.append(
            f"low precision: the engine and the trainer compute in {dtype} with different kernels (in float32 "
            "the gap stays below 1e-5); raise RolloutConfig.max_probs_diff if this level is expected"
        )
    causes += [
        "stale engine weights: a weight hand-off that failed or was skipped, so the engine sampled with older "
        "weights than the trainer's (a custom role or engine that does not call actor.mark_weights_changed() "
        "after changing the weights)",
        "another temperature: the rollout was generated at a temperature other than RolloutConfig.temperature="
        f"{cfg.temperature} (actor.generate(temperature=...) in a custom dataflow)",
    ]
    listed = "; ".join(f"({i}) {c}" for i, c in enumerate(causes, 1))
    logs = [
        f", {k}={metrics[k]:.3g}" for k in ("training/rollout_logprob_diff_max", "rollout/mismatch_kl") if k in metrics
    ]
    rank_zero_warn(
        f"Step {step}: training/rollout_probs_diff_max={value:.3g}{''.join(logs)} exceeds "
        f"RolloutConfig.max_probs_diff={bound}: "
        "the rollout engine sampled from another distribution than the one the trainer scores, so the update "
        f"is off-policy by that much. Likely causes: {listed}. HINT: fix the cause, or raise max_probs_diff "
        "(None: no warning). This warning is shown once per run; the metric is logged every step.",
        category=UserWarning,
    )


def samples_of(rollout: Batch, *, step: int) -> Batch:
    """What a step keeps of its rollout for the callbacks (``RLHFModule.last_rollout``). Runs on: controller."""
    episodes = ("turns", "tool_calls") if "episode" in rollout else ()  # multi-turn: the whole conversations
    return Batch(
        {"scores": rollout["scores"].detach().float().cpu()} | {k: rollout[k].cpu() for k in episodes},
        {k: rollout[k] for k in ("prompt", "completion", "episode") if k in rollout},
        {"step": step},
    )


def check_log_interval(trainer: Any) -> None:
    """Warn when the run is shorter than the loggers' interval (``Trainer(log_every_n_steps=...)``), so that no
    step of it would be logged. Runs on: every process (the module's set-up for a fit)."""
    every, steps = getattr(trainer, "log_every_n_steps", 1), trainer.max_steps  # set by Lightning
    if 0 < steps < every:
        rank_zero_warn(
            f"Trainer(max_steps={steps}, log_every_n_steps={every}): the loggers record every {every}th step, "
            "so no step of this run reaches them (an RL step takes seconds to minutes; Lightning's default "
            "suits steps of milliseconds). HINT: Trainer(log_every_n_steps=1), as the CLI and recipes set it.",
            category=UserWarning,
        )


@contextlib.contextmanager
def timer(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Time a block into ``metrics["timing_s/<name>"]`` (``RLHFModule.timer``). Runs on: controller."""
    t0 = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = time.perf_counter() - t0
