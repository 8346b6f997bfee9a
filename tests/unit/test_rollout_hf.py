"""The transformers rollout engine: sampling settings, stop handling, masks, weight hand-off."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rlhf.demo import addition_dataset
from lightning_rlhf.engines.rollout import HFRolloutEngine, RolloutEngine, SamplingParams, WeightSyncError


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
