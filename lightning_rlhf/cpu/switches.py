"""The CPU speed layer's switch: whether the layer (or one of its :data:`PIECES`) is on in this process.

A leaf (it imports nothing of the package), so that a piece can ask it while the package's ``__init__`` imports that
piece, without an import cycle; the rest of the package reaches it as ``lightning_rlhf.cpu``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ENV", "OFF_ENV", "PIECES", "configure", "enabled", "pieces_off", "setting"]

ENV = "LIGHTNING_RLHF_CPU_KERNELS"
"""Environment variable: ``1`` turns the layer on, ``0`` off (the strategy's ``cpu_kernels`` wins where given)."""
OFF_ENV = "LIGHTNING_RLHF_CPU_OFF"
"""Environment variable: comma-separated :data:`PIECES` to turn off (the others stay as the switch says)."""
PIECES = ("native", "rms_norm", "onednn", "collectives", "hand_off", "shared_weights")
"""The layer's pieces (module docstring)."""

_UNSET = object()
_STATE: dict[str, Any] = {"setting": _UNSET, "device": None}
"""What :func:`configure` set for this process: the strategy's ``cpu_kernels`` and its device type."""
_OFF_HERE: set[str] = set()
"""Pieces turned off in this process by :func:`pieces_off`."""


def configure(cpu_kernels: bool | None, device: torch.device | str | None) -> None:
    """Set this process's switch: ``cpu_kernels`` (None: the environment variable, else on only when ``device`` is a
    CPU) for a run on ``device``. Runs on: every process, at the strategy's set-up (before any model is built)."""
    if cpu_kernels is not None and not isinstance(cpu_kernels, bool):
        raise ValueError(
            f"RLHFStrategy(cpu_kernels={cpu_kernels!r}) is invalid: expected True, False or None. HINT: None turns "
            "the CPU speed layer on only when the run's device is a CPU."
        )
    _STATE["setting"] = cpu_kernels
    _STATE["device"] = None if device is None else torch.device(device).type


def setting() -> bool | None:
    """The switch as set: the strategy's ``cpu_kernels`` where it gave one, else ``LIGHTNING_RLHF_CPU_KERNELS``
    (``1``/``0``), else None (decided by the device). Runs on: any process."""
    given = _STATE["setting"]
    if given is not _UNSET and given is not None:
        return bool(given)
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{ENV}={value!r} is invalid. HINT: {ENV}=1 turns the CPU speed layer on, 0 off; unset: on CPU.")


def enabled(piece: str | None = None) -> bool:
    """Whether the layer (or its ``piece``, one of :data:`PIECES`) is on in this process: the switch
    (:func:`setting`; None: on where the run's device is a CPU, that is the strategy's device or, before any
    strategy, where no CUDA device is visible), minus the pieces turned off. Runs on: any process."""
    if piece is not None and piece not in PIECES:
        raise ValueError(f"lightning_rlhf.cpu: no piece {piece!r}. HINT: one of {list(PIECES)}.")
    on = setting()
    if on is None:
        device = _STATE["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
        on = device == "cpu"
    if not on or piece is None:
        return on
    return piece not in _OFF_HERE and piece not in _parse_off(os.environ.get(OFF_ENV, ""))


@functools.lru_cache(maxsize=16)
def _parse_off(value: str) -> frozenset[str]:
    """The pieces that ``LIGHTNING_RLHF_CPU_OFF=value`` turns off (parsed once per value: the decoding loop asks
    :func:`enabled` several times a token)."""
    names = frozenset(name.strip() for name in value.split(",") if name.strip())
    unknown = names - set(PIECES)
    if unknown:
        raise ValueError(f"{OFF_ENV}={value!r} names no piece {sorted(unknown)}. HINT: {list(PIECES)}.")
    return names


@contextlib.contextmanager
def pieces_off(*pieces: str) -> Iterator[None]:
    """Turn ``pieces`` off in this process inside the ``with`` block (A/B benchmarks, tests); a model already sped up
    keeps its switched forwards (build or :func:`~lightning_rlhf.cpu.restore_model` it inside). Runs on: any process.
    """
    for piece in pieces:
        enabled(piece)  # checks the name
    before = set(_OFF_HERE)
    _OFF_HERE.update(pieces)
    try:
        yield
    finally:
        _OFF_HERE.clear()
        _OFF_HERE.update(before)
