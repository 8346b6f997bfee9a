"""SFTModule over 2 processes (gloo, launched as a subprocess): the loss falls, validation and export work (also the
export of the best validation, a collective on every rank), and a run resumed from a checkpoint logs the same metrics
as an uninterrupted one."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.conftest import failure_text, run_script


def read_rows(out: Path, key: str) -> list[dict[str, str]]:
    with open(out / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get(key)]


@pytest.fixture(scope="module")
def raw_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lightning_rlhf.demo import save_tiny

    return save_tiny(str(tmp_path_factory.mktemp("raw") / "model"), seed=0)


def test_two_process_sft_resumes_like_the_uninterrupted_run(raw_model: str, tmp_path: Path) -> None:
    straight, first, second, ckpt = tmp_path / "straight", tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    common = ["--model", raw_model, "--devices", "2"]
    proc = run_script("sft_train.py", *common, "--out", str(straight), "--steps", "4", "--monitor", "val/loss")
    assert proc.returncode == 0, failure_text(proc)
    assert "(step 4, the best val/loss (min) of 2 validations" in proc.stdout + proc.stderr, failure_text(proc)
    proc = run_script("sft_train.py", *common, "--out", str(first), "--steps", "2", "--save-ckpt", str(ckpt))
    assert proc.returncode == 0, failure_text(proc)
    proc = run_script("sft_train.py", *common, "--out", str(second), "--steps", "4", "--resume", str(ckpt))
    assert proc.returncode == 0, failure_text(proc)

    full = read_rows(straight, "sft/loss")
    assert [int(r["step"]) for r in full] == [0, 1, 2, 3]
    assert float(full[-1]["sft/loss"]) < float(full[0]["sft/loss"]) - 0.5  # it learns
    assert all(float(r["sft/tokens"]) > 8 for r in full)  # loss tokens of the whole batch, both ranks
    val = read_rows(straight, "val/loss")
    assert len(val) == 2 and float(val[1]["val/loss"]) < float(val[0]["val/loss"])  # after steps 2 and 4
    resumed = read_rows(second, "sft/loss")
    assert [int(r["step"]) for r in resumed] == [2, 3]
    for a, b in zip(full[2:], resumed, strict=True):
        for key in ("sft/loss", "sft/grad_norm", "sft/lr", "sft/tokens"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-7), key
    assert float(read_rows(second, "val/loss")[-1]["val/loss"]) == pytest.approx(float(val[-1]["val/loss"]), rel=1e-5)
    end_full = json.loads((straight / "result.json").read_text())["param_checksum"]
    end_resumed = json.loads((second / "result.json").read_text())["param_checksum"]
    assert end_full == pytest.approx(end_resumed, rel=1e-6)
    model = AutoModelForCausalLM.from_pretrained(straight / "actor")  # ExportActor wrote a loadable folder
    assert model.config.vocab_size > 0
    # The best validation (step 4, the last) was exported on both ranks: its weights are the final ones.
    exported = float(next(model.parameters()).detach().double().sum())
    assert exported == pytest.approx(end_full, rel=1e-9)
