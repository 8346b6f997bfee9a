"""Transfer protocols: how a call's arguments are split and its results merged."""

from __future__ import annotations

import pytest
import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.controller.dispatch import Dispatch, dispatch_of, merge_results, role_method, split_args


def test_dp_split_gives_each_rank_an_equal_contiguous_part() -> None:
    b = Batch({"x": torch.arange(6)}, {"t": list("abcdef")})
    per_rank = split_args(Dispatch.DP_SPLIT, (b, 1), {"k": 2}, 3, where="r.m")
    assert [a[0][0]["t"] for a in per_rank] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert all(a[0][1] == 1 and a[1] == {"k": 2} for a in per_rank)
    with pytest.raises(ValueError, match=r"r\.m: a batch of 6 rows cannot be split evenly over 4 ranks"):
        split_args(Dispatch.DP_SPLIT, (b,), {}, 4, where="r.m")
    with pytest.raises(TypeError, match="pass the Batch as its first positional argument"):
        split_args(Dispatch.DP_SPLIT, ([1, 2],), {}, 2, where="r.m")


def test_one_to_all_and_rank_zero() -> None:
    assert split_args(Dispatch.ONE_TO_ALL, (1,), {}, 3, where="") == [((1,), {})] * 3
    assert split_args(Dispatch.RANK_ZERO, (1,), {}, 3, where="") == [((1,), {}), None, None]


def test_merge_concatenates_batches_and_averages_metrics() -> None:
    parts = [Batch({"x": torch.tensor([i])}) for i in range(3)]
    assert merge_results(Dispatch.DP_SPLIT, parts)["x"].tolist() == [0, 1, 2]
    assert merge_results(Dispatch.DP_SPLIT, [{"loss": 1.0}, {"loss": 3.0}]) == {"loss": 2.0}
    assert merge_results(Dispatch.ONE_TO_ALL, ["r0", "r1"]) == "r0"


def test_declared_protocol_and_local_calls() -> None:
    class R:
        name = "r"

        @role_method(Dispatch.ONE_TO_ALL)
        def ping(self, x: int) -> int:
            return x + 1

        def plain(self) -> None: ...

    assert R().ping(1) == 2  # no controller active: a plain call
    assert dispatch_of(R(), "ping") is Dispatch.ONE_TO_ALL  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`R.plain` has no transfer protocol"):
        dispatch_of(R(), "plain")  # type: ignore[arg-type]


class Scorer:
    """A role whose methods declare the columns they read and write (what a scoring forward does)."""

    name = "scorer"
    prefix = "cost_"
    seen: list[list[str]]

    def __init__(self) -> None:
        self.seen = []

    @role_method(Dispatch.DP_SPLIT, reads=("x", "absent"), writes=("y",))
    def score(self, batch: Batch) -> Batch:
        self.seen.append(batch.keys())
        batch["y"] = batch["x"] * 2
        return batch

    @role_method(Dispatch.DP_SPLIT, reads=("x",), writes=lambda role: (f"{role.prefix}y",))
    def prefixed(self, batch: Batch) -> Batch:
        batch[f"{self.prefix}y"] = batch["x"] + 1
        return batch

    @role_method(Dispatch.DP_SPLIT, reads=("x",), writes=("y",))
    def sneaky(self, batch: Batch) -> Batch:
        batch["y"] = batch["x"]
        batch["x"] = batch["x"] + 1  # replaces a column it does not declare: it would be lost on the way back
        return batch

    @role_method(Dispatch.DP_SPLIT, reads=("x",), writes=("y",))
    def drops_rows(self, batch: Batch) -> Batch:
        out = batch.select(slice(0, 1))
        out["y"] = out["x"]
        return out


