"""The fused RMS norm: bitwise the transformers modules' forward, autograd's gradients, switched on a model."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.cpu.kernels import RMS_NORM_CLASSES, fuse_rms_norms, rms_norm, unfuse_rms_norms
from lightning_rlhf.engines.train import TrainEngine

NORMS = [Qwen2RMSNorm, LlamaRMSNorm, Qwen3RMSNorm, MistralRMSNorm]


def test_the_classes_listed_are_the_ones_tested() -> None:
    assert {cls.__name__ for cls in NORMS} == RMS_NORM_CLASSES


@pytest.mark.parametrize("cls", NORMS)
@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_forward_is_bitwise_the_module_and_gradients_match(
    cls: type[torch.nn.Module], x_dtype: torch.dtype, w_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    norm = cls(48, eps=1e-5).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(48))
    x0 = (3 * torch.randn(4, 7, 48)).to(x_dtype)
    grad = torch.randn(4, 7, 48)

    x_ref = x0.clone().requires_grad_()
    y_ref = norm(x_ref)
    y_ref.backward(grad.to(y_ref.dtype))
    w_grad_ref = norm.weight.grad.clone()
    norm.weight.grad = None

    x = x0.clone().requires_grad_()
    y = rms_norm(x, norm.weight, norm.variance_epsilon)
    y.backward(grad.to(y.dtype))

    assert y.dtype == y_ref.dtype
    assert torch.equal(y, y_ref)
    assert x.grad is not None and x_ref.grad is not None and x.grad.dtype == x_dtype
    assert norm.weight.grad is not None and norm.weight.grad.dtype == w_dtype
    tol = 1e-5 if x_dtype == torch.float32 else 1e-2  # bfloat16 gradients: one rounding of the result apart
    torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(norm.weight.grad.float(), w_grad_ref.float(), rtol=tol, atol=tol)


def test_no_grad_and_inference_mode() -> None:
    norm = Qwen2RMSNorm(16)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


def tiny_qwen2() -> torch.nn.Module:
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def logits_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's logits on ``ids`` and every parameter's gradient of ``sum(logsumexp(logits))``."""
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fuse_switches_every_norm_and_keeps_outputs_gradients_and_state() -> None:
    model = tiny_qwen2()
    ids = torch.randint(0, 64, (3, 9))
    keys = list(model.state_dict())

    logits_ref, grads_ref = logits_and_grads(model, ids)
    assert fuse_rms_norms(model) == 2 * 2 + 1  # two per layer and the final norm
    assert fuse_rms_norms(model) == 5  # idempotent
    logits, grads = logits_and_grads(model, ids)
    assert torch.equal(logits, logits_ref)
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert list(model.state_dict()) == keys
    clone = copy.deepcopy(model)  # a role's model may be copied (reference); the copy keeps its own switch
    assert torch.equal(clone(input_ids=ids).logits, logits_ref)
    assert all(m.forward.__self__ is m for m in clone.modules() if "forward" in m.__dict__)
    assert unfuse_rms_norms(model) == 5
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert torch.equal(model(input_ids=ids).logits, logits_ref)


def test_train_engine_binds_with_fused_norms_unless_turned_off() -> None:
    model = tiny_qwen2()
    TrainEngine(micro_batch_size=1, layer=CPULayer()).bind(model)
    assert unfuse_rms_norms(model) == 5
    TrainEngine(micro_batch_size=1, fused_norms=False, layer=CPULayer()).bind(model)
    assert unfuse_rms_norms(model) == 0
