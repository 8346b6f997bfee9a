"""Transfer protocols: how a call's arguments are split and its results merged."""

from __future__ import annotations

import pytest
import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.dispatch import Dispatch, dispatch_of, merge_results, role_method, split_args


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
