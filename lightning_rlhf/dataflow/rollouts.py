"""DAPO's dynamic sampling, and the rollout an asynchronous run keeps for its next step, as a checkpoint stores it."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, cast

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_rlhf.algorithms import informative_groups
from lightning_rlhf.batch import Batch

__all__ = ["extra_prompts", "keep_informative_groups", "pack_rollout", "unpack_rollout"]


def keep_informative_groups(
    batch: Batch,
    rollout: Batch,
    metrics: dict[str, float],
    *,
    n: int,
    max_rounds: int,
    draw: Callable[[int, int], Batch],
    generate: Callable[[Batch], Batch],
) -> Batch:
    """DAPO's dynamic sampling (:meth:`RLHFModule.keep_informative_groups`) over ``rollout``, ``batch`` generated
    and scored; ``draw(count, key)`` gives more prompts, ``generate`` generates and scores them. Runs on: controller."""
    want = len(batch)
    kept: list[Batch] = []  # per round: the rows of its informative groups (n consecutive rows a group)
    dropped: list[Batch] = []
    num_kept = num_dropped = rounds = 0
    first_meta = rollout.meta
    metrics["dynamic_sampling/raw_score/mean"] = float(rollout["scores"].float().mean())  # before selection
    while True:
        groups, informative = informative_groups(rollout["scores"], rollout["uid"])
        keep_rows = torch.isin(rollout["uid"], groups[informative])
        kept.append(rollout.select(torch.nonzero(keep_rows)[:, 0]))
        dropped.append(rollout.select(torch.nonzero(~keep_rows)[:, 0]))
        num_kept += int(informative.sum())
        num_dropped += len(groups) - int(informative.sum())
        rounds += 1
        if num_kept >= want or rounds >= max_rounds:
            break
        more = draw(want, int(batch.meta.get("step", 0)) * 1_000 + rounds)
        more.meta = {**batch.meta, "sampling_round": rounds}
        rollout = generate(more)
    filled = max(0, want - num_kept)
    out = Batch.cat(kept).select(slice(0, (want - filled) * n))  # the first `want` informative groups
    if filled:  # still short: the first dropped groups make up the batch
        out = Batch.cat([out, Batch.cat(dropped).select(slice(0, filled * n))])
    out.meta = dict(first_meta)  # the weight hand-off happened in the first round
    out["uid"] = torch.arange(want).repeat_interleave(n)  # groups of different rounds share uids
    metrics["dynamic_sampling/rounds"] = rounds
    metrics["dynamic_sampling/dropped_groups"] = num_dropped
    metrics["dynamic_sampling/filled_groups"] = filled
    return out


def extra_prompts(loader: Any, count: int, *, key: int) -> Batch:
    """``count`` prompts drawn at random (seeded by ``key``) from the training ``loader`` (its ``sample``), for
    dynamic sampling. Runs on: controller."""
    sample = getattr(loader, "sample", None)
    if sample is None:
        raise TypeError(
            "AlgorithmConfig.filtering.dynamic_sampling=True draws extra prompts from the training loader, but it is "
            f"a {type(loader).__name__} without `sample(count, key=...)`. HINT: use lightning_rlhf's "
            "PromptDataModule, or set dynamic_sampling=False."
        )
    return cast(Batch, sample(count, key=key))


def pack_rollout(rollout: Batch) -> dict[str, Any]:
    """``rollout`` as tensors only, for a checkpoint read with ``weights_only=True``: dataset columns may hold any
    picklable value, so the columns and meta travel pickled in a byte tensor. Runs on: controller."""
    rest = bytearray(pickle.dumps((rollout.columns, rollout.meta)))
    return {"tensors": rollout.tensors, "rest": torch.frombuffer(rest, dtype=torch.uint8)}


def unpack_rollout(state: dict[str, Any] | None, *, asynchronous: bool) -> Batch | None:
    """The rollout :func:`pack_rollout` stored, for an ``asynchronous`` run (None: none stored; a synchronous run
    drops it, saying so). Runs on: every process (restoring a checkpoint)."""
    if state is None:
        return None
    if not asynchronous:
        rank_zero_warn(
            "The checkpoint holds a rollout generated for its next step (an asynchronous run), and this run is "
            "synchronous: that rollout is dropped and each step generates its own batch."
        )
        return None
    columns, meta = pickle.loads(state["rest"].numpy().tobytes())
    return Batch(state["tensors"], columns, meta)


def streamed_rollout(module: Any, batch: Batch, metrics: dict[str, float], *, take: bool) -> Batch | None:
    """A step of streamed rollouts (``AsyncConfig.stream`` / ``partial_rollouts``): the newest weights to the rollout
    pool (pausing its stream), ``batch``'s prompts admitted, and, with ``take``, the stream's oldest complete groups
    (the first step takes none, so a batch is always in flight); the stream's figures go to ``metrics``. Runs on: the
    controller (``RLHFModule.rollouts``)."""
    rollout_role = module.rollout_role
    settings = module.algorithm.asynchronous
    metrics |= module.sync_rollout_weights(lag=0, max_staleness=0)  # every update's weights, at once
    with module.timer("wait_rollout", metrics):
        rollout = cast(
            Batch,
            rollout_role.stream(
                batch, take=take, interrupt=settings.partial_rollouts, max_staleness=settings.max_staleness
            ),
        )
    if not take:
        return None
    metrics |= rollout.meta.pop("stream", {})
    metrics["timing_s/gen"] = float(rollout.meta.get("gen_s", 0.0))
    return rollout
