"""torchvision beside PyTorch's CPU build: the vision path (transformers' Qwen2-VL processor, vLLM's Qwen2-VL) imports
torchvision, and PyPI's Linux torchvision is a CUDA build whose compiled operators do not load beside the CPU torch.
Its import then fails in ``torchvision._meta_registrations`` (``operator torchvision::nms does not exist``: it
registers fake kernels for operators its library would have defined). The Python half of torchvision (transforms,
``tv_tensors``, ``io`` without its codecs) needs none of the compiled operators.

:func:`install_import_hook` (called by ``lightning_rlhf/__init__.py``) makes the first ``import torchvision`` of a
process define the schemas of the operators that module registers fake kernels for, when torch is a CPU build and
torchvision is not: ``nms`` and ``qnms`` are then known and unimplemented (calling them raises), everything else
imports. Nothing happens on a GPU machine (a CUDA torch), with a matching CPU torchvision, or before torchvision is
imported (the hook costs nothing until then: the package stays light for reward and tool workers).

Checked on: torch 2.13.0+cpu with torchvision 0.28.0 (PyPI, CUDA 13.0 build);
``tests/unit/test_compat_torchvision.py`` imports it in a fresh interpreter.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import sys
from typing import Any

__all__ = ["OPERATORS", "install_import_hook", "needs_schemas"]

OPERATORS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
"""The operators ``torchvision._meta_registrations`` registers fake kernels for at import (0.28)."""
_library: Any = None  # the torch.library.Library that holds the schemas (kept alive for the process)


def needs_schemas() -> bool:
    """Whether torchvision's compiled operators cannot load here: torch is a CPU build (no CUDA) and torchvision is a
    build for CUDA (its distribution version lacks ``+cpu``: PyPI's reads plain ``0.28.0``). Runs on: any process,
    before torchvision's first import."""
    import torch

    try:
        version = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return False
    return torch.version.cuda is None and "+cpu" not in version


def _define_schemas() -> None:
    global _library
    if _library is not None or not needs_schemas():
        return
    import torch

    _library = torch.library.Library("torchvision", "DEF")
    for schema in OPERATORS:
        _library.define(schema)


class _Hook(importlib.abc.MetaPathFinder):
    """Runs :func:`_define_schemas` at the first ``import torchvision`` and then steps aside (finds nothing)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "torchvision":
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Hook)]
            _define_schemas()
        return None


def install_import_hook() -> None:
    """Make the process's first ``import torchvision`` importable beside a CPU torch (see the module's docstring);
    idempotent. torchvision already imported: nothing to do. Runs on: every process (the package's import)."""
    if "torchvision" in sys.modules or any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())
