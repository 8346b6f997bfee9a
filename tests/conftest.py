"""Shared fixtures: tiny local models (nothing is downloaded) and a runner for multi-process scripts."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"

#: What Lightning writes into ``os.environ`` when it starts a process group in this process.
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    """A test that runs ``trainer.fit`` in the pytest process (one rank) leaves Lightning's process group, whose
    store listens on ``MASTER_PORT``, and ``MASTER_PORT`` in ``os.environ``: every script a later test starts
    inherits that port and fails with EADDRINUSE. Each test gets the environment it started with and no group."""
    before = {key: os.environ.get(key) for key in _DIST_ENV}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 causal LM + its byte-level BPE tokenizer saved locally (head_dim 32)."""
    from lightning_rlhf.demo import save_tiny

    return save_tiny(str(tmp_path_factory.mktemp("tiny") / "model"), seed=0)


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 sequence classifier (one output) saved locally."""
    from lightning_rlhf.demo import save_tiny

    return save_tiny(str(tmp_path_factory.mktemp("tiny_rm") / "model"), seed=1, classifier=True)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo's warm-started tiny model (about a second to make)."""
    from lightning_rlhf.demo import prepare_demo_model

    return prepare_demo_model(str(tmp_path_factory.mktemp("cache")), seed=0)


