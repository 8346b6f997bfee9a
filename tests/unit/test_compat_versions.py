"""Each compat module states the versions of its library it was checked on, ``pyproject.toml`` pins exactly that
range, and the installed library is inside it (so the compat tests ran on a claimed version)."""

from __future__ import annotations

import importlib
import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "lightning_rlhf" / "compat"
RANGES = {  # compat module -> (the library whose private state it touches, the constant stating its range)
    "lightning": ("lightning", "SUPPORTED_LIGHTNING"),
    "torch": ("torch", "SUPPORTED_TORCH"),
    "sharding": ("torch", None),  # FSDP2's layout: compat.torch's range
    "torchvision": ("torch", None),  # torch.library schemas for torchvision's import: compat.torch's range
    "peft": ("peft", "SUPPORTED_PEFT"),
    "transformers": ("transformers", "SUPPORTED_TRANSFORMERS"),
    "vllm": ("vllm", "SUPPORTED_VLLM"),
}


def pinned() -> dict[str, list[str]]:
    """Every requirement of pyproject.toml (dependencies and extras) by distribution name: its specifier."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found: dict[str, list[str]] = {}
    for line in [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]:
        req = Requirement(line)
        found.setdefault(req.name, []).append(str(req.specifier))
    return found


def stated(module: str) -> str:
    library, constant = RANGES[module]
    if constant is None:
        module = library
        constant = RANGES[library][1]
    return str(getattr(importlib.import_module(f"lightning_rlhf.compat.{module}"), str(constant)))


def test_every_compat_module_is_listed_here() -> None:
    assert {p.stem for p in COMPAT.glob("*.py")} - {"__init__"} == set(RANGES)


@pytest.mark.parametrize("module", sorted(RANGES))
def test_the_range_has_an_upper_bound_and_pyproject_pins_it(module: str) -> None:
    library = RANGES[module][0]
    spec = SpecifierSet(stated(module))
    assert any(s.operator == "<" for s in spec), f"compat.{module}: {spec} has no upper bound"
    names = [library, f"{library}-cpu"] if library == "vllm" else [library]
    for name in names:
        assert [SpecifierSet(s) for s in pinned()[name]] == [spec], name


@pytest.mark.parametrize("module", sorted(RANGES))
def test_the_installed_library_is_inside_the_range(module: str) -> None:
    library = RANGES[module][0]
    installed = [version for name in (library, f"{library}-cpu") if (version := _installed(name))]
    if not installed:
        pytest.skip(f"{library} is not installed (an optional extra)")
    spec = SpecifierSet(stated(module))
    assert spec.contains(installed[0], prereleases=True), (
        f"{library} {installed[0]} is outside compat.{module}'s {spec}"
    )


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
