"""torchvision beside PyTorch's CPU build: the vision path (transformers' Qwen2-VL processor, vLLM's Qwen2-VL) imports
torchvision, and PyPI's Linux torchvision is a CUDA build whose compiled operators do not load beside the CPU torch.
Its import then fails in ``torchvision._meta_registrations`` (``operator torchvision::nms does not exist``: it
registers fake kernels for operators its library would have defined). The Python half of torchvision (transforms,
``tv_tensors``, ``io`` without its codecs) needs none of the compiled operators.

:func:`install_import_hook` makes the first ``import torchvision`` of a process define the schemas of the operators
that module registers fake kernels for, when torch is a CPU build and torchvision is not: ``nms`` and ``qnms`` are then
known and unimplemented (calling them raises), everything else imports. Nothing happens on a GPU machine (a CUDA
torch), with a matching CPU torchvision, or before torchvision is imported.

Two callers install it: ``lightning_rlhf/__init__.py``, and a ``.pth`` line that ``make setup`` writes into the venv,
which loads this file by its path (not as part of the package: a tool worker's interpreter must not hold the package,
``tests/unit/test_sandbox.py``) so that processes that never import the package (vLLM inspects models in subprocesses
of its own) get it too. This module therefore imports nothing but the standard library until torchvision is imported.

Relies on: ``torch.library.Library(...).define``, and the operator list of ``torchvision._meta_registrations``.
Checked on: torch 2.13.0+cpu with torchvision 0.28.0 (PyPI, CUDA 13.0 build); ``tests/unit/test_vision.py`` imports
it in a fresh interpreter.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["OPERATORS", "PTH_FILE", "install_import_hook", "needs_schemas", "write_pth"]

OPERATORS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
"""The operators ``torchvision._meta_registrations`` registers fake kernels for at import (0.28)."""
_MARK = "_lightning_rlhf_torchvision_schemas"
"""Set on the torch module once the schemas are defined: the hook may be installed by two copies of this module (the
package's and the ``.pth`` line's), and a schema defined twice raises."""


def needs_schemas() -> bool:
    """Whether torchvision's compiled operators cannot load here: torch is a CPU build (no CUDA) and torchvision is a
    build for CUDA (its distribution version lacks ``+cpu``: PyPI's reads plain ``0.28.0``). Runs on: any process,
    before torchvision's first import."""
    import importlib.metadata

    import torch

    try:
        version = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return False
    return torch.version.cuda is None and "+cpu" not in version


def _define_schemas() -> None:
    import torch

    if getattr(torch, _MARK, None) is not None or not needs_schemas():
        return
    library = torch.library.Library("torchvision", "DEF")
    for schema in OPERATORS:
        library.define(schema)
    setattr(torch, _MARK, library)  # kept alive for the process


class _Hook:
    """A ``sys.meta_path`` finder that runs :func:`_define_schemas` at the first ``import torchvision`` and then steps
    aside (finds nothing, and leaves the path)."""

    lightning_rlhf_torchvision_hook = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "torchvision":
            sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "lightning_rlhf_torchvision_hook", False)]
            _define_schemas()
        return None


def install_import_hook() -> None:
    """Make the process's first ``import torchvision`` importable beside a CPU torch (see the module's docstring);
    idempotent. torchvision already imported: nothing to do. Runs on: every process (the package's import, the venv's
    ``.pth`` line)."""
    if "torchvision" in sys.modules or any(getattr(f, "lightning_rlhf_torchvision_hook", False) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())  # type: ignore[arg-type]


PTH_FILE = "lightning_rlhf_torchvision.pth"
"""The ``.pth`` file :func:`write_pth` writes into the environment's ``site-packages``."""


def write_pth() -> str:
    """Write the ``.pth`` line that installs the hook in every process of this Python environment, loading this file
    by its path (no import of the package); returns the file written. A path that no longer exists (the checkout
    moved) makes the line do nothing. Runs on: the set-up (``make setup``)."""
    import os
    import sysconfig

    here = os.path.abspath(__file__)
    line = (
        f"import importlib.util as u, os; p = {here!r}; "
        "s = u.spec_from_file_location('_lightning_rlhf_torchvision', p) if os.path.exists(p) else None; "
        "m = s and u.module_from_spec(s); s and s.loader.exec_module(m); m and m.install_import_hook()\n"
    )
    target = os.path.join(sysconfig.get_paths()["purelib"], PTH_FILE)
    with open(target, "w") as f:
        f.write(line)
    return target
