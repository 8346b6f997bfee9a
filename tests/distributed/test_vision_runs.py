"""Vision-language runs through the whole strategy, 2 processes, a tiny Qwen2.5-VL: on a rollout pool one step
off-policy (the pool's engine server gets the images; the weights it receives verified by fingerprints under the
checkpoint's names), two-turn episodes with an image in each turn on the pool, and in the long tier colocated with
vLLM and streamed with partial rollouts on the pool. docs/vision.md."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_rlhf.demo.tiny_vlm import save_tiny_vlm
from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import failure_text, run_script

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]


POOL = ["--placement", json.dumps({"actor": [0], "reward": [0], "rollout": [1]}), "--max-staleness", "1"]


@pytest.mark.parametrize(
    ("family", "placement"),
    [("qwen2_5_vl", POOL), ("qwen2_5_vl", []), ("qwen2_5_vl", [*POOL, "--stream", "--partial-rollouts"])],
    ids=["qwen2.5-vl-rollout-pool", "qwen2.5-vl-colocated", "qwen2.5-vl-streamed-partial"],
)
def test_a_vlm_trains_with_vllm_rollouts(family: str, placement: list[str], tmp_path: Path) -> None:
    model = save_tiny_vlm(tmp_path / "model", model_type=family)
    out = tmp_path / "run"
    proc = run_script(
        "train.py", "--model", model, "--out", str(out), "--task", "vision", "--rollout", "vllm", "--steps", "3",
        *placement, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    result = json.loads((out / "result.json").read_text())
    assert result["global_step"] == 3
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    scores = [float(r["critic/score/mean"]) for r in rows if r.get("critic/score/mean")]
    verified = [float(r["perf/weight_verify_s"]) for r in rows if r.get("perf/weight_verify_s")]
    # one step off-policy: the first step only starts the pool's rollouts, so 2 of the 3 steps train
    assert len(scores) == (2 if placement else 3) and all(0.0 <= s <= 1.0 for s in scores), scores
    assert verified and any(v > 0 for v in verified), verified  # the hand-offs checked by the engine's fingerprints


def test_episodes_with_an_image_in_each_turn_train_on_a_rollout_pool(tmp_path: Path) -> None:
    """Two-turn episodes (CountTwiceEnvironment: an image in reset's messages, another in the observation), the
    warm-started tiny VLM answering each: the pool's engine server gets each turn's images through its request queue,
    the trainer the rows' images in order."""
    out = tmp_path / "run"
    proc = run_script(
        "train.py", "--model", "lightning-rlhf/tiny-vision", "--out", str(out), "--task", "vision-episodes",
        "--rollout", "vllm", "--steps", "3", *POOL, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    with open(out / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/turns/mean")]
    assert len(rows) == 2, rows  # one step off-policy: 2 of the 3 steps train
    for row in rows:
        assert float(row["rollout/turns/mean"]) == 2.0 and float(row["rollout/truncated"]) == 0.0, row
        assert float(row["rollout/observation_tokens/mean"]) > 4, row  # the observation's text and 4 image tokens
        assert 0.0 <= float(row["critic/score/mean"]) <= 1.0, row
