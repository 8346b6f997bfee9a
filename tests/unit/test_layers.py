"""Dependencies point one way (docs/architecture.md, "The house"): every module of the package sits in one layer and
imports only modules of lower layers (or of its own part), and no set of modules imports itself round (no cycle,
function-level and type-only imports included). These tests read every import of the package so that a
new upward import or a new cycle fails here, and a new module without a layer too."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_rlhf"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("sandbox (worker processes for reward functions and tools; standard library only)", ("sandbox",)),
    ("leaves", ("batch", "compat", "config.models", "lazy")),
    ("plumbing", ("controller.dispatch",)),
    ("controller (worker loop, liveness, launch: no RL)", ("controller",)),
    ("maths", ("algorithms", "placement.cost_model")),
    ("settings and rewards", ("config", "rewards")),
    ("data", ("data",)),
    ("device layer interface", ("engines.device_layer",)),
    ("training engine", ("engines.train",)),
    ("rollout engines", ("engines.rollout", "engines")),
    ("CPU speed layer (an extra: handed to the engines as a DeviceLayer)", ("cpu",)),
    ("measurements", ("perf",)),
    ("agents (multi-turn episodes, tools)", ("agents",)),
    ("hybrid engine (memory phases, hand-offs, policy versions; samples episodes)", ("engines.hybrid",)),
    ("a rollout pool's stream (drives requests as the episodes do)", ("engines.stream",)),
    ("roles", ("roles",)),
    ("the dataflow's helpers (rollouts, metrics, validation)", ("dataflow",)),
    ("RLHFModule and the cost model's calibration", ("module", "placement.calibration")),
    ("ready modules, placement, export", ("checkpoint", "modules", "placement")),
    ("strategy and callbacks", ("callbacks", "strategy")),
    ("entry points", ("cli", "demo")),
    ("package root", ("",)),
]
"""Bottom to top: the parts (module paths inside ``lightning_rlhf``, a part holding its submodules) of each layer. A
module may import a module of a lower layer or of its own part (its own part's order is left to the cycle check);
never one of a higher layer, nor one of a sibling part in its own layer. ``""`` is the package's ``__init__``, which
re-exports the public names."""


def _module(path: Path, package: Path = PACKAGE) -> str:
    """``lightning_rlhf.x.y`` of a file in the package (``lightning_rlhf.x`` for ``x/__init__.py``)."""
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {_module(path, package): path for path in sorted(package.rglob("*.py"))}


@functools.cache
def _imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """``(line, module)`` of every runtime import of a module of the package in the file: module-level and
    function-level, relative ones resolved; ``from a import b`` is ``a.b`` where that is a module, else ``a``.
    Imports under ``if TYPE_CHECKING:`` count too: a type-only import still ties the two modules together."""
    known = _modules(package)
    here = _module(path, package)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            bits = name.split(".")
            while bits and ".".join(bits) not in known:
                bits.pop()
            if bits and bits[0] == PACKAGE.name and ".".join(bits) != here:
                found.append((node.lineno, ".".join(bits)))
    return sorted(set(found))


def _place(module: str) -> tuple[int, str]:
    """``(layer index, part)`` of a module: the longest part of :data:`LAYERS` that holds it."""
    inside = module.removeprefix(PACKAGE.name).removeprefix(".")
    best: tuple[int, str] | None = None
    for index, (_, parts) in enumerate(LAYERS):
        for part in parts:
            holds = inside == part or inside.startswith(part + ".") if part else inside == ""
            if holds and (best is None or len(part) > len(best[1])):
                best = (index, part)
    if best is None:
        raise KeyError(module)
    return best


def _upward_in(module: str, package: Path = PACKAGE) -> list[str]:
    """The imports of ``module`` that break the layer order, as ``file:line: a (layer) imports b (layer)``."""
    path = _modules(package)[module]
    layer, part = _place(module)
    bad = []
    for line, imported in _imports(path, package):
        to_layer, to_part = _place(imported)
        if to_part != part and to_layer >= layer:
            bad.append(
                f"{path.relative_to(package.parent)}:{line}: {module} ({LAYERS[layer][0]}) imports {imported} "
                f"({LAYERS[to_layer][0]})"
            )
    return bad


def _upward(package: Path = PACKAGE) -> list[str]:
    """Every import in the package that breaks the layer order."""
    return [line for module in _modules(package) for line in _upward_in(module, package)]


def _cycles(package: Path = PACKAGE) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan's algorithm)."""
    edges = {module: {m for _, m in _imports(path, package)} for module, path in _modules(package).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    """A new module (or top-level part) must be placed in :data:`LAYERS` before the order below can hold."""
    unplaced = []
    for module in _modules():
        try:
            _place(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"modules in no layer of LAYERS (add their part to the layer they belong in): {unplaced}"
    listed = {part for _, parts in LAYERS for part in parts}
    dead = {part for part in listed if not any(_place(m)[1] == part for m in _modules())}
    assert not dead, f"LAYERS names parts that hold no module: {sorted(dead)}"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_layers_import_one_way(module: str) -> None:
    layer, part = _place(module)
    bad = _upward_in(module)
    allowed = [name for _, parts in LAYERS[:layer] for name in parts]
    assert not bad, (
        f"`{module}` ({LAYERS[layer][0]}) may import only its own part ({part or 'the root'}) and {allowed}:\n"
        + "\n".join(bad)
        + "\nHINT: move what it needs down to the layer where it belongs (or pass it in); an import hidden in a "
        "function counts too."
    )


def test_no_import_cycles() -> None:
    cycles = _cycles()
    assert not cycles, "import cycles (function-level and type-only imports included):\n" + "\n".join(
        f"{len(c)} modules: {c}" for c in cycles
    )


def test_the_import_reader_sees_every_form(tmp_path: Path) -> None:
    """The checks above would pass vacuously if the reader missed an import's form: module- and function-level,
    relative, ``from package import submodule``, and inside ``if TYPE_CHECKING:`` blocks (a type-only import ties two
    modules as much as any other: the cycle it closes is one that a refactoring has to untangle all the same)."""
    package = tmp_path / "lightning_rlhf"
    (package / "roles").mkdir(parents=True)
    for name in ("__init__.py", "module.py", "roles/__init__.py", "roles/actor.py"):
        (package / name).write_text("")
    (package / "roles" / "base.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from lightning_rlhf import batch\n"
        "from . import actor\n"
        "if TYPE_CHECKING:\n    from lightning_rlhf import perf\n"
        "def f():\n    from ..module import thing\n"
    )
    (package / "perf.py").write_text("")
    (package / "batch.py").write_text("import lightning_rlhf.roles.base\n")
    assert _imports(package / "roles" / "base.py", package) == [
        (2, "lightning_rlhf.batch"),
        (3, "lightning_rlhf.roles.actor"),
        (5, "lightning_rlhf.perf"),
        (7, "lightning_rlhf.module"),
    ]
    assert _cycles(package) == [["lightning_rlhf.batch", "lightning_rlhf.roles.base"]]
    assert _upward(package) == [
        "lightning_rlhf/batch.py:1: lightning_rlhf.batch (leaves) imports lightning_rlhf.roles.base (roles)",
        "lightning_rlhf/roles/base.py:7: lightning_rlhf.roles.base (roles) imports lightning_rlhf.module "
        "(RLHFModule and the cost model's calibration)",
    ]


def test_the_strategy_knows_roles_only_by_what_they_declare() -> None:
    role_names = re.compile(r"""\.(actor|critic|reference|reward)\b|["'](actor|critic|reference|reward)["']""")
    hits = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted((PACKAGE / "strategy").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if role_names.search(line.split("#")[0])
    ]
    assert not hits, "the strategy names a role:\n" + "\n".join(hits)


def _engine_probes(path: Path) -> list[str]:
    """``line: call`` of every ``getattr``/``hasattr`` in ``path`` whose object is an engine (a name or attribute
    ending in ``engine``: ``engine``, ``self.engine``, ``rollout_engine``, ...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        target = node.args[0]
        name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""
        if node.func.id in ("getattr", "hasattr") and name.endswith("engine"):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_engine_ability_is_probed() -> None:
    """What an engine offers is declared (``RolloutEngine.abilities``, the Protocol's members), never probed: no
    ``getattr(engine, ...)`` or ``hasattr(engine, ...)`` in the package."""
    hits = [
        f"{path.relative_to(PACKAGE.parent)}:{hit}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in _engine_probes(path)
    ]
    assert not hits, "an engine is probed (declare it in EngineAbilities or the Protocol):\n" + "\n".join(hits)


def test_the_probe_rule_sees_every_form(tmp_path: Path) -> None:
    probes = tmp_path / "probes.py"
    probes.write_text(
        "getattr(engine, 'x', False)\nhasattr(self.rollout_engine, 'y')\ngetattr(self.engine, op)\n"
        "getattr(engine_model.config, 'bos_token_id', None)\nengine.abilities.takes_adapters\n"
    )
    assert [hit.split(":")[0] for hit in _engine_probes(probes)] == ["1", "2", "3"]


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
    (``import lightning_rlhf.cpu as cpu``): nothing else in the package imports a module inside it."""
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if CPU not in path.parents
        for line, name in _cpu_internals(path)
    ]
    assert not bad, (
        "only lightning_rlhf/cpu may import its modules; use `import lightning_rlhf.cpu as cpu`:\n" + "\n".join(bad)
    )


def test_the_cpu_rule_sees_internal_imports(tmp_path: Path) -> None:
    """The rule above would pass vacuously if the reader missed the forms such an import takes."""
    source = tmp_path / "x.py"
    source.write_text(
        "from lightning_rlhf.cpu import native, enabled\nfrom lightning_rlhf.cpu.onednn import linear\n"
        "import lightning_rlhf.cpu.kernels\nimport lightning_rlhf.cpu as cpu\n"
    )
    assert [name for _, name in _cpu_internals(source)] == [
        "lightning_rlhf.cpu.native",
        "lightning_rlhf.cpu.onednn",
        "lightning_rlhf.cpu.kernels",
    ]
    strategy = PACKAGE / "strategy" / "strategy.py"
    assert "lightning_rlhf.cpu" in {imported for _, imported in _imports(strategy)}


CORE = ("engines", "algorithms", "roles")
"""The parts that take the device layer as an object handed to them, and never import the CPU layer."""


def _cpu_imports(path: Path) -> list[int]:
    """Lines of every import of ``lightning_rlhf.cpu`` (or a module inside it) in ``path``: module-level,
    function-level and type-only."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        if any(name == "lightning_rlhf.cpu" or name.startswith("lightning_rlhf.cpu.") for name in names):
            lines.append(node.lineno)
    return lines


def test_the_core_never_imports_the_cpu_layer() -> None:
    """The CPU layer is chosen once at set-up and handed in (``engines/device_layer.py``): nothing under
    ``engines/``, ``algorithms/`` or ``roles/`` imports it, in any form."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for part in CORE
        for path in sorted((PACKAGE / part).rglob("*.py"))
        for line in _cpu_imports(path)
    ]
    assert not found, (
        "the core imports lightning_rlhf.cpu:\n" + "\n".join(found) + "\nHINT: take the DeviceLayer the strategy hands "
        "in (TrainEngine.layer, make_rollout_engine(layer=...)) and add what it needs to its interface."
    )


def test_the_cpu_layer_imports_nothing_above_the_engines() -> None:
    """``cpu/`` could ship as an extra: it imports only the engines and what lies below them."""
    top = next(i for i, (_, parts) in enumerate(LAYERS) if "engines.rollout" in parts)
    allowed = {part for _, parts in LAYERS[: top + 1] for part in parts}
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {imported}"
        for module, path in _modules().items()
        if _place(module)[1] == "cpu"
        for line, imported in _imports(path)
        if _place(imported)[1] not in allowed | {"cpu"}
    ]
    assert not bad, "cpu/ imports above the engines:\n" + "\n".join(bad)


def test_the_core_rule_sees_every_form(tmp_path: Path) -> None:
    """The rule above would pass vacuously if it missed a form of the import."""
    source = tmp_path / "x.py"
    source.write_text(
        "import lightning_rlhf.cpu as cpu\nfrom lightning_rlhf import cpu\nfrom lightning_rlhf.cpu.decode import x\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_rlhf.cpu import CPULayer\n"
        "def f():\n    import lightning_rlhf.cpu.native\nimport lightning_rlhf.cpus\n"
    )
    assert _cpu_imports(source) == [1, 2, 3, 6, 8]
