"""The training engine on one process: micro-batching changes no gradient, frozen roles hold bfloat16, and bad
settings are refused before any weight is read."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf.algorithms import MicroBatchAggregation
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import OptimConfig
from lightning_rlhf.engines.train import TrainEngine, check_compute_dtype, forward_response, resolve_dtype
from lightning_rlhf.roles import ReferenceRole
from tests.unit.test_actor_update import rollout_batch as rollout  # 6 rows of uneven response lengths


def engine(path: str, micro: int) -> TrainEngine:
    eng = TrainEngine(micro_batch_size=micro, optim=OptimConfig(lr=1e-2, grad_clip=0.0), setting="test")
    eng.bind(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    eng.configure_optimizer(10)
    return eng


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_size_changes_no_update(tiny_model: str, aggregation: str) -> None:
    results = []
    for micro in (1, 4, 6):  # 6 rows: one micro-batch; 4: uneven parts (4 + 2); 1: row by row
        eng = engine(tiny_model, micro)

        def surrogate(
            m: Batch, agg: MicroBatchAggregation, eng: TrainEngine = eng
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            assert eng.model is not None
            logp = forward_response(eng.model, m, output="logprobs")["logprobs"]
            loss = agg.aggregate(-m["advantages"] * logp, m["response_mask"])
            return loss, {"loss": agg.report(loss, m["response_mask"])}

        acc = eng.train(
            rollout(), surrogate, aggregation=aggregation, count_mask=lambda b: b["response_mask"], max_len=4
        )
        metrics = acc.result("t")
        assert metrics["t/grad_norm"] > 0 and metrics["t/update_skipped"] == 0
        assert eng.model is not None
        results.append((metrics["t/grad_norm"], [p.detach().clone() for p in eng.model.parameters()]))
    (norm_a, params_a), *others = results
    for norm_b, params_b in others:
        # The norm of the summed gradient (before clipping) catches any wrong micro-batch scale; Adam's first step
        # is scale-free, so the parameters only show that the direction agrees (Adam amplifies float noise in
        # near-zero gradients to ~1e-5, and up to ~1e-4 for a gradient within float noise of 0; a wrong direction
        # moves them by ~lr = 1e-2).
        assert norm_b == pytest.approx(norm_a, rel=1e-5)
        for pa, pb in zip(params_a, params_b, strict=True):
            torch.testing.assert_close(pa, pb, rtol=0, atol=1e-3)


def test_infer_concatenates_micro_batches_like_one_forward(tiny_model: str) -> None:
    whole, split = engine(tiny_model, 6), engine(tiny_model, 4)

    def logprobs(model: torch.nn.Module, micro: Batch) -> dict[str, torch.Tensor]:
        return forward_response(model, micro, output="logprobs")

    a, b = whole.infer(rollout(), logprobs)["logprobs"], split.infer(rollout(), logprobs)["logprobs"]
    assert a.shape == (6, 4) and not a.requires_grad
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_non_finite_gradient_skips_the_step(tiny_model: str) -> None:
    eng = engine(tiny_model, 6)
    assert eng.model is not None
    before = [p.detach().clone() for p in eng.model.parameters()]

    def nan_loss(m: Batch, agg: MicroBatchAggregation) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert eng.model is not None
        logp = forward_response(eng.model, m, output="logprobs")["logprobs"]
        return agg.aggregate(logp * float("nan"), m["response_mask"]), {}

    metrics = eng.train(rollout(), nan_loss, aggregation="token-mean", count_mask=lambda b: b["response_mask"]).result(
        "t"
    )
    assert metrics["t/update_skipped"] == 1
    for p, q in zip(before, eng.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_frozen_role_held_in_bfloat16(tiny_model: str) -> None:
    ref = ReferenceRole(tiny_model, temperature=1.0, micro_batch_size=4, dtype=torch.bfloat16)
    ref.load()
    assert ref.model is not None
    assert {p.dtype for p in ref.model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in ref.model.parameters())
    out = ref.log_prob(rollout())["ref_logprobs"]
    full = ReferenceRole(tiny_model, temperature=1.0, micro_batch_size=4)
    full.load()
    exact = full.log_prob(rollout())["ref_logprobs"]
    assert out.shape == exact.shape and not torch.equal(out, exact)  # really computed in bfloat16 ...
    torch.testing.assert_close(out.float(), exact, atol=0.1, rtol=0.05)  # ... and close to float32


def test_dtype_settings_are_checked() -> None:
    assert resolve_dtype("bf16", setting="RLHFModule.frozen_dtype") is torch.bfloat16
    assert resolve_dtype("torch.float32", setting="x") is torch.float32
    assert resolve_dtype(None, setting="x") is None
    with pytest.raises(ValueError, match=r"RLHFModule.frozen_dtype='int8' is not a dtype .* HINT: 'float32'"):
        resolve_dtype("int8", setting="RLHFModule.frozen_dtype")
    with pytest.raises(ValueError, match=r"RLHFStrategy.param_dtype=torch.int64 is not supported"):
        resolve_dtype(torch.int64, setting="RLHFStrategy.param_dtype")
    with pytest.raises(ValueError, match=r"RLHFStrategy.param_dtype=float16 cannot run on CPU.*HINT: use bfloat16"):
        check_compute_dtype(torch.float16, torch.device("cpu"), setting="RLHFStrategy.param_dtype")
    check_compute_dtype(torch.bfloat16, torch.device("cpu"), setting="RLHFStrategy.param_dtype")  # CPUs compute it


class _Mesh:
    """The one thing ``shard`` asks a mesh before sharding: its number of ranks."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks

    def size(self) -> int:
        return self.ranks


