"""The transformers engine's own sampling loop (cpu/decode.py): the same tokens as transformers'
``generate`` where both are deterministic, the trainer's log-probs where they sample, the right distribution, and
the fall-back to ``generate`` for architectures it does not know."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.cpu.decode import _pick, decode_loop_unsupported, sample_loop
from lightning_rlhf.engines.rollout import HFRolloutEngine, SamplingParams
from lightning_rlhf.engines.rollout.base import processed_logprobs

CPU = torch.device("cpu")
LOOP = CPULayer().decode_loop()
"""The loop a CPU run's transformers engine is given (``make_rollout_engine(layer=...)``)."""
SHAPE = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def llama_family() -> list[torch.nn.Module]:
    """One random model of each architecture the loop serves (grouped-query attention, Qwen2's biases, Qwen3's
    per-head norms, Llama's untied head)."""
    models: list[torch.nn.Module] = []
    for config_cls, model_cls in ((Qwen2Config, Qwen2ForCausalLM), (LlamaConfig, LlamaForCausalLM)):
        torch.manual_seed(0)
        models.append(model_cls(config_cls(**SHAPE, pad_token_id=0, eos_token_id=1)))
    torch.manual_seed(0)
    models.append(Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=8, pad_token_id=0, eos_token_id=1)))
    return [m.eval() for m in models]


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18], [19]]  # left padding of 0 to 5 tokens


@pytest.mark.parametrize("index", range(3), ids=["qwen2", "llama", "qwen3"])
def test_greedy_tokens_are_transformers_greedy_for_padded_prompts(index: int) -> None:
    model = llama_family()[index]
    assert decode_loop_unsupported(model, max_length=30) is None
    params = SamplingParams(n=1, max_new_tokens=12, min_new_tokens=12, greedy=True)
    tokens, logprobs = sample_loop(model, PROMPTS, params, stops={1}, pad_token_id=0, device=CPU)
    for row, prompt in enumerate(PROMPTS):  # each prompt alone: no padding on transformers' side
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=12,
            min_new_tokens=12,
            pad_token_id=0,
            eos_token_id=1,
        )
        assert tokens[row].tolist() == out[0, len(prompt) :].tolist()
    assert bool((logprobs <= 0).all()) and bool(torch.isfinite(logprobs).all())


