"""The optimizer step that also writes a bfloat16 engine's rows (``MirroredAdamW``, ``native.AdamWPlan``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_rlhf.config import OptimConfig
from lightning_rlhf.cpu.native import AdamWPlan, native_attention_available
from lightning_rlhf.cpu.optim import MirroredAdamW
from lightning_rlhf.engines.train import make_optimizer

pytestmark = pytest.mark.skipif(not native_attention_available(), reason="needs the CPU kernels (a C compiler)")

AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
"""PyTorch's fused AdamW runs 16-float vectors here: the kernel's body is then the same operations, bit for bit."""


def params_pair(sizes: list[int], seed: int = 0) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    torch.manual_seed(seed)
    ours = [nn.Parameter(torch.randn(n)) for n in sizes]
    return ours, [nn.Parameter(p.detach().clone()) for p in ours]


def step_both(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, a: list[nn.Parameter],
              b: list[nn.Parameter], scale: float, generator: torch.Generator) -> None:  # fmt: skip
    for p, q in zip(a, b, strict=True):
        g = torch.randn(p.shape, generator=generator) * scale
        p.grad, q.grad = g.clone(), g.clone()
    ours.step()
    theirs.step()


@pytest.mark.parametrize(
    ("betas", "weight_decay"), [((0.9, 0.999), 0.01), ((0.3, 0.99), 0.0), ((0.9, 0.95), 0.1)], ids=str
)
def test_the_native_step_is_pytorchs_fused_adamw_and_writes_the_bfloat16_rows(
    betas: tuple[float, float], weight_decay: float
) -> None:
    sizes = [16, 4096, 2048 * 3 + 48, 13, 1000, 17]  # multiples of 16 (PyTorch's vector body) and tails
    ours_p, theirs_p = params_pair(sizes)
    options = {"lr": 3e-3, "betas": betas, "eps": 1e-8, "weight_decay": weight_decay}
    ours = MirroredAdamW(ours_p, fused=True, **options)
    theirs = torch.optim.AdamW(theirs_p, fused=True, **options)
    mirrors = [torch.full(p.shape, float("nan"), dtype=torch.bfloat16) for p in ours_p]
    ours.set_mirrors(list(zip(ours_p, mirrors, strict=True)))
    generator = torch.Generator().manual_seed(1)
    for step, scale in enumerate([1.0, 1e-3, 10.0, 1e-6, 1.0]):
        step_both(ours, theirs, ours_p, theirs_p, scale, generator)
        # the first step makes the state (PyTorch's own step: the mirrors are left to the hand-off)
        assert ours.mirrors_current() == (step > 0)
        for p, q, mirror in zip(ours_p, theirs_p, mirrors, strict=True):
            state, want = ours.state[p], theirs.state[q]
            assert float(state["step"]) == float(want["step"]) == step + 1
            body = p.numel() - p.numel() % 16
            for got, expected in (
                (p, q),
                (state["exp_avg"], want["exp_avg"]),
                (state["exp_avg_sq"], want["exp_avg_sq"]),
            ):
                if AVX512:
                    assert torch.equal(got.detach()[:body], expected.detach()[:body]), (step, p.numel())
                # the tail: PyTorch's compiler vectorises its scalar loop its own way (a rounding apart at most)
                torch.testing.assert_close(got.detach(), expected.detach(), rtol=3e-7, atol=1e-30)
            if step > 0:
                assert torch.equal(mirror, p.detach().to(torch.bfloat16)), (step, p.numel())


def test_mirrors_are_stale_once_anything_else_writes_a_shard() -> None:
    params, _ = params_pair([64, 32])
    mirrors = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
    optimizer = MirroredAdamW(params, lr=1e-2, fused=True)
    assert not optimizer.mirrors_current()  # no mirrors yet
    optimizer.set_mirrors(list(zip(params, mirrors, strict=True)))
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
    assert optimizer.mirrors_current()
    with torch.no_grad():
        params[1].add_(1.0)  # a checkpoint restored in place, an edit by hand
    assert not optimizer.mirrors_current()
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert optimizer.mirrors_current()
    optimizer.zero_grad()
    params[0].grad = torch.ones_like(params[0])  # a parameter without a gradient is not stepped: its mirror is not
    optimizer.step()  # written, so the hand-off casts them all
    assert not optimizer.mirrors_current()


def test_steps_the_kernel_cannot_take_are_pytorchs() -> None:
    params, reference = params_pair([32, 48])
    optimizer = MirroredAdamW(params, lr=1e-2, amsgrad=True)
    theirs = torch.optim.AdamW(reference, lr=1e-2, amsgrad=True)
    optimizer.set_mirrors([(params[0], torch.zeros(32, dtype=torch.bfloat16))])
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        step_both(optimizer, theirs, params, reference, 1.0, generator)
        assert not optimizer.mirrors_current()
    assert all(torch.equal(p, q) for p, q in zip(params, reference, strict=True))
    # tensors the kernel does not take: no plan; gradients it does not take: no step, nothing changed
    half = torch.zeros(16, dtype=torch.bfloat16)
    assert AdamWPlan.make([half], [half], [half], [None]) is None
    strided = torch.zeros(32)[::2]
    assert AdamWPlan.make([strided], [strided], [strided], [None]) is None
    f32 = torch.zeros(16)
    assert AdamWPlan.make([f32], [f32], [f32], [torch.zeros(16)]) is None  # a float32 mirror
    plan = AdamWPlan.make([f32], [f32.clone()], [f32.clone()], [None])
    assert plan is not None
    options = {"lr": 1.0, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "step": 1}
    assert not plan([torch.ones(32)[::2]], **options) and not plan([torch.ones(8)], **options)
    assert float(f32.abs().sum()) == 0
    assert plan([torch.ones(16)], **options) and float(f32.sum()) < 0


def test_the_trainer_s_optimizer_is_the_mirrored_one_and_unchanged_without_mirrors() -> None:
    model = nn.Linear(8, 8)
    reference = copy.deepcopy(model)
    optimizer, _ = make_optimizer(list(model.parameters()), OptimConfig(lr=1e-2, weight_decay=0.1), total_steps=4)
    assert isinstance(optimizer, MirroredAdamW)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(3):
        for m, opt in ((model, optimizer), (reference, theirs)):
            m(torch.ones(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


@pytest.mark.parametrize("mirrored", [False, True], ids=["pytorchs-step", "native-step"])
def test_step_hooks_run_once_whichever_step_runs(mirrored: bool) -> None:
    torch.optim.AdamW([nn.Parameter(torch.zeros(4))])  # a plain AdamW in the process: its class's step is hooked
    param = nn.Parameter(torch.randn(16))
    optimizer = MirroredAdamW([param], lr=1e-2, fused=True)
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    if mirrored:
        optimizer.set_mirrors([(param, torch.zeros(16, dtype=torch.bfloat16))])
    for _ in range(2):  # the first step is PyTorch's (it makes the state); the second native where mirrored
        param.grad = torch.ones(16)
        optimizer.step()
    assert calls == ["pre", "post"] * 2
    assert optimizer.mirrors_current() == mirrored
