"""What a user sees while a run trains (2 ranks over gloo): progress-bar metrics, the end-of-run summary, metric
plots, sample rollouts in a jsonl file and in a wandb table (offline)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from tests.conftest import failure_text, run_script

pytestmark = pytest.mark.slow


def test_progress_bar_summary_plots_and_samples(demo_model: str, tmp_path: Path) -> None:
    steps, every, per_write = 4, 2, 3
    proc = run_script(
        "train.py",
        *("--model", demo_model, "--out", str(tmp_path), "--devices", "2", "--steps", str(steps)),
        *("--kl-coef", "0.01", "--wandb", "--checkpoint-callback", "--ux-callbacks"),
        *("--samples-every", str(every)),
    )
    assert proc.returncode == 0, failure_text(proc)
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(steps))

    # Progress bar: log_step registers reward, response length and seconds per step; the bar shortens the names.
    result = json.loads((tmp_path / "result.json").read_text())
    assert {"critic/score/mean", "response_length/mean", "timing_s/step"} <= set(result["progress_bar_metrics"])
    assert {"reward", "len", "s/step"} <= set(result["progress_bar_items"])
    assert "reward=" in proc.stdout and "s/step=" in proc.stdout  # tqdm drew it (Lightning's bar writes stdout)

    # Summary: first/last 10% of steps (one step each here) as in metrics.csv, the run and checkpoint folders.
    scores = [float(r["critic/score/mean"]) for r in rows]
    match = re.search(r"reward \(critic/score/mean\): (\S+) \(first 10% of steps\) -> (\S+) \(last 10%\)", proc.stdout)
    assert match, proc.stdout[-2000:]
    assert (match[1], match[2]) == (f"{scores[0]:.3f}", f"{scores[-1]:.3f}")
    assert f"steps: {steps} in " in proc.stdout
    assert "tokens/s per rank" in proc.stdout
    assert f"run folder: {tmp_path}" in proc.stdout
    assert f"checkpoints: {tmp_path / 'ckpt'}" in proc.stdout

    # Plots: valid PNG images of reward, response length, KL (actor/kl_loss: kl_coef > 0) and entropy.
    import matplotlib.image

    for name in ("reward", "response_length", "kl", "entropy"):
        image = matplotlib.image.imread(tmp_path / f"{name}.png")
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name

    # Samples: after steps 1 and 3 (every 2nd step, as log_every_n_steps counts), 3 rollouts each.
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * per_write + [3] * per_write
    for s in samples:
        assert set(s) == {"step", "prompt", "completion", "reward"}
        assert re.fullmatch(r"\d\+\d=", s["prompt"]) and isinstance(s["completion"], str)
        assert s["reward"] in (0.0, 1.0)

    # wandb (offline): the same rows as a table in the run's media files.
    tables = sorted((tmp_path / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 2, list((tmp_path / "wandb").rglob("*"))
    logged = [json.loads(t.read_text()) for t in tables]
    assert all(t["columns"] == ["step", "prompt", "completion", "reward"] for t in logged)
    table_rows = sorted((row for t in logged for row in t["data"]), key=lambda r: (r[0], r[1]))
    expected = sorted(
        ([s["step"], s["prompt"], s["completion"], s["reward"]] for s in samples), key=lambda r: (r[0], r[1])
    )
    assert table_rows == expected
