"""The run-summary, plot and sample callbacks on recorded values (a Trainer that never fits); the progress bar over
a few steps of a plain module, and the command line's default bar."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_rlhf.batch import Batch
from lightning_rlhf.callbacks import MetricPlots, RLHFProgressBar, RunSummary, run_folder
from lightning_rlhf.callbacks.history import first_last
from lightning_rlhf.callbacks.samples import conversation_text, sample_rows
from lightning_rlhf.callbacks.summary import checkpoint_line

ROOT = Path(__file__).resolve().parents[2]


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


def test_sample_rows_of_episodes_carry_the_whole_conversation() -> None:
    chats = [
        [
            {"role": "user", "content": f"{i}+1="},
            {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
            {"role": "tool", "name": "calculator", "content": str(i + 1)},
            {"role": "assistant", "content": str(i + 1)},
        ]
        for i in range(2)
    ]
    rollout = Batch(
        {"scores": torch.tensor([1.0, 0.0]), "turns": torch.tensor([2, 2]), "tool_calls": torch.tensor([1, 1])},
        {"prompt": ["0+1=", "1+1="], "completion": ["x", "y"], "episode": chats},
    )
    rows = sample_rows(rollout, 2, step=3)
    assert rows[1]["episode"] == chats[1] and rows[1]["turns"] == 2 and rows[1]["tool_calls"] == 1
    assert json.loads(json.dumps(rows[1]))["episode"][2]["content"] == "2"  # a jsonl line holds it as it is
    assert conversation_text(chats[0]).splitlines() == [
        "[user] 0+1=",
        '[assistant] <tool_call>{"name": "calculator"}</tool_call>',
        "[tool calculator] 1",
        "[assistant] 1",
    ]


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


def test_summary_calls_a_checkpoint_best_only_when_a_monitor_chose_it(tmp_path: Path) -> None:
    plain = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=50)  # the recipes' checkpoints: no monitor
    assert checkpoint_line(plain) is None  # nothing saved yet
    plain.best_model_path = str(tmp_path / "ckpt" / "epoch=16-step=150.ckpt")  # Lightning's newest, unmonitored
    assert checkpoint_line(plain) == f"  checkpoints: {tmp_path / 'ckpt'} (latest: {plain.best_model_path})"

    monitored = ModelCheckpoint(tmp_path / "ckpt", monitor="val/score/mean", mode="max", save_last=True)
    monitored.best_model_path = str(tmp_path / "ckpt" / "epoch=5-step=50.ckpt")
    monitored.best_model_score = torch.tensor(0.875)
    monitored.last_model_path = str(tmp_path / "ckpt" / "last.ckpt")
    assert checkpoint_line(monitored) == (
        f"  checkpoints: {tmp_path / 'ckpt'} (best (val/score/mean=0.875): {monitored.best_model_path}, "
        f"last: {monitored.last_model_path})"
    )
    summary = RunSummary()
    trainer = trainer_in(tmp_path, [summary, monitored])
    assert checkpoint_line(monitored) in summary.summarize(trainer, seconds=None)
    assert checkpoint_line(object()) is None  # not a ModelCheckpoint


class Steps(L.LightningModule):
    """One optimizer step per batch, 3 batches an epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.ones(3, 1), batch_size=1)


class BarText(L.Callback):
    """The training bar's description and count after each step (listed after the bar, so it runs after it)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int | None]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        bar = trainer.progress_bar_callback.train_progress_bar  # type: ignore[union-attr]
        self.seen.append((str(bar.desc).removesuffix(": "), bar.n, bar.total))


@pytest.mark.parametrize(
    ("limits", "total"),
    [({"max_steps": 7}, 7), ({"max_epochs": 2}, 6), ({"max_steps": 4, "max_epochs": 5}, 4)],
    ids=["max_steps", "max_epochs", "both"],
)
def test_progress_bar_counts_steps_over_epochs(tmp_path: Path, limits: dict[str, int], total: int) -> None:
    """A max_steps run read `Epoch 37/-2` (Lightning's rich bar: max_epochs is -1) or `Epoch 2` with a bar that
    restarts each epoch (its tqdm bar); the RL bar is one bar of steps for the run, over epochs of 3 steps."""
    text = BarText()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, callbacks=[RLHFProgressBar(), text], enable_checkpointing=False,
        enable_model_summary=False, **limits,
    )  # fmt: skip
    trainer.fit(Steps())
    assert text.seen == [(f"step {n}/{total}", n, total) for n in range(1, total + 1)]
    assert not any("Epoch" in desc or "-" in desc for desc, _, _ in text.seen)


@pytest.mark.parametrize(
    ("extra", "bar"),
    [
        ([], "RLHFProgressBar"),  # no bar listed: the step bar, not Lightning's epoch bar
        (["--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar"], "RichProgressBar"),  # the user's
        (["--trainer.enable_progress_bar", "false"], None),
        (["--config", str(ROOT / "recipes" / "demo.yaml")], "RLHFProgressBar"),  # listed in the recipe: once
    ],
    ids=["default", "listed", "off", "recipe"],
)
def test_cli_uses_the_step_bar_unless_the_config_chooses(tiny_model: str, extra: list[str], bar: str | None) -> None:
    from lightning.pytorch.callbacks import ProgressBar

    from lightning_rlhf.cli import RLHFCLI

    data = ["--data.train", str(ROOT / "recipes" / "data" / "addition.jsonl")]
    model = ["--model", "lightning_rlhf.GRPOModule", "--model.reward", "lightning_rlhf.demo.addition_reward"]
    cli = RLHFCLI([*extra, *data, *model, "--model.actor", tiny_model], run=False)
    bars = [type(c).__name__ for c in cli.trainer.callbacks if isinstance(c, ProgressBar)]
    assert bars == ([bar] if bar else [])


def test_progress_bar_of_a_resumed_run_starts_where_it_stopped(tmp_path: Path) -> None:
    def trainer(steps: int, text: BarText) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", devices=1, logger=False, callbacks=[RLHFProgressBar(), text],
            enable_checkpointing=False, enable_model_summary=False, max_steps=steps,
        )  # fmt: skip

    first = trainer(4, BarText())
    first.fit(Steps())
    first.save_checkpoint(tmp_path / "4.ckpt")
    text = BarText()
    trainer(7, text).fit(Steps(), ckpt_path=tmp_path / "4.ckpt")
    assert text.seen == [("step 5/7", 5, 7), ("step 6/7", 6, 7), ("step 7/7", 7, 7)]
