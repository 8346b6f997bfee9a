"""Transfer protocols: how a role method's data is split across the workers and gathered back.

A role method declares its protocol once, where it is defined::

    class ActorRole(Role):
        @role_method(Dispatch.DP_SPLIT)
        def log_prob(self, batch: Batch) -> Batch: ...

On the controller, during a training step, calling ``self.actor.log_prob(batch)`` sends the call to every
worker rank, splits ``batch`` by data-parallel rank, runs the method on all ranks as one SPMD program and
returns the concatenated result. Anywhere else (a single process, a worker executing the call, a unit test)
the decorated method is a plain method call.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch

from lightning_rlhf.batch import Batch

if TYPE_CHECKING:
    from lightning_rlhf.roles.base import Role

__all__ = ["Dispatch", "current_controller", "merge_results", "role_method", "split_args"]


class Dispatch(enum.Enum):
    """How a role call's arguments reach the workers and how their results come back."""

    ONE_TO_ALL = "one_to_all"
    """Every rank gets the same arguments; the controller keeps rank 0's result."""
    DP_SPLIT = "dp_split"
    """The first argument (a :class:`Batch`) is split into equal parts by data-parallel rank; results are
    concatenated (batches) or averaged (dicts of metrics) in rank order."""
    RANK_ZERO = "rank_zero"
    """Only the controller's rank runs the method; the other ranks do nothing."""


class _Controller(Protocol):
    def call(self, role: Role, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


_ACTIVE: list[_Controller | None] = []
F = TypeVar("F", bound=Callable[..., Any])


def current_controller() -> _Controller | None:
    """The controller that is running a training step in this process, if any.

    Runs on: any process. Only rank 0 has one, and only inside the strategy's training or validation step.
    """
    return _ACTIVE[-1] if _ACTIVE else None


class controller_active:
    """Route role-method calls through ``controller`` (rank 0, inside a step); ``None`` makes them local
    again (while a role method itself runs, its calls to other role methods are plain calls)."""

    def __init__(self, controller: _Controller | None) -> None:
        self._controller = controller

    def __enter__(self) -> None:
        _ACTIVE.append(self._controller)

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.pop()


def role_method(dispatch: Dispatch) -> Callable[[F], F]:
    """Declare a role method's transfer protocol.

    Runs on: import time (decorator). The wrapped method runs on the controller (which distributes it) or
    locally on a worker.

    Args:
        dispatch: the protocol used when the controller calls this method.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Role, *args: Any, **kwargs: Any) -> Any:
            controller = current_controller()
            if controller is None:
                return fn(self, *args, **kwargs)
            return controller.call(self, fn.__name__, args, kwargs)

        wrapper.__rlhf_dispatch__ = dispatch  # type: ignore[attr-defined]
        return cast(F, wrapper)

    return decorate


def dispatch_of(role: Role, method: str) -> Dispatch:
    """The protocol declared on ``role.method``; a clear error if the method has none."""
    fn = getattr(type(role), method, None)
    proto = getattr(fn, "__rlhf_dispatch__", None)
    if proto is None:
        raise TypeError(
            f"`{type(role).__name__}.{method}` has no transfer protocol. "
            "HINT: decorate it with `@role_method(Dispatch.DP_SPLIT)` (or ONE_TO_ALL / RANK_ZERO)."
        )
    return cast(Dispatch, proto)


def split_args(
    dispatch: Dispatch, args: tuple[Any, ...], kwargs: dict[str, Any], world_size: int, *, where: str
) -> list[tuple[tuple[Any, ...], dict[str, Any]] | None]:
    """Arguments for each rank (``None``: the rank skips the call).

    Runs on: controller.
    """
    if dispatch is Dispatch.ONE_TO_ALL:
        return [(args, kwargs)] * world_size
    if dispatch is Dispatch.RANK_ZERO:
        return [(args, kwargs)] + [None] * (world_size - 1)
    if not args or not isinstance(args[0], Batch):
        got = type(args[0]).__name__ if args else "no positional argument"
        raise TypeError(f"{where} is DP_SPLIT: pass the Batch as its first positional argument (got {got}).")
    batch = args[0]
    if len(batch) % world_size:
        raise ValueError(
            f"{where}: a batch of {len(batch)} rows cannot be split evenly over {world_size} ranks. "
            "HINT: make the batch size (prompts per step, and prompts x samples per prompt) a multiple of the "
            "number of ranks."
        )
    return [((part, *args[1:]), kwargs) for part in batch.chunk(world_size)]


def merge_results(dispatch: Dispatch, results: Sequence[Any]) -> Any:
    """Combine per-rank results into the controller's return value.

    Runs on: controller. Batches are concatenated in rank order; dicts of numbers are averaged over ranks
    (``*_max``/``*_min`` keys keep their extreme);
    anything else comes from rank 0.
    """
    if dispatch is not Dispatch.DP_SPLIT or len(results) == 1:
        return results[0]
    first = results[0]
    if isinstance(first, Batch):
        return Batch.cat(list(results))
    if isinstance(first, dict):
        return {k: _reduce(k, [r[k] for r in results]) for k in first}
    return first


def _reduce(key: str, values: list[Any]) -> Any:
    """Average over ranks, except metrics named ``*_max`` / ``*_min``, which keep their extreme."""
    if isinstance(values[0], torch.Tensor):
        stacked = torch.stack([v.float() for v in values])
        if key.endswith("_max"):
            return stacked.amax(0)
        return stacked.amin(0) if key.endswith("_min") else stacked.mean(0)
    if key.endswith("_max"):
        return max(values)
    return min(values) if key.endswith("_min") else sum(values) / len(values)