@pytest.mark.parametrize("index", range(3), ids=["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("cut", [{}, {"top_k": 5}], ids=["full", "top_k"])
@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["padded", "one_prompt"])
def test_sampled_log_probs_are_those_of_a_full_forward(
    index: int, cut: dict[str, int], prompts: list[list[int]]
) -> None:
    model = llama_family()[index]
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=0, **cut)
    torch.manual_seed(0)
    tokens, logprobs = sample_loop(model, prompts, params, stops={1}, pad_token_id=0, device=CPU)
    assert tokens.shape == logprobs.shape == (len(prompts) * 3, 10)
    with torch.no_grad():
        for row in range(tokens.shape[0]):
            prompt = prompts[row // 3]  # the samples of one prompt are consecutive
            response = tokens[row].tolist()
            if 1 in response:
                response = response[: response.index(1) + 1]
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            expected = processed_logprobs(logits, temperature=0.7, **cut).gather(1, torch.tensor(response)[:, None])
            torch.testing.assert_close(logprobs[row, : len(response)], expected[:, 0], atol=2e-5, rtol=0)


def test_samples_follow_the_distribution_and_never_draw_a_cut_token() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    scores = probs.log().expand(40_000, -1).clone()  # 40,000 rows: one draw each
    token, logprob = _pick(scores, SamplingParams(temperature=1.0))
    freq = torch.bincount(token, minlength=5).float() / token.numel()
    assert torch.allclose(freq, probs, atol=0.01)  # 4 sigma of a binomial at 40,000 draws is < 0.01
    assert torch.allclose(logprob, probs.log()[token])
    token, logprob = _pick(scores, SamplingParams(temperature=1.0, top_k=2))
    freq = torch.bincount(token, minlength=5).float() / token.numel()
    assert freq[2:].sum() == 0 and abs(float(freq[0]) - 0.5 / 0.8) < 0.01
    assert torch.allclose(logprob, (probs[:2] / 0.8).log()[token])
    token, _ = _pick(scores, SamplingParams(temperature=0.5))  # sharper: p^2 renormalised
    sharp = probs**2 / (probs**2).sum()
    assert torch.allclose(torch.bincount(token, minlength=5).float() / token.numel(), sharp, atol=0.01)


def test_two_level_draw_follows_the_distribution_and_matches_one_cumulative_sum() -> None:
    import lightning_rlhf.cpu.decode as decode

    # 512 entries = 8 blocks of 64: mass in blocks 0, 2 and 7 only, a zero entry inside a block with mass
    probs = torch.zeros(512)
    probs[[3, 70, 130, 131, 140, 511]] = torch.tensor([0.2, 0.0, 0.25, 0.05, 0.1, 0.4])
    torch.manual_seed(0)
    scores = probs.log().expand(40_000, -1).clone()
    token, logprob = _pick(scores, SamplingParams(temperature=1.0))
    freq = torch.bincount(token, minlength=512).float() / token.numel()
    assert torch.allclose(freq, probs, atol=0.01) and freq[probs == 0].sum() == 0
    torch.testing.assert_close(logprob, probs.log()[token])
    # the same uniforms give the same entries as one cumulative sum over the whole row
    dense = torch.softmax(torch.randn(64, 4096) * 3, dim=-1)
    torch.manual_seed(1)
    two_level = decode._draw(dense)
    torch.manual_seed(1)
    u = torch.rand((64, 1))
    cdf = dense.cumsum(dim=-1)
    one_level = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    assert int((two_level != one_level).sum()) <= 1  # only rounding could move a draw that falls on a boundary


def test_the_loop_stops_when_every_row_has_stopped() -> None:
    model = llama_family()[0]
    params = SamplingParams(n=1, max_new_tokens=12, greedy=True)
    first, _ = sample_loop(model, PROMPTS[:1], params, stops=set(), pad_token_id=0, device=CPU)
    stop = int(first[0, 2])  # the third greedy token: a stop token there ends the only row
    tokens, _ = sample_loop(model, PROMPTS[:1], params, stops={stop}, pad_token_id=0, device=CPU)
    cut = first[0].tolist().index(stop) + 1
    assert tokens.shape[1] == cut and tokens[0].tolist() == first[0, :cut].tolist()


def test_engine_samples_the_same_responses_with_either_loop_when_greedy(demo_model: str) -> None:
    tok = AutoTokenizer.from_pretrained(demo_model)
    model = AutoModelForCausalLM.from_pretrained(demo_model)
    kw = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "device": CPU, "decode_loop": LOOP}
    loop, generate = HFRolloutEngine(model, **kw), HFRolloutEngine(model, decode="generate", **kw)
    prompts = [tok(p)["input_ids"] for p in ("3+4=", "12+9=", "1+1=")]
    params = SamplingParams(n=2, max_new_tokens=6, greedy=True)
    assert loop.decodes_with_loop(prompts, params) and not generate.decodes_with_loop(prompts, params)
    a, b = loop.generate(prompts, params), generate.generate(prompts, params)
    assert a.responses == b.responses and len(a.responses) == 6
    for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
        assert max(abs(u - v) for u, v in zip(x, y, strict=True)) < 1e-5
    sampled = loop.generate(prompts, SamplingParams(n=4, max_new_tokens=6, seed=3))
    assert sampled.responses == loop.generate(prompts, SamplingParams(n=4, max_new_tokens=6, seed=3)).responses