def _run_folder(factory: pytest.TempPathFactory) -> Path:
    """A folder every pytest worker of this run sees: the base folder, or with pytest-xdist its parent (each
    worker's base folder is ``<run's base>/popen-gwN``)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tool task's model (the tiny model with the tool template) after a short warm start: it calls the
    calculator in nearly every episode, often with wrong digits (about 20 s to make, once per run: the first
    pytest worker builds it under a lock, the other finds it built)."""
    import fcntl

    from lightning_rlhf.demo.warmstart import prepare_tool_model

    folder = _run_folder(tmp_path_factory) / "tool_cache"
    folder.mkdir(exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return prepare_tool_model(str(folder), seed=0, warm_start_steps=60)


def failure_text(proc: subprocess.CompletedProcess[str]) -> str:
    """The parts of a failed run's output that explain it: the start and end of stderr, where every rank's
    first error and the controller's final one land."""
    err = proc.stderr
    body = err if len(err) <= 8000 else f"{err[:3000]}\n[... {len(err) - 8000} characters ...]\n{err[-5000:]}"
    return f"exit {proc.returncode}\n--- stdout (end)\n{proc.stdout[-1500:]}\n--- stderr\n{body}"


def run_script(
    name: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/scripts/<name>`` in a fresh interpreter (Lightning launches the other ranks from it)."""
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
    }
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
        env=full_env,
    )


def run_cli(*args: str, timeout: float = 300, module: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the ``lightning-rlhf`` console script (installed next to this interpreter) from the repository root;
    ``module=True`` runs ``python -m lightning_rlhf.cli`` instead (Lightning re-launches either for more ranks)."""
    script = Path(sys.executable).with_name("lightning-rlhf")
    if not module and not script.exists():
        pytest.fail(f"{script} is missing. HINT: install the project (`make setup`, or `pip install -e .`).")
    command = [sys.executable, "-m", "lightning_rlhf.cli"] if module else [str(script)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, cwd=str(ROOT), env=env)


# ------------------------------------------------------------------------------------------------ the two tiers
LONG_TIER: dict[str, str] = {
    "tests/e2e/test_demo_learns.py::test_distillation_teaches_a_student_that_grpo_cannot_move": (
        "the tool teacher (60 GRPO steps), 60 steps of distillation and 60 of GRPO from a weaker warm start (about 8 "
        "min): in CI the module on two ranks with the teacher on its own pool (test_more_algorithms), its parts "
        "(test_distillation), its recipe (test_recipes)"
    ),
    "tests/e2e/test_demo_learns.py::test_vision_demo_learns_to_count": (
        "the visual task's 100-step learning run (about 2 min): in CI the vision path runs in test_vision.py (both "
        "engines' log-probs with images), test_vision_runs.py (a rollout pool) and the grpo_vision recipe's 2 steps"
    ),
    "tests/distributed/test_vision_runs.py::test_a_vlm_trains_with_vllm_rollouts[qwen2.5-vl-colocated]": (
        "a tiny Qwen2.5-VL colocated with vLLM for 3 steps (about 1.5 min): in CI the same path runs with Qwen2-VL "
        "(test_vision_demo_learns_to_count) and Qwen2.5-VL's hand-offs to vLLM on the rollout pool"
    ),
    "tests/distributed/test_vision_runs.py::test_a_vlm_trains_with_vllm_rollouts[qwen2.5-vl-streamed-partial]": (
        "prompts with images streamed to a rollout pool with partial rollouts (about 1 min): in CI a rollout pool's "
        "requests carry images in the episodes' run (this file) and streamed rollouts run with text (test_stream)"
    ),
    "tests/e2e/test_real_size.py": (
        "a 0.5B model's 4 steps, checkpoint, resume and export (about half an hour, ~10 GiB a process): in CI the "
        "same recipe runs with the demo's model (test_recipes, real_size_cpu), the memory figures with PPO "
        "(test_activation_checkpointing_runs) and the families' shapes through vLLM (test_family_settings)"
    ),
    "tests/e2e/test_documented_commands.py::test_documented_commands_run_as_printed": (
        "every printed command, 20 launches: CI parses every command (test_the_commands_are_read_from_the_pages) "
        "and runs the demo, recipe and CLI paths they use"
    ),
    "tests/e2e/test_demo_learns.py::test_tool_demo_learns_to_use_the_calculator": (
        "the tool task's 60-step learning run (about 3 min): in CI its episodes run colocated on vLLM (test_recipes, "
        "the tool recipe at TP 2), on a rollout pool one step off-policy (test_async_rollouts), and its parts "
        "have unit tests (test_tool_task, test_agent_episodes)"
    ),
    "tests/e2e/test_demo_learns.py::test_demo_learns_with_partial_rollouts": (
        "the demo's 250 steps with partial rollouts on a rollout pool (about 1 min of training after the warm start): "
        "in CI the stream's mechanics (test_stream), a partial-rollout run on the pool with validation, episodes "
        "streamed and a resumed stream (test_async_rollouts)"
    ),
    "tests/e2e/test_demo_learns.py::test_demo_learns_by_distillation": (
        "the demo's GRPO teacher (250 steps) and 100 steps of distillation (about 3 min): in CI the module on two "
        "ranks with the teacher on its own pool (test_more_algorithms), its parts (test_distillation), its recipe "
        "(test_recipes)"
    ),
    "tests/e2e/test_demo_learns.py::test_tool_demo_learns_with_an_agent_over_http": (
        "the tool task's 60 steps with the openai-client agent (about 3 min): in CI the endpoint against the real "
        "openai client, the same episodes as the built-in loop, the refusals (test_agent_http)"
    ),
    "tests/e2e/test_algorithms_learn.py": (
        "120-step learning runs of five more algorithms and 150-step runs of five policy losses: in CI, GRPO "
        "learns with vLLM (test_demo_learns), GRPO and PPO with transformers' generate and the CPU layer off "
        "(test_cpu_layer_off); every algorithm's maths has unit tests and 2-step runs, every policy loss a "
        "hand-computed case and an update (test_policy_losses_2026, test_actor_update)"
    ),
    "tests/distributed/test_faults.py::test_sigterm_on_rank_0_saves_exits_143_and_resumes_like_an_uninterrupted_run": (
        "CI: resume equals the uninterrupted run (test_training), SIGUSR1 stops every rank (this file)"
    ),
    "tests/distributed/test_faults.py::test_sigkill_of_rank_0_is_named_on_the_worker": (
        "CI: a killed worker is named on rank 0 (this file)"
    ),
    "tests/distributed/test_faults.py::test_a_save_killed_half_way_leaves_nothing_resume_accepts": (
        "CI: the resume check refuses incomplete checkpoints (this file, without a run)"
    ),
    "tests/distributed/test_sft_runs.py": "CI: one-process SFT (tests/unit/test_sft.py), 2-process resume of RL",
    "tests/distributed/test_training.py::test_resume_continues_like_the_uninterrupted_run": (
        "CI: a resumed split-placement PPO run and a resumed asynchronous GRPO run equal their uninterrupted runs "
        "(test_placement_runs, test_async_rollouts)"
    ),
    "tests/distributed/test_reward_timeout.py": (
        "CI: a reward call past its timeout is killed and its samples get the fallback "
        "(tests/unit/test_reward_runner.py)"
    ),
    "tests/distributed/test_validation_runs.py": "CI: one-process validation fits (tests/unit/test_validation.py)",
    "tests/distributed/test_multinode.py::test_two_nodes_by_two_match_one_node_by_four": (
        "CI: which ranks a node starts (this file, without a run)"
    ),
    "tests/distributed/test_async_rollouts.py::test_four_ranks_sharded_actor_feeds_a_two_rank_rollout_pool": (
        "CI: 2-rank generation-only pools (this file)"
    ),
    "tests/distributed/test_placement_runs.py::test_four_ranks_two_pools": (
        "CI: split PPO on 2 ranks (this file); with sequence parallelism, the groups made within each pool "
        "(tests/unit/test_sequence_parallel.py) and a pool smaller than the size refused before launch (this file)"
    ),
    "tests/vllm/test_vllm_engine.py::test_handoff_gives_the_weights_of_the_trained_model[2-full,slices-0.001]": (
        "CI: TP 2 rollouts match the trainer's probabilities (this file), the TP 1 hand-off"
    ),
    "tests/vllm/test_vllm_chat_prompts.py::test_chat_prompts_longer_than_a_scheduler_step_sample_reproducibly[2]": (
        "CI: the same at TP 1"
    ),
    "tests/e2e/test_recipes.py::test_recipe_runs_two_steps[grpo_gsm8k]": "CI: the demo, PPO and SFT recipes",
    "tests/distributed/test_placement_runs.py::test_lora_with_the_reference_apart_from_the_actor_resumes_exactly": (
        "CI: a LoRA run resumes exactly (test_lora_runs) and a placed run resumes exactly (split PPO, this file); "
        "the reference loading its own base where the pools differ runs in make test-all"
    ),
    "tests/vllm/test_vllm_lora.py::test_lora_hand_offs_keep_the_engine_equal_to_the_trainer[merged]": (
        "CI: the adapter hand-off, the default (the [adapter] case); the merge itself equals peft's (test_lora)"
    ),
    "tests/vllm/test_vllm_pools.py::test_an_actor_placed_apart_generates_with_its_own_engine_server": (
        "CI: vLLM engine servers on a rollout pool (this file) and chunked weight hand-offs to a server (this file)"
    ),
    "tests/vllm/test_vllm_sampling.py::test_vllm_engine_with_stale_weights_warns_once": (
        "CI: the same warning with the transformers engine (tests/unit/test_sampling.py); vLLM's probabilities "
        "equal the trainer's after every hand-off (this file, test_vllm_engine)"
    ),
    "tests/e2e/test_recipes.py::test_recipe_runs_two_steps[rloo]": "CI: the demo, PPO and SFT recipes",
    "tests/e2e/test_recipes.py::test_recipe_runs_two_steps[agent_tools]": (
        "the tool recipe at TP 1 (about 70 s): CI runs the same recipe with its episodes on vLLM at TP 2 "
        "(test_the_tool_recipe_runs_its_episodes_on_vllm_at_tensor_parallel_2) and TP-1 episodes on vLLM's request "
        "queue (test_vllm_episodes)"
    ),
    "tests/e2e/test_recipes.py::test_recipe_runs_two_steps[real_size_cpu]": (
        "CI runs the same recipe for 3 steps and a resumed 4th "
        "(test_the_real_size_recipe_resumes_into_its_own_run_folder)"
    ),
    "tests/vllm/test_families.py": (
        "the real families at full width through vLLM (3-6 min each): in CI each family's vLLM settings at TP 1 "
        "and 2 (test_family_settings) and its template's token-in/token-out (test_family_templates); the tiny "
        "model's log-probs, hand-offs, export and LoRA with vLLM (test_vllm_engine, test_vllm_lora, "
        "test_export_round_trip)"
    ),
}
"""Tests that ``make test`` (CI) leaves to ``make test-all``, each with what covers its path in CI. ``make test``
stays under 20 minutes on 2 cores; ``make test-all`` (about 45) runs before a release and in sessions that change
what these cover. A key is a file or a test id."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`LONG_TIER` ``long`` (``-m "not long"`` leaves them out). An entry whose file was
    collected but that names no test fails the collection: a renamed test would otherwise move into CI's tier
    (or a slow one stay there) without a word."""
    matched: set[str] = set()
    for item in items:
        for key in (item.nodeid, item.nodeid.split("::")[0]):
            if key in LONG_TIER:
                item.add_marker(pytest.mark.long)
                matched.add(key)
    files = {item.nodeid.split("::")[0] for item in items}
    stale = [key for key in LONG_TIER if key.split("::")[0] in files and key not in matched]
    chosen = config.getoption("keyword") or any("::" in str(arg) for arg in config.args)  # -k, or single tests
    if stale and not chosen:
        raise pytest.UsageError(f"tests/conftest.py LONG_TIER names tests that do not exist: {stale}")
    items.sort(key=_start_order)


#: Where each folder's tests start, first to last: the multi-process and vLLM files take 1-3 min each, the unit
#: files seconds. With two pytest workers (``--dist loadfile --no-loadscope-reorder`` hands out whole files in this
#: order; without the flag pytest-xdist sorts the files by their number of tests, many first) the long files
#: then run side by side first and the short ones fill in at the end, instead of one worker finishing alone.
_START_ORDER = ("tests/e2e/", "tests/vllm/", "tests/distributed/", "tests/unit/test_docs_examples.py", "tests/")


def _start_order(item: pytest.Item) -> int:
    return next(i for i, prefix in enumerate(_START_ORDER) if item.nodeid.startswith(prefix) or prefix == "tests/")


def demo_rows(proc: subprocess.CompletedProcess[str]) -> list[dict[str, str]]:
    """The steps (rows with a reward) of the metrics.csv of a finished demo run, whose last printed line names the
    run folder; a failed run fails the test with its output."""
    assert proc.returncode == 0, failure_text(proc)
    run = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run folder: "))
    with open(run / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("critic/score/mean")]
