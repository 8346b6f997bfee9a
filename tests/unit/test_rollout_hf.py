"""The transformers rollout engine: sampling settings, stop handling, masks, weight hand-off."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from lightning_rlhf.config import RolloutConfig, VLLMConfig
from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.demo import addition_dataset
from lightning_rlhf.engines.rollout import (
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
    WeightSyncError,
    make_rollout_engine,
)

CPU = torch.device("cpu")


def engine_for(path: str) -> tuple[HFRolloutEngine, object, torch.nn.Module]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    eng = HFRolloutEngine(
        model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device=torch.device("cpu")
    )
    return eng, tok, model


def test_n_samples_per_prompt_cut_at_eos_and_seeded(demo_model: str) -> None:
    eng, tok, _ = engine_for(demo_model)
    assert isinstance(eng, RolloutEngine)
    prompts = [tok("3+4=")["input_ids"], tok("1+1=")["input_ids"]]
    params = SamplingParams(n=5, max_new_tokens=6, seed=3)
    out = eng.generate(prompts, params)
    assert len(out.responses) == 10
    for r in out.responses:
        assert 1 <= len(r) <= 6
        if tok.eos_token_id in r:
            assert r.index(tok.eos_token_id) == len(r) - 1  # nothing after the stop token
    assert eng.generate(prompts, params).responses == out.responses  # same seed, same samples
    data = addition_dataset()
    greedy = eng.generate(
        [tok(p)["input_ids"] for p in data["prompt"]], SamplingParams(n=1, max_new_tokens=6, greedy=True)
    )
    answers = [tok.decode(r, skip_special_tokens=True) for r in greedy.responses]
    assert sum(a == b for a, b in zip(answers, data["answer"], strict=True)) >= 40  # the warm start knows most sums


def test_stop_tokens_and_max_new_tokens(demo_model: str) -> None:
    eng, tok, _ = engine_for(demo_model)
    prompt = [tok("3+4=")["input_ids"]]
    first = eng.generate(prompt, SamplingParams(n=1, max_new_tokens=1, greedy=True)).responses[0][0]
    assert first != tok.eos_token_id  # a digit, not EOS: the stop below comes from stop_token_ids
    out = eng.generate(prompt, SamplingParams(n=1, max_new_tokens=6, greedy=True, stop_token_ids=(first,)))
    assert out.responses[0] == [first]
    eos = tok.eos_token_id
    out = eng.generate(prompt, SamplingParams(n=3, max_new_tokens=1, seed=0))
    assert all(len(r) == 1 for r in out.responses)
    assert eos is not None


def test_min_new_tokens_suppresses_the_stop_until_then(demo_model: str) -> None:
    eng, tok, _ = engine_for(demo_model)
    prompts = [tok("3+4=")["input_ids"], tok("1+1=")["input_ids"]]
    free = eng.generate(prompts, SamplingParams(n=4, max_new_tokens=12, seed=0)).responses
    assert min(len(r) for r in free) < 12  # the warm start answers in a few tokens and stops
    fixed = eng.generate(prompts, SamplingParams(n=4, max_new_tokens=12, min_new_tokens=12, seed=0))
    assert [len(r) for r in fixed.responses] == [12] * 8
    assert all(tok.eos_token_id not in r for r in fixed.responses)


def test_load_weights_changes_generation_and_rejects_unknown_names(demo_model: str, tiny_model: str) -> None:
    eng, tok, _ = engine_for(demo_model)
    prompt = [tok("3+4=")["input_ids"]]
    greedy = SamplingParams(n=1, max_new_tokens=4, greedy=True)
    before = eng.generate(prompt, greedy).responses
    other = AutoModelForCausalLM.from_pretrained(tiny_model)  # random weights, same architecture
    received = eng.load_weights(other.named_parameters())
    assert received == sum(p.numel() * 4 for p in other.parameters())
    assert eng.generate(prompt, greedy).responses != before
    eng.load_weights(AutoModelForCausalLM.from_pretrained(demo_model).named_parameters())
    assert eng.generate(prompt, greedy).responses == before
    try:
        eng.load_weights([("not.a.param", torch.zeros(1))])
    except WeightSyncError as err:
        assert "not.a.param" in str(err)
    else:
        raise AssertionError("unknown parameter name was accepted")


def test_generation_config_eos_ids_end_a_response(demo_model: str, tmp_path: Path) -> None:
    """A checkpoint whose ``generation_config.json`` lists more EOS ids than its tokenizer's (Qwen2.5-Instruct:
    ``<|im_end|>`` and ``<|endoftext|>``) ends responses at each of them, as transformers' ``generate`` and vLLM
    do, and such a response does not count as truncated."""
    from transformers import GenerationConfig

    from lightning_rlhf.batch import Batch
    from lightning_rlhf.config import RolloutConfig
    from lightning_rlhf.engines.hybrid import sample_rollout
    from lightning_rlhf.engines.rollout.base import generation_eos_ids

    eng, tok, _ = engine_for(demo_model)
    ids = torch.tensor([tok("3+4=")["input_ids"]])
    batch = Batch({"prompts": ids, "prompt_mask": torch.ones_like(ids)})
    cfg = RolloutConfig(n=1, max_new_tokens=6, temperature=1.0)
    plain = sample_rollout(eng, batch, cfg, tok, greedy=True, model_path=demo_model)
    answer = plain["responses"][0][plain["response_mask"][0].bool()].tolist()
    assert len(answer) >= 2 and answer[-1] == tok.eos_token_id  # a digit, then EOS

    model = tmp_path / "two_eos"
    shutil.copytree(demo_model, model)
    gen = GenerationConfig.from_pretrained(model)
    gen.eos_token_id = [tok.eos_token_id, answer[0]]  # the answer's first token ends a response too
    gen.save_pretrained(model)
    assert generation_eos_ids(str(model)) == tuple(sorted({tok.eos_token_id, answer[0]}))
    cut = sample_rollout(eng, batch, cfg, tok, greedy=True, model_path=str(model))
    assert cut["responses"][0][cut["response_mask"][0].bool()].tolist() == [answer[0]]
    assert not bool(cut["response_truncated"][0])
    assert generation_eos_ids(str(tmp_path / "no_such_model")) == ()


def test_decode_setting_picks_the_loop_or_generate(demo_model: str) -> None:
    """``RolloutConfig.decode`` reaches the engine: "auto" runs the CPU layer's loop on a CPU only (a GPU engine takes
    ``generate``), "loop" forces the loop, "generate" never uses it; both paths sample valid responses."""
    tok = AutoTokenizer.from_pretrained(demo_model)
    model = AutoModelForCausalLM.from_pretrained(demo_model)
    prompts = [tok(p)["input_ids"] for p in ("3+4=", "12+9=")]
    params = SamplingParams(n=2, max_new_tokens=4, min_new_tokens=4, seed=0)
    engines = {}
    for decode in ("auto", "loop", "generate"):
        engine = make_rollout_engine(
            "hf", path=demo_model, model=model, tokenizer=tok, rollout=RolloutConfig(decode=decode),
            vllm=VLLMConfig(), device=torch.device("cpu"), dtype=None, max_model_len=0, layer=CPULayer(),
        )  # fmt: skip
        assert isinstance(engine, HFRolloutEngine) and engine.decode == decode
        engines[decode] = engine
    assert engines["auto"].decodes_with_loop(prompts, params) and engines["loop"].decodes_with_loop(prompts, params)
    assert not engines["generate"].decodes_with_loop(prompts, params)
    for decode, engine in engines.items():
        out = engine.generate(prompts, params)
        assert [len(r) for r in out.responses] == [4] * 4, decode
    # what the engine decides on a GPU (only the device's type is read): "auto" takes generate, "loop" stays
    engines["auto"].device = engines["loop"].device = torch.device("cuda")
    assert not engines["auto"].decodes_with_loop(prompts, params)
    assert engines["loop"].decodes_with_loop(prompts, params)


def test_decode_loop_refuses_a_model_it_does_not_support() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=4, n_positions=64)).eval()
    with pytest.raises(ValueError, match=r"RolloutConfig.decode='loop' .*model_type 'gpt2'.*HINT: "):
        HFRolloutEngine(
            gpt2, pad_token_id=0, eos_token_id=1, device=CPU, decode="loop", decode_loop=CPULayer().decode_loop()
        )
    engine = HFRolloutEngine(
        gpt2, pad_token_id=0, eos_token_id=1, device=CPU, decode_loop=CPULayer().decode_loop()
    )  # auto: generate
    assert not engine.decodes_with_loop([[5, 6]], SamplingParams(n=1, max_new_tokens=2))
