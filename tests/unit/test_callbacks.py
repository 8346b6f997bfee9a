"""The run-summary, plot and sample callbacks on recorded values (no training: a Trainer that never fits)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_rlhf.batch import Batch
from lightning_rlhf.callbacks import MetricPlots, RunSummary, run_folder
from lightning_rlhf.callbacks.history import first_last
from lightning_rlhf.callbacks.samples import sample_rows


def trainer_in(tmp_path: Path, callbacks: list[L.Callback]) -> L.Trainer:
    logger = CSVLogger(str(tmp_path), name="run", version=0)
    return L.Trainer(accelerator="cpu", devices=1, logger=logger, callbacks=callbacks, enable_progress_bar=False)


def test_first_last_averages_a_tenth_at_each_end() -> None:
    values = [float(i) for i in range(20)]
    assert first_last(values) == (0.5, 18.5)
    assert first_last([3.0]) == (3.0, 3.0)
    with pytest.raises(ValueError, match="no values"):
        first_last([])


def test_sample_rows_spread_over_prompts() -> None:
    rollout = Batch(
        {"scores": torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])},
        {"prompt": [f"p{i // 2}" for i in range(8)], "completion": [f"c{i}" for i in range(8)]},
    )
    rows = sample_rows(rollout, 4, step=7)
    assert [r["prompt"] for r in rows] == ["p0", "p1", "p2", "p3"]  # one sample of each group of 2
    assert rows[1] == {"step": 7, "prompt": "p1", "completion": "c2", "reward": 0.0}
    assert len(sample_rows(rollout, 20, step=0)) == 8
    bare = sample_rows(Batch({"scores": torch.ones(2)}), 1, step=0)
    assert bare == [{"step": 0, "prompt": "", "completion": "", "reward": 1.0}]


def test_metric_plots_draws_the_logged_panels(tmp_path: Path) -> None:
    plots = MetricPlots()
    plots.history = {
        "critic/score/mean": [(s, s / 30) for s in range(30)],
        "response_length/mean": [(s, 5.0) for s in range(30)],
        "actor/reward_kl_penalty": [(s, 0.01 * s) for s in range(30)],  # PPO's KL: the kl panel's 2nd choice
    }
    written = plots.draw(str(tmp_path))
    assert set(written) == {"reward", "response_length", "kl"}  # no entropy logged: no entropy.png
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "kl.png").shape[2] in (3, 4)
    assert not (tmp_path / "entropy.png").exists()


def test_run_summary_text(tmp_path: Path) -> None:
    class Exported(L.Callback):
        last_export = "/models/final"

    summary = RunSummary()
    trainer = trainer_in(tmp_path, [summary, Exported()])
    summary.history = {
        "critic/score/mean": [(s, 0.0 if s < 10 else 1.0) for s in range(100)],
        "perf/throughput": [(s, 100.0) for s in range(100)],
        "timing_s/step": [(s, 0.5) for s in range(100)],
    }
    text = summary.summarize(trainer, seconds=61.0)
    assert "reward (critic/score/mean): 0.000 (first 10% of steps) -> 1.000 (last 10%)" in text
    assert "steps: 100 in 61s (0.50 s/step)" in text
    assert "throughput: 100 tokens/s per rank, 100 tokens/s over 1 rank (perf/throughput, mean)" in text
    assert f"run folder: {tmp_path / 'run' / 'version_0'}" in text
    assert run_folder(trainer) == str(tmp_path / "run" / "version_0")
    assert "exported model: /models/final" in text
    assert "checkpoints" not in text  # no ModelCheckpoint saved anything

    dapo = RunSummary()
    dapo.history = {"dynamic_sampling/raw_score/mean": [(0, 0.25)], "critic/score/mean": [(0, 0.5)]}
    assert "reward (dynamic_sampling/raw_score/mean): 0.250" in dapo.summarize(trainer, seconds=None)


def test_history_survives_a_checkpoint() -> None:
    plots = MetricPlots()
    plots.history = {"actor/entropy": [(0, 1.5), (1, 1.25)]}
    again = MetricPlots()
    again.load_state_dict(plots.state_dict())
    assert again.history == plots.history


def test_bad_settings_name_the_fix() -> None:
    with pytest.raises(ValueError, match="every_n_steps=0"):
        MetricPlots(every_n_steps=0)
    with pytest.raises(ValueError, match=r"fraction=0\.9"):
        RunSummary(fraction=0.9)
