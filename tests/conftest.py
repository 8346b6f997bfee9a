"""Shared fixtures: tiny local models (nothing is downloaded) and a runner for multi-process scripts."""

from __future__ import annotations

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