def test_a_model_smaller_than_the_world_is_refused_before_sharding() -> None:
    eng = TrainEngine(micro_batch_size=1, setting="CriticRole(path=...)")
    eng.bind(torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.Linear(3, 1)))
    with pytest.raises(ValueError, match=r"CriticRole\(path=...\): the model's largest parameter has 3 rows, fewer "):
        eng.shard(_Mesh(4), param_dtype=None)  # type: ignore[arg-type]
    assert not eng.sharded


def test_micro_batch_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"ReferenceRole\(path=...\): micro_batch_size=0 must be >= 1"):
        TrainEngine(micro_batch_size=0, setting="ReferenceRole(path=...)")


def test_attn_implementation_switches_the_kernel_and_keeps_the_log_probs(tiny_model: str) -> None:
    sdpa, eager = engine(tiny_model, 6), engine(tiny_model, 6)
    eager.attn_implementation = "eager"  # after bind: applied to the bound model at once
    assert eager.model is not None and sdpa.model is not None
    assert eager.model.config._attn_implementation == "eager"
    assert sdpa.model.config._attn_implementation == "sdpa"

    def logprobs(model: torch.nn.Module, micro: Batch) -> dict[str, torch.Tensor]:
        return forward_response(model, micro, output="logprobs")

    mask = rollout()["response_mask"].bool()
    a, b = sdpa.infer(rollout(), logprobs)["logprobs"], eager.infer(rollout(), logprobs)["logprobs"]
    torch.testing.assert_close(a[mask], b[mask], rtol=1e-5, atol=1e-5)
    late = TrainEngine(micro_batch_size=2, setting="RLHFModule(attn_implementation=...)")
    late.attn_implementation = "eager"  # before bind: applied when the model is bound
    late.bind(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    assert late.model is not None and late.model.config._attn_implementation == "eager"


def test_a_bad_attn_implementation_names_the_setting(tiny_model: str) -> None:
    eng = engine(tiny_model, 2)
    with pytest.raises(ValueError, match=r"test: attn_implementation='no_such_kernel'.*HINT"):
        eng.attn_implementation = "no_such_kernel"
    with pytest.raises(ValueError, match="attn_implementation=3"):
        eng.attn_implementation = 3  # type: ignore[assignment]
