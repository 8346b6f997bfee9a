"""Placement (role -> rank pools) and concurrent role calls, in one process.

The multi-process runs (split pools, concurrency timings, resume) are in ``tests/distributed/test_placement_runs.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_rlhf import RLHFStrategy
from lightning_rlhf.batch import Batch
from lightning_rlhf.controller.controller import Controller, WorkerError
from lightning_rlhf.controller.dispatch import Dispatch, RoleFuture, concurrently, controller_active, role_method
from lightning_rlhf.placement.pools import check_divides, check_memory, resolve_placement
from lightning_rlhf.roles.base import Role

ROLES = ["actor", "critic", "reference", "reward"]


def test_no_placement_puts_every_role_on_every_rank() -> None:
    assert resolve_placement(None, ROLES, 3) == {role: (0, 1, 2) for role in ROLES}


def test_a_mapping_gives_each_role_its_sorted_ranks() -> None:
    pools = resolve_placement({"actor": [1, 0], "reward": [0, 1], "critic": [2, 3], "reference": range(2, 4)}, ROLES, 4)
    assert pools == {"actor": (0, 1), "reward": (0, 1), "critic": (2, 3), "reference": (2, 3)}


@pytest.mark.parametrize(
    ("spec", "world", "words"),
    [
        ({"actor": [0], "critic": [1], "reference": [1]}, 2, ["gives no ranks to ['reward']", "'reward': [...]"]),
        ({**{key: [0] for key in ROLES}, "critc": [1]}, 2, ["names ['critc']", "its roles"]),
        ({**{key: [0, 1] for key in ROLES}, "critic": [2, 3]}, 2, ["names rank 3", "2 processes", "than the world"]),
        ({"actor": [0, 1, 2], "reward": [0, 1, 2], "critic": [2, 3], "reference": [2, 3]}, 4, ["overlap at ranks [2]"]),
    ],
)
def test_bad_placements_name_the_setting_and_the_fix(spec: dict, world: int, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        resolve_placement(spec, ROLES, world)
    text = str(err.value)
    assert "RLHFStrategy(placement" in text and "HINT" in text
    for word in words:
        assert word in text, text


@pytest.mark.parametrize(
    ("spec", "error", "word"),
    [
        ("split", ValueError, "is not a placement"),
        ({"actor": []}, ValueError, "the pool is empty"),
        ({"actor": [0, 0]}, ValueError, "listed twice"),
        ({"actor": [-1]}, ValueError, "non-negative ints"),
        ({"actor": "0,1"}, TypeError, "list of ints"),
        ([["actor"]], TypeError, "mapping role -> ranks"),
    ],
)
def test_malformed_placements_fail_when_the_strategy_is_built(spec: object, error: type, word: str) -> None:
    with pytest.raises(error, match=word):
        RLHFStrategy("hf", placement=spec)  # type: ignore[arg-type]


def test_a_placement_needs_sharded_checkpoints() -> None:
    with pytest.raises(ValueError, match="save_distributed_checkpoint=True"):
        RLHFStrategy("hf", placement={"actor": [0]}, save_distributed_checkpoint=False)


def test_a_tp_size_must_divide_its_pool() -> None:
    pools = resolve_placement({"actor": [0, 1, 2], "reward": [0, 1, 2], "critic": [3], "reference": [3]}, ROLES, 4)
    check_divides(pools, role="actor", size=3, setting="VLLMConfig.tensor_parallel_size")
    with pytest.raises(ValueError, match=r"VLLMConfig.tensor_parallel_size=2 does not divide the 3 ranks.*\[1, 3\]"):
        check_divides(pools, role="actor", size=2, setting="VLLMConfig.tensor_parallel_size")


def test_a_pool_that_does_not_fit_in_memory_is_refused() -> None:
    pools = resolve_placement({"actor": [0], "reward": [0], "critic": [1, 2, 3], "reference": [1, 2, 3]}, ROLES, 4)
    gib = 2**30
    sizes = {"actor": 16 * gib, "critic": 30 * gib, "reference": 3 * gib}
    check_memory(pools, sizes, budget=16 * gib, where="RLHFStrategy(placement=...)")  # 16 and 11 GiB per rank
    with pytest.raises(ValueError, match=r"pool \[0\] \(actor, reward\) needs 16 GiB per rank.*a rank has 15 GiB"):
        check_memory(pools, sizes, budget=15 * gib, where="RLHFStrategy(placement=...)")


# ------------------------------------------------------------------------------------- concurrent calls
class Scorer(Role):
    """A role whose calls record their order (the controller's worker loop runs them)."""

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__()
        self.name = name
        self.log = log

    @role_method(Dispatch.DP_SPLIT)
    def score(self, batch: Batch, *, offset: float = 0.0) -> Batch:
        self.log.append(f"{self.name}.score")
        out = Batch({f"{self.name}_score": batch["x"] * 2 + offset})
        return batch.update(out)

    @role_method(Dispatch.DP_SPLIT)
    def fail(self, batch: Batch) -> Batch:
        raise RuntimeError(f"{self.name} failed on purpose")


def _controller(roles: dict[str, Role]) -> Controller:
    return Controller(lambda name: roles[name], rank=0, world_size=1)


def test_calls_in_a_block_return_futures_and_run_when_it_ends() -> None:
    log: list[str] = []
    roles: dict[str, Role] = {"a": Scorer("a", log), "b": Scorer("b", log)}
    controller = _controller(roles)
    batch = Batch({"x": torch.arange(4.0)})
    with controller_active(controller):
        with concurrently():
            fa = roles["a"].score(batch, offset=1.0)
            fb = roles["b"].score(batch)
            assert isinstance(fa, RoleFuture) and not fa.done() and log == []  # nothing ran yet
            with pytest.raises(RuntimeError, match="inside the `with concurrently\\(\\):` block"):
                fa.result()
        assert log == ["a.score", "b.score"]  # in the order written
        assert torch.equal(fa.result()["a_score"], torch.arange(4.0) * 2 + 1)
        assert torch.equal(fb.result()["b_score"], torch.arange(4.0) * 2)
        assert fa.seconds > 0 and fb.seconds > 0
        assert controller.last_seconds == [fa.seconds, fb.seconds]


def test_a_call_cannot_take_a_future_from_its_own_block() -> None:
    log: list[str] = []
    roles: dict[str, Role] = {"a": Scorer("a", log), "b": Scorer("b", log)}
    with concurrently():  # no controller: calls run as they are made, still as futures
        fa = roles["a"].score(Batch({"x": torch.ones(2)}))
        assert fa.done() and log == ["a.score"]
        with pytest.raises(RuntimeError, match=r"takes the result of `a.score` from the same block"):
            roles["b"].score(fa)


def test_a_failing_call_in_a_block_raises_with_its_traceback() -> None:
    log: list[str] = []
    roles: dict[str, Role] = {"a": Scorer("a", log), "b": Scorer("b", log)}
    controller = _controller(roles)
    with controller_active(controller), pytest.raises(WorkerError, match=r"b\.fail") as err, concurrently():
        roles["a"].score(Batch({"x": torch.ones(2)}))
        roles["b"].fail(Batch({"x": torch.ones(2)}))
    assert "b failed on purpose" in err.value.remote_traceback
    assert log == ["a.score"]
