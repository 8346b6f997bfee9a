"""The training forward: block-wise log-probs/entropy equal the plain full-size computation, values and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rlhf.algorithms.functional import logprobs_and_entropy
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, BatchingConfig, LossConfig, OptimConfig, RolloutConfig
from lightning_rlhf.engines.train import forward_response, sequence_inputs
from lightning_rlhf.roles import ActorRole


def plain(logits: Tensor, labels: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """The reference: a full float32 tempered copy, ``log_softmax`` and ``softmax`` over all of it."""
    z = logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def plain_forward(model: torch.nn.Module, batch: Batch, temperature: float) -> tuple[Tensor, Tensor]:
    """The pre-existing forward: logits of the last R + 1 positions, the last one dropped, then :func:`plain`."""
    input_ids, attention_mask, position_ids = sequence_inputs(batch, "cpu")
    resp_len = batch["responses"].shape[1]
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=resp_len + 1,
    ).logits[:, :-1]
    return plain(logits, input_ids[:, -resp_len:], temperature)


def rollout_batch(seed: int = 0) -> Batch:
    """Six rows: left-padded prompts, right-padded responses of several lengths."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    return Batch(
        {
            "prompts": torch.randint(4, 18, (6, 3), generator=g) * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": torch.randint(4, 18, (6, 4), generator=g) * mask,
            "response_mask": mask,
            "advantages": torch.randn(6, 1, generator=g).expand(6, 4) * mask,
        }
    )


