"""The sandbox's worker program (lightning_rlhf/sandbox/worker.py) runs as a script in a fresh interpreter: it must
import only the standard library, so that a reward or tool worker starts in a fraction of a second and never pays
for torch. Checked on the file itself and on a live worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_rlhf.agents.parsing import ToolCall
from lightning_rlhf.sandbox import WORKER_PROGRAM, ToolExecutor

HEAVY = ("lightning_rlhf", "torch", "numpy")

_PROBE = """
import json, runpy, sys
before = set(sys.modules)
runpy.run_path(sys.argv[1], run_name="sandbox_worker")  # not "__main__": defines everything, serves nothing
new = {name.split(".")[0] for name in set(sys.modules) - before}
print(json.dumps(sorted(new - set(sys.stdlib_module_names) - {"__main__", "__mp_main__"})))
"""


def _outside_the_standard_library(program: str | Path) -> list[str]:
    """The top-level modules outside the standard library that loading ``program`` imports, in a fresh interpreter
    that could import the package and its dependencies (the test's ``sys.path``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, "-P", "-c", _PROBE, str(program)], capture_output=True, text=True, check=True, env=env
    ).stdout
    return json.loads(out)


def test_the_worker_program_imports_only_the_standard_library() -> None:
    assert Path(WORKER_PROGRAM).is_file() and Path(WORKER_PROGRAM).parent.name == "sandbox"
    assert _outside_the_standard_library(WORKER_PROGRAM) == []


def test_the_probe_sees_an_import_outside_the_standard_library(tmp_path: Path) -> None:
    """The check above would pass vacuously if the probe missed a package (here numpy, and the package itself)."""
    program = tmp_path / "heavy_worker.py"
    program.write_text("import json\nimport numpy\nimport lightning_rlhf.lazy\n")
    assert _outside_the_standard_library(program) == ["lightning_rlhf", "numpy"]


def test_a_live_worker_runs_the_sandbox_program_and_stays_light() -> None:
    """A tool worker started by the executor runs ``sandbox/worker.py`` and, with its tool loaded, holds no module of
    the package, torch or numpy."""

    def probe() -> list[object]:  # a closure: travels by value, imports nothing of the test module
        return [sys.argv[0], sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)]

    executor = ToolExecutor({"probe": probe}, timeout_s=60.0, num_workers=1, max_chars=10_000)
    try:
        result = executor.submit(ToolCall("probe", {})).result()
    finally:
        executor.close()
    assert result.kind == "ok", result.text
    assert json.loads(result.text) == [WORKER_PROGRAM, []]
