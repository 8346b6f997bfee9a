"""The embedded tasks and warm starts (``lightning_rlhf/demo``) live apart from the runtime: no module outside
``demo/`` imports them, and an embedded model's name (``lightning-rlhf/...``) still works in a fresh process, the
demo being imported only by that lookup (``lightning_rlhf.config.models``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "lightning_rlhf"
DEMO = PACKAGE / "demo"


def _imported(path: Path) -> list[str]:
    """Every module an import statement of ``path`` names (``from a import b`` names ``a`` and ``a.b``)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*parts, node.module] if node.module else parts)
            names += [module, *(f"{module}.{alias.name}" for alias in node.names)]
    return names


def test_no_module_outside_the_demo_imports_it() -> None:
    offenders = {
        str(path.relative_to(ROOT)): name
        for path in PACKAGE.rglob("*.py")
        if DEMO not in path.parents
        for name in _imported(path)
        if name == "lightning_rlhf.demo" or name.startswith("lightning_rlhf.demo.")
    }
    assert not offenders, f"the runtime imports the demo: {offenders}"
    assert "lightning_rlhf.demo.warmstart" in _imported(DEMO / "model_path.py")  # the scan sees the demo's own


def test_an_embedded_name_works_in_a_fresh_process_that_never_imported_the_demo(tmp_path: Path) -> None:
    """Every public name and the command line load without the demo; ``GRPOModule("lightning-rlhf/tiny-random")``
    then builds the embedded model into the cache (the lookup imports the demo's catalogue, not its warm start)."""
    code = (
        "import sys\n"
        "import lightning_rlhf, lightning_rlhf.cli\n"
        "for name in lightning_rlhf.__all__:\n"
        "    getattr(lightning_rlhf, name)\n"
        "demo = lambda: sorted(m for m in sys.modules if m.startswith('lightning_rlhf.demo'))\n"
        "assert demo() == [], demo()\n"
        "module = lightning_rlhf.GRPOModule('lightning-rlhf/tiny-random', reward=lambda prompts, responses: 0.0)\n"
        "print(module.tokenizer.name_or_path)\n"
        "print(demo())\n"
    )
    env = {**os.environ, "LIGHTNING_RLHF_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder, loaded = proc.stdout.strip().splitlines()[-2:]
    assert folder.startswith(str(tmp_path)) and os.path.isfile(os.path.join(folder, "config.json")), folder
    assert "lightning_rlhf.demo.catalogue" in loaded