def close(a: Tensor, b: Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def close_grad(a: Tensor, b: Tensor) -> None:
    """Parameter gradients: sums over many positions in another order, so float32 rounding relative to the scale."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=4e-6 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_forward_response_equals_the_plain_forward(tiny_model: str, temperature: float, entropy_grad: bool) -> None:
    new = AutoModelForCausalLM.from_pretrained(tiny_model).train()
    ref = AutoModelForCausalLM.from_pretrained(tiny_model).train()
    batch = rollout_batch()
    g = torch.Generator().manual_seed(1)
    real = batch["response_mask"].bool()  # padding's outputs are arbitrary (rows are left-aligned, no mask)
    w_lp, w_ent = torch.randn(6, 4, generator=g) * real, torch.randn(6, 4, generator=g) * real

    out = forward_response(
        new, batch, output="logprobs", temperature=temperature, with_entropy=True, entropy_grad=entropy_grad
    )
    ref_logp, ref_ent = plain_forward(ref, batch, temperature)
    close(out["logprobs"][real], ref_logp[real])
    close(out["entropy"][real], ref_ent[real])
    assert out["logprobs"].dtype == out["entropy"].dtype == torch.float32
    assert out["entropy"].requires_grad is entropy_grad

    loss = (out["logprobs"] * w_lp).sum() + ((out["entropy"] * w_ent).sum() if entropy_grad else 0)
    ref_loss = (ref_logp * w_lp).sum() + ((ref_ent * w_ent).sum() if entropy_grad else 0)
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(new.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert q.grad.abs().max() > 0, name  # every weight gets a gradient, so the comparison means something
        close_grad(p.grad, q.grad)


def test_entropy_gradient_is_the_only_difference(tiny_model: str) -> None:
    """With and without the entropy's gradient the log-prob gradients agree and the entropy term does change them."""
    models = [AutoModelForCausalLM.from_pretrained(tiny_model).train() for _ in range(3)]
    batch = rollout_batch(seed=2)
    grads = []
    for model, (ent_grad, coef) in zip(models, [(False, 0.0), (True, 0.0), (True, 1.0)], strict=True):
        out = forward_response(model, batch, output="logprobs", with_entropy=True, entropy_grad=ent_grad)
        (out["logprobs"].sum() + coef * out["entropy"].sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    close_grad(grads[0], grads[1])
    assert (grads[2] - grads[0]).abs().max() > 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [1, 3 * 11, 2 * 5 * 11, 1 << 21])
def test_blocks_give_the_plain_values_and_gradients(temperature: float, chunk_elements: int) -> None:
    """Blocks of one position, of part of a row, of several rows and of everything: same numbers."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 11, generator=g) * 3).requires_grad_(True)
    ref_logits = logits.detach().clone().requires_grad_(True)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    w_lp, w_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)

    logp, ent = logprobs_and_entropy(
        logits, labels, temperature=temperature, with_entropy=True, chunk_elements=chunk_elements
    )
    ref_logp, ref_ent = plain(ref_logits, labels, temperature)
    assert ent is not None
    close(logp, ref_logp)
    close(ent, ref_ent)
    ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
    ((ref_logp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    assert logits.grad is not None and ref_logits.grad is not None
    close_grad(logits.grad, ref_logits.grad)

    # only the entropy used: the log-prob output gets no gradient and that is fine
    logits.grad = None
    _, ent = logprobs_and_entropy(logits, labels, temperature=temperature, with_entropy=True)
    assert ent is not None
    ent.sum().backward()
    ref_logits.grad = None
    plain(ref_logits, labels, temperature)[1].sum().backward()
    close_grad(logits.grad, ref_logits.grad)


def test_low_precision_logits_are_upcast_per_block() -> None:
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 6, 13, generator=g) * 2).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 13, (2, 6), generator=g)
    logp, ent = logprobs_and_entropy(logits, labels, temperature=0.7, with_entropy=True, chunk_elements=13 * 4)
    ref = logits.detach().float().requires_grad_(True)
    ref_logp, ref_ent = plain(ref, labels, 0.7)
    assert ent is not None and logp.dtype == ent.dtype == torch.float32
    close(logp, ref_logp)  # float32 math on the same (bf16-valued) inputs
    close(ent, ref_ent)
    (logp.sum() + ent.sum()).backward()
    (ref_logp.sum() + ref_ent.sum()).backward()
    assert logits.grad is not None and ref.grad is not None
    assert logits.grad.dtype == torch.bfloat16
    # the float32 gradient rounded once to bf16: within one bf16 step (2**-8 relative) of the float32 one
    torch.testing.assert_close(logits.grad.float(), ref.grad, rtol=2**-8, atol=1e-6)


def saved_tensors(fn: object) -> list[Tensor]:
    """The tensors autograd keeps for the backward while ``fn()`` runs."""
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()  # type: ignore[operator]
    return saved


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_no_second_full_size_tensor_is_kept_for_the_backward(temperature: float) -> None:
    logits = torch.randn(4, 8, 64, requires_grad=True)
    labels = torch.randint(0, 64, (4, 8))
    full = logits.numel()

    def run() -> None:
        logprobs_and_entropy(logits, labels, temperature=temperature, with_entropy=True, chunk_elements=64 * 8)

    big = [t for t in saved_tensors(run) if t.numel() >= full]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()  # the input itself, not a copy
    # the plain computation keeps at least one more tensor of the logits' size (the check can fail)
    big_plain = [t for t in saved_tensors(lambda: plain(logits, labels, temperature)) if t.numel() >= full]
    assert len(big_plain) >= 2


def test_bad_inputs_are_refused_before_any_work(tiny_model: str) -> None:
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"temperature=0.*HINT"):
        logprobs_and_entropy(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match=r"labels \(2, 4\).*HINT"):
        logprobs_and_entropy(logits, torch.zeros(2, 4, dtype=torch.long))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    no_prompt = rollout_batch()
    no_prompt["prompts"], no_prompt["prompt_mask"] = no_prompt["prompts"][:, :0], no_prompt["prompt_mask"][:, :0]
    with pytest.raises(ValueError, match=r"0 columns.*HINT"):
        forward_response(model, no_prompt, output="logprobs")


@pytest.mark.parametrize(("coef", "moves"), [(0.0, False), (0.5, True)])
def test_actor_update_trains_the_entropy_only_when_its_coefficient_is_set(
    tiny_model: str, coef: float, moves: bool
) -> None:
    """Zero advantages: the policy-gradient term vanishes, so only an entropy bonus can move the weights."""
    actor = ActorRole(
        tiny_model,
        tokenizer=AutoTokenizer.from_pretrained(tiny_model),
        rollout=RolloutConfig(n=2),
        algorithm=AlgorithmConfig(loss=LossConfig(entropy_coef=coef), batching=BatchingConfig(micro_batch_size=3)),
        optim=OptimConfig(lr=1e-2),
    )
    actor.load()
    actor.configure_optimizer(total_steps=10)
    batch = rollout_batch()
    batch["advantages"] = torch.zeros(6, 4)
    metrics = actor.update(batch)
    assert (metrics["actor/grad_norm"] > 0) is moves
    assert metrics["actor/entropy"] > 0  # reported either way


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compiled_token_kernels_give_the_values_and_gradients(dtype: torch.dtype, temperature: float) -> None:
    """On CPU the log-probs, entropies and their gradient run as compiled kernels (one pass per position): against
    float64 they are within float32 rounding, as close as the block-wise eager ops or closer (a vocabulary with a tail
    of 3 past the kernel's 8-wide vectors, a row of very peaked logits, differentiable entropy). The kernels are the
    CPU layer's, handed to ``logprobs_and_entropy`` as ``kernels``."""
    from lightning_rlhf.algorithms.functional import TokenKernels
    from lightning_rlhf.cpu import CPULayer, native

    assert native.native_attention_available()
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 4099, generator=g) * 4).to(dtype)
    logits[0, 0, 17] = 60.0  # one token with nearly all the mass: an entropy near 0
    labels = torch.randint(0, 4099, (3, 7), generator=g)
    w_lp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)

    def run(x: Tensor, kernels: TokenKernels | None = None) -> tuple[Tensor, Tensor, Tensor]:
        x = x.clone().requires_grad_(True)
        if x.dtype == torch.float64:
            logp, ent = plain(x, labels, temperature)
        else:
            logp, maybe_ent = logprobs_and_entropy(
                x, labels, temperature=temperature, with_entropy=True, kernels=kernels
            )
            assert maybe_ent is not None
            ent = maybe_ent
        ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
        assert x.grad is not None and x.grad.dtype == x.dtype
        return logp.double(), ent.double(), x.grad.double()

    ref_logp, ref_ent, ref_grad = run(logits.double())
    logp, ent, grad = run(logits, CPULayer().token_kernels())
    eager_logp, eager_ent, eager_grad = run(logits)
    for got, eager, ref in ((logp, eager_logp, ref_logp), (ent, eager_ent, ref_ent)):
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
        assert float((got - ref).abs().max()) <= float((eager - ref).abs().max()) + 1e-6
    assert float(ent[0, 0]) < 1e-6
    scale = float(ref_grad.abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6 * scale)
    else:  # rounded once to bfloat16
        torch.testing.assert_close(grad, ref_grad, rtol=2**-8, atol=1e-6 * scale)
    assert float((grad - ref_grad).abs().max()) <= float((eager_grad - ref_grad).abs().max()) + 1e-6 * scale


