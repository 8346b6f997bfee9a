"""Float32 linears through oneDNN: F.linear's outputs and gradients (to float32 rounding), switched on a model."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_rlhf.cpu import CPULayer, onednn
from lightning_rlhf.cpu.onednn import OneDNNLinearFunction, linear, onednn_linears, plain_linears
from lightning_rlhf.engines.train import TrainEngine
from tests.unit.test_kernels import logits_and_grads, tiny_qwen2

pytestmark = pytest.mark.skipif(not onednn.onednn_available(), reason="this PyTorch build has no oneDNN")


@pytest.mark.parametrize(("out_features", "in_features"), [(24, 40), (40, 24), (32, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_outputs_and_gradients_match_f_linear(out_features: int, in_features: int, bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features, bias=bias)
    x0 = torch.randn(3, 5, in_features)
    grad = torch.randn(3, 5, out_features)

    def run(fn: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = x0.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = fn(x, layer.weight, layer.bias)  # type: ignore[operator]
        y.backward(grad)
        return y.detach(), [t.grad for t in (x, layer.weight, layer.bias) if t is not None]  # type: ignore[misc]

    y_ref, grads_ref = run(F.linear)
    y, grads = run(OneDNNLinearFunction.apply)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.shape == g_ref.shape and g.is_contiguous()
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
    # the product is float32's, not a lower precision: the error against float64 stays at float32 rounding
    exact = F.linear(x0.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert (y.double() - exact).abs().max() < 1e-5 * exact.abs().max()


def test_only_what_needs_a_gradient_gets_one() -> None:
    torch.manual_seed(0)
    weight = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(4, 6)
    linear(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, torch.ones(4, 8).t() @ x)
    frozen = torch.randn(8, 6)
    x = torch.randn(4, 6, requires_grad=True)
    linear(x, frozen).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 8) @ frozen)
    with torch.no_grad():
        out = linear(x, weight)
    assert out.grad_fn is None and not out.requires_grad


@pytest.mark.parametrize("shape", [(0, 6), (2, 0, 6), (6,)])
def test_empty_and_one_dimensional_inputs_match_f_linear(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(8, 6, requires_grad=True), torch.randn(8, requires_grad=True)
    x = torch.randn(*shape, requires_grad=True)
    out = linear(x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias))
    out.sum().backward()  # oneDNN has no primitive for an empty product: those go through F.linear
    assert x.grad is not None and x.grad.shape == x.shape and weight.grad is not None


def test_other_dtypes_and_subclasses_take_f_linear() -> None:
    x, w = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True), torch.randn(4, 8, dtype=torch.bfloat16)
    assert type(linear(x, w).grad_fn).__name__ != "OneDNNLinearFunctionBackward"
    x32 = torch.randn(3, 8, requires_grad=True)
    assert type(linear(x32, w.float()).grad_fn).__name__ == "OneDNNLinearFunctionBackward"

    class Marked(torch.Tensor):
        pass

    marked = torch.randn(4, 8).as_subclass(Marked).requires_grad_()
    assert type(linear(x32, marked).grad_fn).__name__ != "OneDNNLinearFunctionBackward"


@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # flags() also sets oneDNN's TF32 switch, for Intel GPUs
def test_pytorch_s_mkldnn_switch_is_honoured() -> None:
    x, weight = torch.randn(3, 8, requires_grad=True), torch.randn(4, 8)
    with torch.backends.mkldnn.flags(enabled=False):
        assert type(linear(x, weight).grad_fn).__name__ != "OneDNNLinearFunctionBackward"
    assert type(linear(x, weight).grad_fn).__name__ == "OneDNNLinearFunctionBackward"


def test_switches_plain_linears_of_a_model_with_the_same_outputs_and_gradients() -> None:
    model = tiny_qwen2()
    ids = torch.randint(0, 64, (3, 9))
    keys = list(model.state_dict())

    logits_ref, grads_ref = logits_and_grads(model, ids)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert linears == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer and the head
    assert onednn_linears(model) == linears
    assert onednn_linears(model) == linears  # idempotent
    logits, grads = logits_and_grads(model, ids)
    assert model.lm_head.forward.__func__ is onednn._onednn_forward  # type: ignore[attr-defined]
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-4, atol=1e-5, msg=name)
    assert list(model.state_dict()) == keys
    clone = copy.deepcopy(model)  # a copy (a reference from the actor) keeps its own switch
    assert all(m.forward.__self__ is m for m in clone.modules() if "forward" in m.__dict__)
    assert plain_linears(model) == linears
    assert torch.equal(model(input_ids=ids).logits, F.linear(*_head_inputs(model, ids)))


def _head_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = model.model(input_ids=ids).last_hidden_state  # type: ignore[operator]
    return hidden, model.lm_head.weight  # type: ignore[return-value]


def test_adapter_subclasses_keep_their_forward() -> None:
    class Adapter(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(4, 4), Adapter(4, 4))
    assert onednn_linears(model) == 1
    assert "forward" not in model[1].__dict__


def test_train_engine_binds_with_onednn_linears_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN's float32 products beat MKL's (AMD CPUs; forced here), the training engine switches every linear
    layer; on an Intel CPU it leaves them to MKL."""
    monkeypatch.setattr(onednn, "fp32_through_onednn", lambda: True)
    model = tiny_qwen2()
    TrainEngine(micro_batch_size=1, layer=CPULayer()).bind(model)
    assert plain_linears(model) == 15
    TrainEngine(micro_batch_size=1, onednn_linears=False, layer=CPULayer()).bind(model)
    assert plain_linears(model) == 0
    monkeypatch.setattr(onednn, "fp32_through_onednn", lambda: False)
    TrainEngine(micro_batch_size=1, layer=CPULayer()).bind(model)
    assert plain_linears(model) == 0


def test_fp32_goes_through_onednn_on_amd_cpus_only() -> None:
    onednn.fp32_through_onednn.cache_clear()
    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    assert onednn.fp32_through_onednn() == (amd and onednn.onednn_available())


def test_environment_variable_turns_it_off() -> None:
    code = (
        "from lightning_rlhf.cpu.onednn import onednn_linears; import torch; "
        "print(onednn_linears(torch.nn.Sequential(torch.nn.Linear(2, 2))))"
    )
    env = {**os.environ, onednn.ONEDNN_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
