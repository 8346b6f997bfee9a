"""Validation on 2 ranks (gloo), launched as subprocesses: routed through the controller like a training step,
at the Trainer's interval and before training when asked, and invisible to the training run itself.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.conftest import failure_text, run_script

pytestmark = pytest.mark.slow

TRAINING_METRICS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")


def read_metrics(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_validation_at_the_interval_before_training_and_on_resume_leaves_training_unchanged(
    demo_model: str, tmp_path: Path
) -> None:
    common = ["--model", demo_model, "--devices", "2", "--prompts", "8", "--n", "4"]
    # 5 validation prompts in batches of 4: the last batch (1 prompt) is padded to split over the 2 ranks.
    val = ["--val-every", "2", "--val-before-train", "--val-prompts", "5", "--val-batch-size", "4", "--val-n", "4"]
    plain, first, resumed, ckpt = tmp_path / "plain", tmp_path / "first", tmp_path / "resumed", tmp_path / "ckpt"
    runs = [
        (plain, ["--steps", "4"]),
        (first, ["--steps", "2", *val, "--save-ckpt", str(ckpt)]),
        (resumed, ["--steps", "4", *val, "--resume", str(ckpt)]),
    ]
    for out, extra in runs:
        proc = run_script("train.py", *common, "--out", str(out), *extra)
        assert proc.returncode == 0, failure_text(proc)

    val_rows = {
        name: [r for r in read_metrics(out) if r["val/score/mean"]] for name, out in (("a", first), ("b", resumed))
    }
    # Before training (step 0), then after every 2 RL steps, at the step of the weights measured; the resumed run
    # validates its restored weights first (step 2 again). Lightning's sanity check (2 batches before each run)
    # takes the same path but logs nothing.
    assert [int(r["step"]) for r in val_rows["a"]] == [0, 2]
    assert [int(r["step"]) for r in val_rows["b"]] == [2, 4]
    for r in val_rows["a"] + val_rows["b"]:
        score, mean4, pass1, pass4 = (float(r[k]) for k in ("val/score/mean", "val/mean@4", "val/pass@1", "val/pass@4"))
        assert 0.0 <= pass1 <= pass4 <= 1.0
        assert mean4 == pytest.approx(score)  # 4 samples of every prompt
        assert pass1 == pytest.approx(score)  # 0/1 rewards: pass@1 is the mean score
        assert 1.0 <= float(r["val/response_length/mean"]) <= 5.0
    assert float(val_rows["a"][0]["val/pass@4"]) > 0.0  # the warm-started model solves some prompts
    # Same weights, same validation seeds: the restored run's first validation repeats the last one, all of it but
    # Lightning's epoch count (a run stopped by max_steps counts its interrupted epoch as done, so the resumed run's
    # rows, its training rows too, say epoch 1).
    assert {**val_rows["a"][1], "epoch": "-"} == {**val_rows["b"][0], "epoch": "-"}
    assert float(val_rows["a"][1]["val/reward/addition_reward/mean"]) == float(val_rows["a"][1]["val/score/mean"])

    # The training run is the run without validation, bit for bit: validation drew its own sampling seeds and
    # left the weights, the optimizer and the training loader's position alone.
    trained = [r for out in (first, resumed) for r in read_metrics(out) if r["critic/score/mean"]]
    reference = read_metrics(plain)
    assert [int(r["step"]) for r in trained] == [int(r["step"]) for r in reference] == [0, 1, 2, 3]
    for a, b in zip(trained, reference, strict=True):
        for key in TRAINING_METRICS:
            assert float(a[key]) == float(b[key]), (a["step"], key)
    end = [json.loads((out / "result.json").read_text())["param_checksum"] for out in (resumed, plain)]
    assert end[0] == end[1]