def test_compiled_token_kernel_refuses_a_label_outside_the_vocabulary() -> None:
    from lightning_rlhf.cpu import native

    with pytest.raises(IndexError, match=r"1 label\(s\) outside \[0, 5\)"):
        native.token_logprobs(torch.randn(1, 2, 5), torch.tensor([[0, 5]]), 1.0, False)
    stats = torch.zeros(1, 2, 1)
    with pytest.raises(IndexError, match=r"token_logprobs_backward: 1 label\(s\) outside \[0, 5\)"):
        native.token_logprobs_backward(torch.randn(1, 2, 5), torch.tensor([[-100, 1]]), stats, None, stats, None, 1.0)


def test_compiled_token_kernels_split_positions_over_threads() -> None:
    """Positions split over two threads (at least 64 each): the same values and gradient as one thread."""
    from lightning_rlhf.cpu import native

    g = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(4, 64, 301, generator=g), torch.randint(0, 301, (4, 64), generator=g)
    g_lp, g_ent = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = native.token_logprobs(logits, labels, 0.9, True)
            assert out is not None
            logp, lse, ent, mean = out
            grad = native.token_logprobs_backward(logits, labels, lse, mean, g_lp, g_ent, 0.9)
            runs.append((logp, lse, ent, mean, grad))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*runs, strict=True):
        assert one is not None and two is not None and torch.equal(one, two)
