"""Dependencies point one way (docs/architecture.md, "Layers"): user module -> ready modules -> RLHFModule ->
roles -> engines -> algorithms / batch, with the strategy wiring them and knowing roles only by what they
declare. These tests read the package's imports (outside ``if TYPE_CHECKING:``) so a new upward import fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_rlhf"

ONLY: dict[str, set[str]] = {"batch": set(), "dispatch": {"batch"}, "compat": set()}
"""Leaf parts -> the only parts they may import."""
FORBIDDEN: dict[str, set[str]] = {
    "algorithms": {"engines", "roles", "module", "modules", "strategy", "cli", "callbacks", "data", "demo"},
    "engines": {"roles", "module", "modules", "strategy", "cli", "callbacks", "data", "demo"},
    "cpu": {"roles", "module", "modules", "strategy", "cli", "callbacks", "data", "demo"},
    "roles": {"strategy", "module", "modules", "cli", "callbacks", "demo"},
    "module": {"strategy", "modules", "cli", "demo"},
    "modules": {"strategy", "cli"},
}
"""Top-level part of the package -> the parts it must not import."""


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, imported part)`` of every runtime import of ``lightning_rlhf.<part>`` in the file."""
    tree = ast.parse(path.read_text())
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only |= {id(n) for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            bits = name.split(".")
            if bits[0] == "lightning_rlhf" and len(bits) > 1:
                found.append((node.lineno, bits[1]))
    return found


def _files(part: str) -> list[Path]:
    folder = PACKAGE / part
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{part}.py"]


@pytest.mark.parametrize("part", sorted(FORBIDDEN | ONLY))
def test_layers_import_one_way(part: str) -> None:
    bad = []
    for path in _files(part):
        for line, imported in _imports(path):
            wrong = imported not in ONLY[part] if part in ONLY else imported in FORBIDDEN[part]
            if imported != part and wrong:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports lightning_rlhf.{imported}")
    rule = f"may import only {sorted(ONLY[part])}" if part in ONLY else f"must not import {sorted(FORBIDDEN[part])}"
    assert not bad, f"`lightning_rlhf.{part}` {rule}:\n" + "\n".join(bad)


def test_the_import_reader_sees_imports() -> None:
    """The check above would pass vacuously if the reader found nothing: it must see the roles' imports."""
    parts = {imported for path in _files("roles") for _, imported in _imports(path)}
    assert {"engines", "dispatch", "batch"} <= parts


def test_the_strategy_knows_roles_only_by_what_they_declare() -> None:
    role_names = re.compile(r"""\.(actor|critic|reference|reward)\b|["'](actor|critic|reference|reward)["']""")
    hits = [
        f"{path.name}:{n}: {line.strip()}"
        for path in _files("strategy")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if role_names.search(line.split("#")[0])
    ]
    assert not hits, "the strategy names a role:\n" + "\n".join(hits)


CPU = PACKAGE / "cpu"


def _cpu_internals(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path`` of a module inside ``lightning_rlhf.cpu`` (its submodules, or a
    submodule named in ``from lightning_rlhf.cpu import ...``), type-only imports included."""
    inside = {p.stem for p in CPU.glob("*.py") if p.stem != "__init__"} | {p.name for p in CPU.iterdir() if p.is_dir()}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "lightning_rlhf.cpu":
                names = [f"lightning_rlhf.cpu.{a.name}" for a in node.names if a.name in inside]
            elif node.module.startswith("lightning_rlhf.cpu."):
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("lightning_rlhf.cpu.")]
        found += [(node.lineno, name) for name in names]
    return found


def test_only_the_cpu_layer_imports_its_internals() -> None:
    """The CPU speed layer (``lightning_rlhf/cpu``) is reached through its package's interface only
    (``from lightning_rlhf import cpu``): nothing else in the package imports a module inside it."""
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if CPU not in path.parents
        for line, name in _cpu_internals(path)
    ]
    assert not bad, (
        "only lightning_rlhf/cpu may import its modules; use `from lightning_rlhf import cpu`:\n" + "\n".join(bad)
    )


def test_the_cpu_rule_sees_internal_imports(tmp_path: Path) -> None:
    """The rule above would pass vacuously if the reader missed the forms such an import takes."""
    source = tmp_path / "x.py"
    source.write_text(
        "from lightning_rlhf.cpu import native, enabled\nfrom lightning_rlhf.cpu.onednn import linear\n"
        "import lightning_rlhf.cpu.kernels\nfrom lightning_rlhf import cpu\n"
    )
    assert [name for _, name in _cpu_internals(source)] == [
        "lightning_rlhf.cpu.native",
        "lightning_rlhf.cpu.onednn",
        "lightning_rlhf.cpu.kernels",
    ]
    assert any(imported == "cpu" for path in _files("engines") for _, imported in _imports(path))
