"""The update loop shared by trainable roles: epochs x mini-batches x micro-batches with exact token weighting."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_rlhf.batch import Batch

__all__ = ["MetricAccumulator", "global_token_count", "minibatches", "world"]


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the data-parallel group (``(0, 1)`` without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_token_count(mask: Tensor) -> Tensor:
    """Number of masked-in tokens summed over all ranks. Runs on: every worker rank (an all-reduce)."""
    count = mask.sum().float()
    if world()[1] > 1:
        count = count.to(_reduce_device())
        dist.all_reduce(count)
    return count.to(mask.device)


def _reduce_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def minibatches(batch: Batch, *, mini_batch_size: int, epochs: int) -> Iterator[Batch]:
    """This rank's mini-batches for all epochs. ``mini_batch_size`` counts samples over all ranks.

    Runs on: worker. Every rank yields the same number of mini-batches (the batch arithmetic was checked
    before training), which keeps the FSDP collectives in step.
    """
    local = mini_batch_size // world()[1]
    for _ in range(epochs):
        yield from batch.split(local)


def _reduce(key: str, values: Tensor) -> Tensor:
    """Metrics named ``*_max`` / ``*_min`` keep their extreme; the others are averaged."""
    if key.endswith("_max"):
        return values.max()
    if key.endswith("_min"):
        return values.min()
    return values.mean()


class MetricAccumulator:
    """Averages scalar metrics over micro-batches and mini-batches on one rank."""

    def __init__(self) -> None:
        self._values: dict[str, list[Tensor]] = defaultdict(list)

    def add(self, metrics: dict[str, Tensor]) -> None:
        for k, v in metrics.items():
            self._values[k].append(v.detach().float().reshape(()))

    def result(self, prefix: str, transform: Callable[[str], str] | None = None) -> dict[str, float]:
        """Means as Python floats (one host sync per update, not per micro-batch)."""
        if not self._values:
            return {}
        keys = list(self._values)
        means = torch.stack([_reduce(k, torch.stack(self._values[k])) for k in keys]).cpu().tolist()
        return {f"{prefix}/{transform(k) if transform else k}": v for k, v in zip(keys, means, strict=True)}
