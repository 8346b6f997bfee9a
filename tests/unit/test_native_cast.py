"""The hand-off's float32 -> bfloat16 cast kernel (``native.CastPlan``): the values ``Tensor.copy_`` gives."""

from __future__ import annotations

import torch

from lightning_rlhf.cpu import native


def test_cast_plan_rounds_as_copy_does_at_any_size_and_offset() -> None:
    assert native.native_attention_available(), "the kernels must build where the tests run"
    torch.manual_seed(0)
    # rows of a store at odd element offsets (unaligned starts), sizes below, at and above the vectors' 16
    store = torch.zeros(4_000, dtype=torch.bfloat16)
    sizes, offsets = [1, 15, 16, 17, 33, 1000, 2047], [3, 20, 64, 81, 130, 300, 1500]
    sources = [torch.randn(n) * 10.0 ** torch.randint(-30, 30, (n,)) for n in sizes]
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-41, 3.4e38, 1.00390625, 1.01171875])
    sources[-1][: len(special)] = special  # signed zeros, infinities, denormals, ties to even
    places = [store[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
    plan = native.CastPlan.make(places, sources)
    assert plan is not None
    plan()
    for place, source in zip(places, sources, strict=True):
        assert torch.equal(place.view(torch.int16), source.to(torch.bfloat16).view(torch.int16))
    # what lies between the places is untouched
    covered = torch.zeros(len(store), dtype=torch.bool)
    for o, n in zip(offsets, sizes, strict=True):
        covered[o : o + n] = True
    assert float(store[~covered].float().abs().sum()) == 0.0
    # NaN stays NaN
    nan = torch.tensor([float("nan")] * 20)
    out = torch.zeros(20, dtype=torch.bfloat16)
    native.CastPlan.make([out], [nan])()  # type: ignore[misc]
    assert bool(out.isnan().all())


def test_cast_plan_refuses_what_it_cannot_take() -> None:
    f32, bf16 = torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    assert native.CastPlan.make([bf16], [f32.to(torch.float64)]) is None  # another source dtype
    assert native.CastPlan.make([f32], [f32]) is None  # not a cast
    assert native.CastPlan.make([bf16[:4]], [f32]) is None  # sizes differ
    assert native.CastPlan.make([torch.zeros(4, 4, dtype=torch.bfloat16).t()], [torch.zeros(16)]) is None  # strided
