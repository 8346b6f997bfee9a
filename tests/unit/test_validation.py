"""Validation metrics: mean@N and the unbiased pass@k against values worked out by hand, the settings' checks,
and the metrics a validation batch logs."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from lightning_rlhf import Batch, GRPOModule, RewardConfig, ValidationConfig
from lightning_rlhf.algorithms import mean_at_n, pass_at_k
from lightning_rlhf.demo import addition_reward


def test_mean_at_n_by_hand() -> None:
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.3]])
    assert mean_at_n(scores).tolist() == pytest.approx([0.5, 0.5, 0.075])
    assert mean_at_n(torch.tensor([[1], [0]])).dtype == torch.float32  # integer scores are averaged as floats


def test_pass_at_k_by_hand() -> None:
    # N = 4 samples per prompt, c passing: pass@k = 1 - C(4 - c, k) / C(4, k).
    passed = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert pass_at_k(passed, k=1).tolist() == pytest.approx([0.0, 1 / 4, 2 / 4, 1.0])  # c / N
    # c=1: 1 - C(3,2)/C(4,2) = 1 - 3/6; c=2: 1 - C(2,2)/C(4,2) = 1 - 1/6.
    assert pass_at_k(passed, k=2).tolist() == pytest.approx([0.0, 1 / 2, 5 / 6, 1.0])
    # c=1: 1 - C(3,3)/C(4,3) = 1 - 1/4; c=2: N - c = 2 < k = 3, so any 3 draws include a pass.
    assert pass_at_k(passed, k=3).tolist() == pytest.approx([0.0, 3 / 4, 1.0, 1.0])
    assert pass_at_k(passed, k=4).tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0])  # all N: any pass


def test_pass_at_k_matches_the_binomial_formula_for_large_n() -> None:
    n = 200
    counts = [0, 1, 7, 50, 199, 200]
    passed = torch.zeros(len(counts), n, dtype=torch.bool)
    for row, c in enumerate(counts):
        passed[row, torch.randperm(n, generator=torch.Generator().manual_seed(row))[:c]] = True  # order is irrelevant
    for k in (1, 10, 100):
        expected = [1.0 - math.comb(n - c, k) / math.comb(n, k) for c in counts]
        assert pass_at_k(passed, k=k).tolist() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match=r"k=5 must be in 1..N=4"):
        pass_at_k(torch.ones(2, 4, dtype=torch.bool), k=5)


def test_validation_config_checks() -> None:
    assert ValidationConfig().ks == (1,)  # greedy, one answer per prompt
    assert ValidationConfig(n=8, temperature=0.6).ks == (1, 8)
    assert ValidationConfig(n=8, temperature=0.6, pass_k=(4, 1, 4)).ks == (1, 4)
    with pytest.raises(ValueError, match=r"ValidationConfig.n=4 is invalid: expected 1 with temperature=0"):
        ValidationConfig(n=4)
    with pytest.raises(
        ValueError, match=r"ValidationConfig.pass_k=\(5,\) is invalid: expected None or values in 1..n=4"
    ):
        ValidationConfig(n=4, temperature=1.0, pass_k=(5,))
    with pytest.raises(ValueError, match=r"ValidationConfig.temperature=-1.0 is invalid"):
        ValidationConfig(temperature=-1.0)
    with pytest.raises(ValueError, match=r"ValidationConfig.pass_threshold=nan is invalid"):
        ValidationConfig(pass_threshold=float("nan"))


def test_validation_metrics_of_a_scored_rollout(tiny_model: str) -> None:
    module = GRPOModule(
        tiny_model,
        reward=addition_reward,
        validation=ValidationConfig(n=3, temperature=1.0, pass_k=(1, 2), pass_threshold=0.5),
    )
    # Two prompts x 3 samples, prompt-major as actor.generate lays them out.
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 0.8])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
    out = module.validation_metrics(Batch({"scores": scores, "response_mask": mask}))
    assert out["val/score/mean"] == pytest.approx(2.3 / 6)
    assert out["val/mean@3"] == pytest.approx((1.5 / 3 + 0.8 / 3) / 2)
    # Passing (score > 0.5): one sample of each prompt. pass@1 = 1/3; pass@2 = 1 - C(2,2)/C(3,2) = 2/3.
    assert out["val/pass@1"] == pytest.approx(1 / 3)
    assert out["val/pass@2"] == pytest.approx(2 / 3)
    assert out["val/response_length/mean"] == pytest.approx((2 + 1 + 3 + 1 + 2 + 1) / 6)
    assert set(out) == {"val/score/mean", "val/mean@3", "val/pass@1", "val/pass@2", "val/response_length/mean"}


def half_credit(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """Half of ``addition_reward``: a second component whose expected mean is known from the first."""
    return [0.5 * s for s in addition_reward(prompts, completions, answer)]


def test_validation_metrics_name_each_reward_component(tiny_model: str) -> None:
    module = GRPOModule(
        tiny_model,
        reward={"correct": addition_reward, "half": half_credit},
        reward_config=RewardConfig(weights={"half": 0.0}),
        validation=ValidationConfig(n=2, temperature=1.0),
    )
    # What RewardRole.score writes: the weighted sum in `scores`, each component's scores and failures beside it.
    correct, half = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.5, 0.0, 0.25, 0.5])
    rollout = Batch(
        {
            "scores": correct.clone(),
            "response_mask": torch.ones(4, 2, dtype=torch.long),
            "reward/correct": correct,
            "reward/correct/failed": torch.zeros(4, dtype=torch.bool),
            "reward/half": half,
            "reward/half/failed": torch.tensor([False, False, True, False]),
        }
    )
    out = module.validation_metrics(rollout)
    assert out["val/score/mean"] == pytest.approx(0.75)
    assert out["val/reward/correct/mean"] == pytest.approx(0.75)
    assert out["val/reward/half/mean"] == pytest.approx(1.25 / 4)  # unweighted: a weight-0 component is measured
    assert (out["val/reward/correct/failed"], out["val/reward/half/failed"]) == (0.0, 1.0)


def test_validation_between_steps_keeps_the_real_step_and_logs_each_reward(demo_model: str, tmp_path: Path) -> None:
    """The user's run (issue 31): periodic checkpoints, validation in between, two reward functions of which one
    weighs 0. The checkpoint after step 3 is named ``step=3`` (a logged ``step`` metric of the validation at
    step 2 used to name it ``step=2``), the summary does not call it "best", each validation row of metrics.csv
    sits at the step of the weights it measured and names each reward, and the bar counts steps."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_rlhf import PromptDataModule, RLHFProgressBar, RLHFStrategy, RolloutConfig, RunSummary
    from lightning_rlhf.demo import addition_dataset

    class Bar(L.Callback):  # the bar's description after each step (runs after the bar: later in the list)
        def __init__(self) -> None:
            self.seen: list[str] = []

        def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
            self.seen.append(str(trainer.progress_bar_callback.train_progress_bar.desc).removesuffix(": "))

    torch.set_num_threads(1)
    module = GRPOModule(
        demo_model,
        reward={"correct": addition_reward, "half": half_credit},
        reward_config=RewardConfig(timeout_s=None, weights={"half": 0.0}),
        rollout=RolloutConfig(n=2, max_new_tokens=4, seed=0),
        validation=ValidationConfig(n=4, temperature=1.0, before_train=True),
    )
    bar, summary = Bar(), RunSummary()
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3)  # no monitor, as in the recipes
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=RLHFStrategy("hf"), max_steps=3, val_check_interval=2,
        check_val_every_n_epoch=None, logger=CSVLogger(tmp_path, name="", version=""), log_every_n_steps=1,
        callbacks=[RLHFProgressBar(), bar, checkpoints, summary], enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    data = PromptDataModule(
        addition_dataset(num_prompts=8),  # 2 batches an epoch: step 3 is in the second epoch
        val=addition_dataset(num_prompts=4, seed=1),
        batch_size=4,
        val_batch_size=4,
        max_prompt_length=16,
    )
    trainer.fit(module, datamodule=data)

    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == ["epoch=1-step=3.ckpt"], saved
    meta = torch.load(tmp_path / "ckpt" / saved[0] / "meta.pt", weights_only=False)
    assert meta["global_step"] == 3
    assert "step" not in trainer.callback_metrics
    assert summary.text is not None
    assert f"checkpoints: {tmp_path / 'ckpt'} (latest: {tmp_path / 'ckpt' / saved[0]})" in summary.text
    assert "best" not in summary.text  # nothing monitored chose it
    assert bar.seen == ["step 1/3", "step 2/3", "step 3/3"]

    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert "step" in rows[0]  # the loggers' step column, not a metric
    val_rows = [r for r in rows if r["val/score/mean"]]
    assert [int(r["step"]) for r in val_rows] == [0, 2]  # before training, after step 2: the weights measured
    for r in val_rows:
        correct, half = float(r["val/reward/correct/mean"]), float(r["val/reward/half/mean"])
        assert float(r["val/score/mean"]) == pytest.approx(correct)  # weights 1 and 0
        assert half == pytest.approx(correct / 2)  # logged although it weighs nothing
        assert float(r["val/reward/correct/failed"]) == float(r["val/reward/half/failed"]) == 0.0
    assert float(val_rows[0]["val/reward/correct/mean"]) > 0.0  # the warm-started model solves some prompts
    train_rows = [r for r in rows if r["critic/score/mean"]]
    assert [int(r["step"]) for r in train_rows] == [0, 1, 2]
    assert all(r["reward/half/mean"] and not r["val/reward/half/mean"] for r in train_rows)
