"""LoRA on 2 processes: the `grpo_lora` recipe through the command line (adapters, the KL against the base with its
adapters off, a sharded checkpoint of the adapters without the frozen base), resumed to the same metrics as the
uninterrupted run, exported as an adapter folder that peft loads and as a merged folder, and refused when resumed into
a full-weight run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import failure_text, run_cli

pytestmark = pytest.mark.slow


def fit(out: Path, model: str, steps: int, *extra: str) -> None:
    proc = run_cli(
        "fit", "--config", "recipes/grpo_lora.yaml", "--model.actor", model,
        "--trainer.devices", "2", "--trainer.max_steps", str(steps), "--trainer.strategy.rollout", "hf",
        "--data.batch_size", "8", "--model.actor_optim.warmup_steps", "0", "--trainer.logger.save_dir", str(out),
        "--model.actor_optim.schedule", "constant",  # a decay would depend on max_steps, which the runs differ in
        *extra,
        module=True,
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)


def metrics(out: Path) -> list[dict[str, str]]:
    (found,) = out.glob("grpo_lora/version_0/metrics.csv")
    return [r for r in csv.DictReader(found.open()) if r.get("critic/score/mean")]


@pytest.fixture(scope="module")
def runs(demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """4 steps straight; 2 steps with a checkpoint; the resume to step 4; the checkpoint exported both ways."""
    root = tmp_path_factory.mktemp("lora")
    fit(root / "straight", demo_model, 4)
    ckpt_args = [
        "--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.dirpath", str(root / "ckpt"), "--trainer.callbacks.every_n_train_steps", "2",
    ]  # fmt: skip
    fit(root / "first", demo_model, 2, *ckpt_args)
    (ckpt,) = (root / "ckpt").iterdir()
    fit(root / "second", demo_model, 4, "--ckpt_path", str(ckpt))
    for name, flags in (("adapter", []), ("merged", ["--merge", "true"])):
        proc = run_cli("export", str(ckpt), str(root / name), *flags)
        assert proc.returncode == 0, failure_text(proc)
    return {"root": root, "ckpt": ckpt}


def test_lora_resumes_like_the_uninterrupted_run_with_the_base_as_reference(runs: dict[str, Path]) -> None:
    straight, resumed = metrics(runs["root"] / "straight"), metrics(runs["root"] / "second")
    assert [int(r["step"]) for r in resumed] == [2, 3]
    for a, b in zip(straight[2:], resumed, strict=True):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/lr"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-7), key
    for row in straight:
        assert float(row["training/rollout_probs_diff_max"]) < 1e-5  # the merged hand-off: engine == trainer
    assert float(straight[-1]["actor/kl_loss"]) > 0  # the reference (adapters off) is not the adapted actor


def test_every_ranks_memory_peak_and_the_bytes_the_engine_takes_are_logged(
    runs: dict[str, Path], demo_model: str
) -> None:
    rows = metrics(runs["root"] / "straight")
    weights = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(demo_model).parameters()) * 4
    for row in rows:
        peaks = [float(row[f"perf/cpu_memory_peak_gb/rank{rank}"]) for rank in (0, 1)]
        assert float(row["perf/cpu_memory_peak_gb"]) == max(peaks) and min(peaks) > 0.1, peaks
        assert float(row["perf/cpu_memory_peak_gb/rank0"]) >= float(row["perf/cpu_memory_used_gb"]) * 0.99
    assert float(rows[0]["perf/weight_sync_bytes"]) == 0  # the engine was built from the loaded weights
    for row in rows[1:]:  # after each update the transformers engine takes the whole merged model (float32),
        assert float(row["perf/weight_sync_bytes"]) == weights  # while rank 0 gathered only rank 1's shards
        assert 0 < float(row["perf/weight_sync_gathered_bytes"]) < 0.75 * weights


def test_the_checkpoint_holds_the_adapters_and_their_optimizer_state_not_the_base(runs: dict[str, Path]) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(str(runs["ckpt"])).read_metadata().state_dict_metadata)
    actor = [key for key in keys if key.startswith("state_dict.actor.")]
    assert actor and all(".lora_" in key for key in actor), actor[:4]  # no base weight: the run reloads it
    moments = [key for key in keys if key.startswith("optimizer_0.state.") and key.endswith(".exp_avg")]
    assert moments and all(".lora_" in key for key in moments)
    assert len(moments) == len(actor)  # Adam's moments for each adapter, and only them


def test_the_checkpoint_exports_as_peft_adapters_and_as_the_merged_model(
    runs: dict[str, Path], demo_model: str
) -> None:
    from peft import PeftModel

    root = runs["root"]
    adapter = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (8, 16)
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_model), root / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(root / "merged")
    base = AutoModelForCausalLM.from_pretrained(demo_model)
    ids = torch.tensor([[5, 17, 9, 30, 6], [7, 8, 9, 10, 11]])
    with torch.no_grad():
        adapted, plain, served = with_peft(ids).logits, base(ids).logits, merged(ids).logits
    assert (adapted - plain).abs().max() > 1e-4  # two steps moved the adapters
    torch.testing.assert_close(served, adapted, rtol=1e-5, atol=1e-5)  # the merge is the adapted model


def test_a_lora_checkpoint_does_not_resume_a_full_weight_run(runs: dict[str, Path], demo_model: str) -> None:
    proc = run_cli(
        "fit", "--config", "recipes/demo.yaml", "--model.actor", demo_model, "--trainer.devices", "2",
        "--trainer.max_steps", "4", "--trainer.strategy.rollout", "hf", "--ckpt_path", str(runs["ckpt"]),
        "--trainer.logger.save_dir", str(runs["root"] / "mixed"), module=True,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "was saved by a run that trained LoRA adapters" in proc.stderr
    assert "HINT: resume with the lora setting" in proc.stderr