def test_declared_columns_travel_alone_and_the_caller_gets_its_batch_back_with_the_written_ones() -> None:
    from lightning_rlhf.controller.controller import Controller, WorkerError
    from lightning_rlhf.controller.dispatch import controller_active

    scorer = Scorer()
    controller = Controller({"scorer": scorer}.__getitem__, rank=0, world_size=1)  # type: ignore[arg-type]
    batch = Batch({"x": torch.arange(4), "big": torch.zeros(4, 100)}, {"text": list("abcd")}, {"step": 3})
    with controller_active(controller):
        out = scorer.score(batch)
        assert scorer.seen == [["x"]]  # only the declared column that exists went to the worker
        assert out["y"].tolist() == [0, 2, 4, 6] and out.meta["step"] == 3
        assert out["big"] is batch["big"] and out["text"] == list("abcd")  # the caller's columns, not copies
        assert "y" not in batch  # the caller's batch itself is not changed
        assert scorer.prefixed(batch)["cost_y"].tolist() == [1, 2, 3, 4]  # writes named from the role
        with pytest.raises(WorkerError, match=r"adds or replaces the undeclared columns \['x'\]"):
            scorer.sneaky(batch)
        with pytest.raises(WorkerError, match=r"must return its input batch \(one row per input row, 4 here\)"):
            scorer.drops_rows(batch)
    assert Scorer().score(batch).keys() == ["x", "big", "y", "text"]  # no controller: a plain call, nothing trimmed
    with pytest.raises(ValueError, match=r"column declarations apply to Dispatch\.DP_SPLIT methods"):
        role_method(Dispatch.ONE_TO_ALL, reads=("x",))


def test_written_columns_of_a_token_balanced_split_come_back_in_the_callers_row_order() -> None:
    """Two ranks, simulated with the controller's own functions: a split balanced by tokens hands each rank rows out
    of order; the written column returns to the caller's rows, the split's meta keys do not leak, and the caller's
    batch is not changed."""
    import pickle

    from lightning_rlhf.controller.dispatch import BALANCE_KEY, ROWS_KEY, only_written, with_written

    lengths = [1, 8, 2, 7, 3, 6, 4, 5]
    batch = Batch(
        {
            "prompts": torch.ones(8, 2, dtype=torch.long),
            "prompt_mask": torch.ones(8, 2, dtype=torch.long),
            "responses": torch.arange(8)[:, None].repeat(1, 8),
            "response_mask": torch.tensor([[1] * n + [0] * (8 - n) for n in lengths]),
            "advantages": torch.randn(8, 8),
        },
        {"text": list("abcdefgh")},
        {"step": 5, BALANCE_KEY: True},
    )
    per_rank = split_args(
        Dispatch.DP_SPLIT, (batch,), {}, 2, where="r.m", reads=("prompts", "prompt_mask", "responses", "response_mask")
    )
    replies = []
    for args in per_rank:
        assert args is not None
        part = pickle.loads(pickle.dumps(args[0][0]))  # what a worker receives
        assert sorted(part.keys()) == ["prompt_mask", "prompts", "response_mask", "responses"]
        inputs = {**part.tensors, **part.columns}
        part["score"] = part["responses"][:, 0].float() * 10  # a per-row result the caller can check
        replies.append(pickle.loads(pickle.dumps(only_written("r.m", inputs, part, ("score",)))))
    assert [r.meta[ROWS_KEY] for r in replies] != [[0, 1, 2, 3], [4, 5, 6, 7]]  # the split did reorder rows
    out = with_written(batch, merge_results(Dispatch.DP_SPLIT, replies), ("score",))
    assert out["score"].tolist() == [10.0 * i for i in range(8)]
    assert out["advantages"] is batch["advantages"] and out["text"] == list("abcdefgh")
    assert ROWS_KEY not in out.meta and BALANCE_KEY not in out.meta and out.meta["step"] == 5
    assert "score" not in batch


def test_a_batch_without_any_column_a_method_reads_fails_on_the_controller() -> None:
    batch = Batch({"x": torch.arange(4)})
    with pytest.raises(KeyError, match=r"r\.m reads \['prompts', 'responses'\], and the batch has none of them"):
        split_args(Dispatch.DP_SPLIT, (batch,), {}, 2, where="r.m", reads=("responses", "prompts"))


def test_a_background_call_returns_the_callers_batch_as_it_was_when_the_call_was_made() -> None:
    from lightning_rlhf.controller.controller import Controller
    from lightning_rlhf.controller.dispatch import controller_active, in_background

    scorer = Scorer()
    controller = Controller({"scorer": scorer}.__getitem__, rank=0, world_size=1)  # type: ignore[arg-type]
    batch = Batch({"x": torch.arange(4)})
    with controller_active(controller):
        with in_background():
            future = scorer.score(batch)
        batch["later"] = torch.zeros(4)  # set after the call was made: not part of its result
        out = future.result()
    assert out["y"].tolist() == [0, 2, 4, 6] and "later" not in out