def test_other_architectures_fall_back_to_generate() -> None:
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    assert "model_type 'gpt2'" in (decode_loop_unsupported(gpt2, max_length=20) or "")
    engine = HFRolloutEngine(gpt2, pad_token_id=0, eos_token_id=1, device=CPU)
    params = SamplingParams(n=2, max_new_tokens=5, min_new_tokens=5, seed=0)
    assert not engine.decodes_with_loop(PROMPTS, params)
    out = engine.generate(PROMPTS, params)
    assert [len(r) for r in out.responses] == [5] * 8
    assert all(math.isfinite(v) for lps in out.logprobs or [] for v in lps)
    window = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert "sliding window" in (decode_loop_unsupported(window, max_length=20) or "")
    with pytest.raises(ValueError, match="decode='fast'"):
        HFRolloutEngine(gpt2, pad_token_id=0, eos_token_id=1, device=CPU, decode="fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_over_the_written_slots_equals_attention_over_the_whole_cache(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eager attention reads only the written cache slots in float32 (the whole capacity in bfloat16 on CPU); the
    hidden slots add nothing, so both spans sample the same tokens with the same log-probs up to float rounding."""
    import lightning_rlhf.cpu.decode as decode

    mask = torch.ones((1, 3), dtype=torch.bool)
    assert decode._written_slots_only(decode._Cache(llama_family()[0], mask, 2, 4, torch.float32, CPU))
    assert not decode._written_slots_only(decode._Cache(llama_family()[0], mask, 2, 4, torch.bfloat16, CPU))
    model = llama_family()[2].to(dtype)  # Qwen3: grouped queries, per-head norms
    monkeypatch.setattr(decode, "_native_kernels", lambda cache: False)  # the eager ops (the kernel reads the span)
    assert_same_samples_either_way(model, monkeypatch, "_written_slots_only")


def assert_same_samples_either_way(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    """Sample with the decode module's predicate ``switch`` forced on, then off: the same tokens, and log-probs equal
    up to float rounding."""
    import lightning_rlhf.cpu.decode as decode

    dtype = next(model.parameters()).dtype
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, min_new_tokens=8)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(decode, switch, lambda *args, on=on: on)
        torch.manual_seed(0)
        runs.append(sample_loop(model, PROMPTS, params, stops={1}, pad_token_id=0, device=CPU))
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prepacked_projections_sample_what_plain_ones_do(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the loop's projections run with weights reordered for oneDNN; the plain ``F.linear`` path samples the
    same tokens with the same log-probs up to float rounding, and the model's parameters are left as they were."""
    import lightning_rlhf.cpu.decode as decode
    from lightning_rlhf.cpu import onednn

    # float32 packs where oneDNN beats MKL (AMD CPUs): the path is checked on any CPU
    monkeypatch.setattr(onednn, "fp32_through_onednn", lambda: True)
    model = llama_family()[0].to(dtype)  # Qwen2: biases on the fused query/key/value projection
    supported = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert decode._packs(model) == supported  # bfloat16 only where oneDNN has the CPU's bfloat16 path
    _, head = decode._layers(model, 8)
    assert head.packed == (dtype == torch.bfloat16 and supported)  # float32 packs weights of 65,536 elements and up
    monkeypatch.setattr(onednn, "PACK_MIN_FLOAT32", 0)  # this model's float32 weights are below the size packed
    monkeypatch.setattr(decode, "_packs", lambda model: True)
    layers, head = decode._layers(model, 8)  # where oneDNN cannot reorder, every projection stays plain
    assert all(linear.packed == supported for linear in [head, *(lin for layer in layers for lin in layer)])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert_same_samples_either_way(model, monkeypatch, "_packs")
    for name, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and torch.equal(p, before[name]), name


def test_a_hand_off_after_the_projections_were_fused_reaches_the_next_call(demo_model: str) -> None:
    """The first call lays the query/key/value and gate/up parameters out as one tensor each; weights copied into
    the engine afterwards (a hand-off) are what the next call samples with."""
    tok = AutoTokenizer.from_pretrained(demo_model)
    model = AutoModelForCausalLM.from_pretrained(demo_model)
    engine = HFRolloutEngine(
        model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device=CPU, decode_loop=LOOP
    )
    prompts = [tok(p)["input_ids"] for p in ("3+4=", "12+9=")]
    params = SamplingParams(n=1, max_new_tokens=6, min_new_tokens=6, greedy=True)
    original = engine.generate(prompts, params)
    q, k = engine.model.model.layers[0].self_attn.q_proj.weight, engine.model.model.layers[0].self_attn.k_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()  # one tensor now
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_pretrained(demo_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.load_weights(other.named_parameters())
    fresh = HFRolloutEngine(
        other, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device=CPU, decode_loop=LOOP
    )
    a, b = engine.generate(prompts, params), fresh.generate(prompts, params)
    assert a.responses == b.responses and a.responses != original.responses
    for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
        assert max(abs(u - v) for u, v in zip(x, y, strict=True)) < 1e-5


def test_a_cpu_without_onednn_bfloat16_decodes_bfloat16_unpacked() -> None:
    """On a CPU whose oneDNN has no bfloat16 path (AVX2 only: many AMD and client CPUs, emulated here with
    ``ONEDNN_MAX_CPU_ISA``, which must be set before oneDNN starts), the loop does not pack bfloat16 weights and
    still samples; float32 still packs."""
    import os
    import subprocess
    import sys

    code = """
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
import lightning_rlhf.cpu.decode as decode
import lightning_rlhf.cpu.onednn as onednn
from lightning_rlhf.engines.rollout import SamplingParams
assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()
onednn.fp32_through_onednn = lambda: True  # float32 packs where oneDNN beats MKL (AMD CPUs)
torch.manual_seed(0)
shape = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1)
model = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
assert decode._packs(model)
model = model.to(torch.bfloat16)
assert not decode._packs(model)
params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, min_new_tokens=6, seed=0)
tokens, logprobs = decode.sample_loop(model, [[5, 6, 7], [8]], params, stops={1}, pad_token_id=0,
                                      device=torch.device("cpu"))
assert tokens.shape == (4, 6) and bool(torch.isfinite(logprobs).all())
print("ok")
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def eager_step_attention(
    query: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    bias: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n: int,
    span: int,
    scaling: float,
) -> torch.Tensor:
    """The step's attention in float64, written out plainly: per row, its prompt's keys (with the padding bias) and
    its own first ``span`` keys, one softmax."""
    out = torch.empty(query.shape, dtype=torch.float64)
    for r in range(query.shape[0]):
        p = r // n
        k = torch.cat((prefix_keys[p], keys[r, :, :span]), dim=1).double()  # [kv, width + span, d]
        v = torch.cat((prefix_values[p], values[r, :, :span]), dim=1).double()
        add = torch.cat((bias.reshape(-1, prefix_keys.shape[2])[p].double(), torch.zeros(span, dtype=torch.float64)))
        scores = query[r].double() @ k.transpose(-1, -2) * scaling + add  # [kv, group, keys]
        out[r] = torch.softmax(scores, dim=-1) @ v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("kv_heads", "group", "d", "n", "threads"),
    [(2, 2, 64, 3, 1), (1, 3, 32, 2, 1), (2, 1, 128, 1, 1), (2, 2, 128, 8, 2), (3, 2, 24, 4, 1)],
    ids=["gqa-64", "group3-32", "mha-128", "gqa-128-2threads", "generic-24"],
)
def test_fused_step_attention_is_the_softmax_attention(
    dtype: torch.dtype, kv_heads: int, group: int, d: int, n: int, threads: int
) -> None:
    """The compiled kernel against the attention in float64, for head sizes it specialises (32, 64, 128) and one it
    does not (24), grouped and plain queries, padded prompts, the first and the last step, one thread and two (the
    kernel starts a second one for calls of 2 x 2^18 multiply-adds and more: 24 rows x 4 heads x 47 keys x 128)."""
    from lightning_rlhf.cpu import native

    if not native.native_attention_available():
        pytest.fail("the decoding attention kernel did not build on a machine with a C compiler (see the log)")
    torch.manual_seed(0)
    prompts, width, cap = 3, 7, 40
    rows = prompts * n
    mask = torch.ones(prompts, width, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[2, :1] = False
    bias = torch.zeros(mask.shape).masked_fill_(~mask, -math.inf)[:, None, None]
    query = torch.randn(rows, kv_heads, group, d).to(dtype)
    prefix_keys, prefix_values = (torch.randn(prompts, kv_heads, width, d).to(dtype) for _ in range(2))
    keys, values = (torch.randn(rows, kv_heads, cap, d).to(dtype) for _ in range(2))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for span in (1, 5, cap):
            out = native.decode_attention(
                query, prefix_keys, prefix_values, bias, keys, values, n=n, span=span, scaling=d**-0.5
            )
            assert out is not None and out.dtype == dtype and out.shape == query.shape
            expected = eager_step_attention(query, prefix_keys, prefix_values, bias, keys, values, n, span, d**-0.5)
            atol = 2e-6 if dtype == torch.float32 else 1e-2  # bfloat16: one rounding of the output (|out| < 4)
            torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    finally:
        torch.set_num_threads(threads_before)


def qwen2_with_head_size(d: int, kv_heads: int = 2, group: int = 2) -> Qwen2ForCausalLM:
    """A random Qwen2 model (query/key/value biases) whose head size the compiled decoding step takes."""
    torch.manual_seed(0)
    heads = kv_heads * group
    shape = {**SHAPE, "hidden_size": heads * d, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    return Qwen2ForCausalLM(Qwen2Config(**shape, head_dim=d, pad_token_id=0, eos_token_id=1)).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_kind", ["qwen3", "qwen2-16"])
def test_the_loop_samples_the_same_with_the_compiled_kernels_or_the_eager_ops(
    dtype: torch.dtype, model_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole loop: the compiled kernels and the eager ops give the same tokens and log-probs (to float rounding),
    for grouped queries and padded prompts: with Qwen3's per-head norms (the attention step, norms and SiLU products
    compiled; the rotation eager), and with Qwen2's head size 16 (the whole decoding step compiled, as one call)."""
    from lightning_rlhf.cpu import native

    assert native.native_attention_available()
    model = llama_family()[2] if model_kind == "qwen3" else qwen2_with_head_size(16)
    calls = [0]
    step = native.DecodeStep.__call__

    def counted(self: native.DecodeStep, *args: Any) -> torch.Tensor:
        calls[0] += 1
        return step(self, *args)

    monkeypatch.setattr(native.DecodeStep, "__call__", counted)
    assert_same_samples_either_way(model.to(dtype), monkeypatch, "_native_kernels")
    # 7 decoding steps x 2 layers, in the run with the kernels only
    assert calls[0] == (0 if model_kind == "qwen3" else 14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("kv_heads", "group", "d", "n"), [(2, 2, 64, 3), (1, 3, 32, 2), (2, 1, 16, 1)])
def test_the_compiled_decoding_step_is_the_eager_one(
    dtype: torch.dtype, kv_heads: int, group: int, d: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One call of the compiled step (rotary embedding of the queries and keys, cache writes, attention) against the
    eager ops of the same layer on the same fused projection: the same output and cache contents up to float
    rounding (bfloat16: each product and sum of the rotation rounded as the eager ops round them)."""
    import lightning_rlhf.cpu.decode as decode

    model = qwen2_with_head_size(d, kv_heads, group).to(dtype)
    mask = torch.ones((3, 5), dtype=torch.bool)
    mask[0, :2] = False  # a padded prompt
    caches = [decode._Cache(model, mask, n, 6, dtype, CPU) for _ in range(2)]
    fused, eager = caches[0].steps[0], caches[1]
    assert fused is not None
    torch.manual_seed(1)
    for name in ("prefix_keys", "prefix_values"):
        for a, b in zip(getattr(caches[0], name), getattr(caches[1], name), strict=True):
            a.copy_(torch.randn(a.shape))
            b.copy_(a)
    rows, heads = 3 * n, kv_heads * group
    attn = model.model.layers[0].self_attn
    monkeypatch.setattr(decode, "_native_kernels", lambda cache: False)  # the eager ops for the reference
    tol = {"atol": 2e-6, "rtol": 0} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 0}
    for step in range(4):
        qkv = torch.randn(rows, 1, (heads + 2 * kv_heads) * d).to(dtype)
        cos, sin = model.model.rotary_emb(qkv, torch.full((rows, 1), 5 + step))
        got = fused(qkv, cos, sin, step).clone()
        eager.bias[..., step] = 0.0
        want = decode._attention(attn, qkv, decode._rotation(cos, sin), 0, eager, step, None)
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(caches[0].keys[0], eager.keys[0], **tol)
        assert torch.equal(caches[0].values[0], eager.values[0])


def test_the_compiled_decoding_step_refuses_what_it_cannot_take() -> None:
    """Head size 24 (not a multiple of 16): no compiled step (the loop runs the layer's attention as before); inputs
    of another shape or dtype than the plan's raise, naming what was expected."""
    import lightning_rlhf.cpu.decode as decode

    mask = torch.ones((2, 3), dtype=torch.bool)
    assert decode._Cache(qwen2_with_head_size(24), mask, 2, 4, torch.float32, CPU).steps == [None, None]
    step = decode._Cache(qwen2_with_head_size(16), mask, 2, 4, torch.float32, CPU).steps[0]
    assert step is not None
    cos = torch.zeros(4, 1, 16)
    with pytest.raises(ValueError, match=r"expected \[4, 1, 128\] and \[4, 1, 16\] contiguous torch.float32"):
        step(torch.zeros(4, 1, 96), cos, cos, 0)
    with pytest.raises(ValueError, match=r"0 <= step < 4"):
        step(torch.zeros(4, 1, 128), cos, cos, 4)
    with pytest.raises(ValueError, match="expected"):
        step(torch.zeros(4, 1, 128, dtype=torch.bfloat16), cos, cos, 0)


def test_a_head_size_the_kernel_does_not_take_samples_through_the_eager_ops() -> None:
    """Head size 4 (not a multiple of the kernel's 8-float vectors): the attention step falls back to the eager ops,
    and the loop still gives transformers' greedy tokens."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "hidden_size": 16}, pad_token_id=0, eos_token_id=1)).eval()
    assert model.model.layers[0].self_attn.head_dim == 4
    q = torch.zeros(2, 1, 1, 4)
    from lightning_rlhf.cpu import native

    assert native.decode_attention(q, q[:1], q[:1], torch.zeros(1, 1), q, q, n=2, span=1, scaling=1.0) is None
    params = SamplingParams(n=1, max_new_tokens=6, min_new_tokens=6, greedy=True)
    tokens, _ = sample_loop(model, PROMPTS[:1], params, stops={1}, pad_token_id=0, device=CPU)
    out = model.generate(torch.tensor(PROMPTS[:1]), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                         pad_token_id=0, eos_token_id=1)  # fmt: skip
    assert tokens[0].tolist() == out[0, len(PROMPTS[0]) :].tolist()


def test_the_kernel_refuses_shapes_that_do_not_agree() -> None:
    from lightning_rlhf.cpu import native

    q = torch.zeros(4, 1, 1, 8)
    with pytest.raises(ValueError, match=r"decode_attention: shapes do not agree.*HINT"):
        native.decode_attention(q, q[:2], q[:2], torch.zeros(2, 1), q, q, n=3, span=1, scaling=1.0)  # 4 rows, n=3


def test_without_a_compiler_the_loop_keeps_its_eager_attention(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A compiler that fails, a compiler that is not there, or LIGHTNING_RLHF_NATIVE=0 leaves the kernel off with a
    warning, and the loop still samples, through the eager ops."""
    from lightning_rlhf.cpu import native

    monkeypatch.setenv("LIGHTNING_RLHF_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "false")  # runs, and fails
    native._library.cache_clear()
    try:
        assert not native.native_attention_available()
        q = torch.zeros(2, 1, 1, 8)
        assert native.decode_attention(q, q[:1], q[:1], torch.zeros(1, 1), q, q, n=2, span=1, scaling=1.0) is None
        params = SamplingParams(n=2, max_new_tokens=4, min_new_tokens=4, seed=0)
        tokens, logprobs = sample_loop(llama_family()[0], PROMPTS, params, stops={1}, pad_token_id=0, device=CPU)
        assert tokens.shape == (8, 4) and bool(torch.isfinite(logprobs).all())
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        native._library.cache_clear()
        assert not native.native_attention_available()
        monkeypatch.delenv("CC")
        monkeypatch.setenv("LIGHTNING_RLHF_NATIVE", "0")
        native._library.cache_clear()
        assert not native.native_attention_available()
        assert not list(tmp_path.rglob("*.so"))
    finally:
        native._library.cache_clear()  # the next test builds (or finds) the real kernel again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [64, 36], ids=["vectors", "tail"])
def test_compiled_norm_and_gated_product_are_transformers_own(dtype: torch.dtype, width: int) -> None:
    """The compiled RMS norm and SiLU-gated product against transformers' Qwen2 norm and MLP activation on the same
    inputs (widths that are and are not multiples of 8): equal up to float32 rounding, and to one bfloat16 rounding
    where the summation order can move a value across a rounding boundary; large and very negative gates too."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from lightning_rlhf.cpu import native

    assert native.native_attention_available()
    torch.manual_seed(0)
    norm = Qwen2RMSNorm(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width) + 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(5, 3, width) * 3).to(dtype)
    out = native.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert out is not None and out.dtype == dtype
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 2**-7}
    torch.testing.assert_close(out, norm(x), **tol)
    gate_up = (torch.randn(7, 2 * width) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-120.0, -90.0, 95.0, 0.0])  # exp(-g) over- and underflows
    gated = native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert gated is not None and gated.shape == (7, width)
    torch.testing.assert_close(gated, torch.nn.functional.silu(gate) * up, **tol)
    assert native.rms_norm(x.transpose(0, 1), norm.weight, 1e-6) is None  # not contiguous: the caller's eager ops
    assert native.silu_mul(gate_up.to(torch.float16)) is None  # a dtype the kernels do not take


@pytest.mark.parametrize("index", range(3), ids=["qwen2", "llama", "qwen3"])
def test_a_second_turn_from_kept_keys_samples_as_a_fresh_prompt_pass(index: int) -> None:
    """A multi-turn episode's next turn: the conversation so far (cut inside the first turn's response, or past its
    last fed token), then new tokens. Run on what the first call kept, it draws the same tokens with the same
    log-probs as a prompt pass over the whole conversation, for every row (some rows with nothing kept)."""
    from lightning_rlhf.cpu.decode import Past

    model = llama_family()[index]
    first = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, min_new_tokens=8, seed=0)
    kept: list[Past] = []
    torch.manual_seed(0)
    tokens, _ = sample_loop(model, PROMPTS, first, stops={1}, pad_token_id=0, device=CPU, keep=kept)
    assert len(kept) == 8 and all(len(p.ids) == len(PROMPTS[r // 2]) + 7 for r, p in enumerate(kept))
    cuts = [3, 8, 0, 5, 7, 1, 8, 2]  # sampled tokens each row goes on from (8: the last one too, never fed)
    prompts = [PROMPTS[r // 2] + tokens[r, :cut].tolist() + [40 + r, 41, 42][: 1 + r % 3] for r, cut in enumerate(cuts)]
    second = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=1)

    def run(pasts: list[Past | None] | None) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        return sample_loop(model, prompts, second, stops={1}, pad_token_id=0, device=CPU, pasts=pasts)

    fresh = run(None)
    for pasts in (kept, [None if r == 4 else past for r, past in enumerate(kept)]):
        reused = run(list(pasts))
        assert reused[0].tolist() == fresh[0].tolist()
        torch.testing.assert_close(reused[1], fresh[1], atol=1e-5, rtol=0)
    wrong = [Past(p.ids, [k.flip(1) for k in p.keys], p.values) for p in kept]  # the kept keys are what it reads
    assert (run(list(wrong))[1] - fresh[1]).abs().max() > 1e-4  # (10x the tolerance above; a random model)


def test_finished_rows_leave_the_batch_and_the_rest_sample_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 sequences, 30 stop tokens of 96: most stop within a few steps, so the loop drops its finished rows (twice or
    more, with batches of 2 rows on allowed to shrink). Every row's sampled log-probs are still those of a full forward
    over its own prompt and response, and what it keeps of each row (dropped or not) continues that row as a fresh
    prompt pass does."""
    from lightning_rlhf.cpu import decode
    from lightning_rlhf.cpu.decode import Past

    model = llama_family()[0]
    stops = set(range(60, 90))
    params = SamplingParams(n=5, temperature=1.0, max_new_tokens=12, seed=0)
    kept: list[Past] = []
    calls: list[int] = []
    original = decode._Cache.keep_rows

    def counted(cache: decode._Cache, rows: torch.Tensor) -> None:
        calls.append(len(rows))
        original(cache, rows)

    monkeypatch.setattr(decode._Cache, "keep_rows", counted)
    monkeypatch.setattr(decode, "KEEP_ROWS_FROM", 2)
    torch.manual_seed(0)
    tokens, logprobs = sample_loop(model, PROMPTS, params, stops=stops, pad_token_id=0, device=CPU, keep=kept)
    assert len(calls) >= 2 and calls[0] <= 10, calls  # 20 rows -> at most 10 -> ...
    responses = []
    with torch.no_grad():
        for row in range(20):
            prompt, response = PROMPTS[row // 5], tokens[row].tolist()
            end = next((k for k, t in enumerate(response) if t in stops), len(response) - 1)
            response = response[: end + 1]
            responses.append(response)
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            expected = processed_logprobs(logits, temperature=1.0).gather(1, torch.tensor(response)[:, None])
            torch.testing.assert_close(logprobs[row, : len(response)], expected[:, 0], atol=2e-5, rtol=0)
    prompts = [PROMPTS[r // 5] + responses[r] + [40, 41] for r in range(20)]
    second = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, min_new_tokens=4, seed=1)
    torch.manual_seed(1)
    fresh = sample_loop(model, prompts, second, stops=set(), pad_token_id=0, device=CPU)
    torch.manual_seed(1)
    reused = sample_loop(model, prompts, second, stops=set(), pad_token_id=0, device=CPU, pasts=list(kept))
    assert reused[0].tolist() == fresh[0].tolist()
    torch.testing.assert_close(reused[1], fresh[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("decode", ["loop", "generate"])
def test_each_prompt_near_the_context_end_is_bounded_by_its_own_limit(decode: str) -> None:
    """Episodes near the end of the model's context (64 positions here) share a call with the others: each prompt's
    responses stop at its own limit, every sampled token's log-prob is the full forward's, and the call is accepted
    although the longest prompt plus the call's ``max_new_tokens`` would not fit."""
    model = llama_family()[0]
    engine = HFRolloutEngine(model, pad_token_id=0, eos_token_id=1, device=CPU, decode=decode, decode_loop=LOOP)
    prompts = [list(range(5, 60)), [11, 12, 13], list(range(20, 50))]  # 55, 3 and 30 tokens
    limits = [64 - 55, 20, 64 - 30]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate(prompts, params)
    out = engine.sample(prompts, params, limits=limits)
    for row, response in enumerate(out.responses):  # the third prompt: 20, the call's max_new_tokens
        bound = min(limits[row // 2], 20)
        assert len(response) == bound or (len(response) < bound and response[-1] == 1), (row, response)
    assert len(out.responses[0]) == 9 or len(out.responses[1]) == 9
    with torch.no_grad():
        for row, (response, lps) in enumerate(zip(out.responses, out.logprobs or [], strict=True)):
            prompt = prompts[row // 2]
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            expected = processed_logprobs(logits, temperature=1.0).gather(1, torch.tensor(response)[:, None])
            torch.testing.assert_close(torch.tensor(lps), expected[:, 0], atol=2e-5, rtol=0)


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_responses_are_reported_as_they_stop_while_the_others_decode(
    greedy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``on_done`` gets each stopped response (what the call then returns, index for index) during the decoding loop,
    before its last forward; a response cut by ``max_new_tokens`` (no stop) is only returned. With per-prompt
    limits and row dropping."""
    from lightning_rlhf.cpu import decode

    forwards = 0
    original = decode._forward

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal forwards
        forwards += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(decode, "_forward", counted)
    monkeypatch.setattr(decode, "KEEP_ROWS_FROM", 2)
    engine = HFRolloutEngine(
        llama_family()[0], pad_token_id=0, eos_token_id=1, device=CPU, decode="loop", decode_loop=LOOP
    )
    stops = tuple(range(60, 80))  # a fifth of the vocabulary: most rows stop within a few steps
    params = SamplingParams(n=4, temperature=0.0 if greedy else 1.0, max_new_tokens=12, stop_token_ids=stops, seed=2)
    got: dict[int, tuple[list[int], list[float], int]] = {}

    def on_done(index: int, response: list[int], logprobs: list[float]) -> None:
        assert index not in got
        got[index] = (response, logprobs, forwards)

    out = engine.sample(PROMPTS, params, limits=[12, 12, 6, 12], on_done=on_done)
    assert got and min(at for _, _, at in got.values()) < forwards  # reported while others still decoded
    for i, (response, lps, _) in got.items():
        assert out.responses[i] == response and out.logprobs is not None and out.logprobs[i] == lps
        assert response[-1] in stops or len(response) == 6 == len(out.responses[i])  # a stop, or prompt 2's limit
    for i in set(range(len(out.responses))) - set(got):  # never reported: cut by max_new_tokens
        assert len(out.responses[i]) == 12 and out.responses[i][-1] not in stops
