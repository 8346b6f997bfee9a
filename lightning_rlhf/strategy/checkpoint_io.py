"""Checkpoints that are complete or absent: written to a temporary sibling, synced, renamed into place; and the
check that refuses a missing or incomplete checkpoint before any model loads (docs/faults.md)."""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_rlhf.compat.peft import LORA_MARK

__all__ = [
    "check_ckpt_argument",
    "check_resume_lora",
    "check_resume_path",
    "incomplete_reason",
    "publish",
    "temporary_sibling",
]

_LIGHTNING_KEYWORDS = ("last", "best", "hpc")  # resolved by Lightning itself, later


def temporary_sibling(path: Path, token: str) -> Path:
    """``<path>.tmp-<token>``: where a checkpoint is written before it is renamed to ``path``. Runs on: any."""
    return path.with_name(f"{path.name}.tmp-{token}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path) -> None:
    """Sync ``tmp`` (a file, or a folder and every file in it) to disk, then rename it to ``path``.

    An existing ``path`` is replaced: a file atomically (``os.replace``); a folder is first moved aside to
    ``<path>.old-<suffix>`` and deleted after the rename, so ``path`` is only ever absent or complete. Runs on: rank 0,
    after every rank finished writing into ``tmp``."""
    if tmp.is_dir():
        for root, _, files in os.walk(tmp):
            for name in files:
                _fsync(Path(root) / name)
            _fsync(Path(root))
    else:
        _fsync(tmp)
    old = None
    if path.is_dir() and not path.is_symlink():
        old = path.with_name(f"{path.name}.old-{tmp.name.rsplit('.tmp-', 1)[-1]}")
        os.rename(path, old)
    os.replace(tmp, path)
    _fsync(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def incomplete_reason(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (None if it is one). Runs on: any process.

    A folder needs Lightning's ``meta.pt`` and the distributed checkpoint's ``.metadata``, which are written
    last; a file must be a whole zip archive (``torch.save``'s format, whose directory is at its end)."""
    if path.is_dir():
        missing = [name for name in ("meta.pt", ".metadata") if not (path / name).is_file()]
        return f"the folder lacks {', '.join(missing)} (a save into it did not finish)" if missing else None
    if path.stat().st_size == 0:
        return "the file is empty"
    if not zipfile.is_zipfile(path):
        return "the file is not a whole torch checkpoint (a save into it did not finish, or it is another format)"
    return None


def check_resume_path(ckpt_path: Any) -> None:
    """Refuse a checkpoint to resume from that is missing or incomplete, before anything loads. Runs on: every rank (or
    the launching process), before the process group and the models. ``None``, Lightning's keywords (``"last"``,
    ``"best"``, ``"hpc"``, ``"registry:..."``) and URLs are left to Lightning.

    Raises:
        FileNotFoundError: nothing at ``ckpt_path``.
        ValueError: something is there but it is not a complete checkpoint.
    """
    text = str(ckpt_path)
    if ckpt_path is None or text in _LIGHTNING_KEYWORDS or text.startswith("registry:") or "://" in text:
        return
    path = Path(text).expanduser()
    if not path.exists():
        partial = sorted(p.name for p in path.parent.glob(f"{path.name}.tmp-*")) if path.parent.is_dir() else []
        why = (
            f"only `{partial[0]}` is there, a save that did not finish (the run was killed while saving). "
            "HINT: resume from an earlier checkpoint; delete the `.tmp-*` folder."
            if partial
            else "HINT: check the path (relative paths start from the current folder "
            f"`{os.getcwd()}`); ModelCheckpoint and preemption saves print where they wrote."
        )
        raise FileNotFoundError(f"fit(ckpt_path={text!r}): there is no checkpoint at `{path}`: {why}")
    reason = incomplete_reason(path)
    if reason is not None:
        raise ValueError(
            f"fit(ckpt_path={text!r}) is not a complete checkpoint: {reason}. "
            "HINT: resume from an earlier checkpoint; checkpoints written by this version are renamed into place "
            "only once complete."
        )


def check_resume_lora(ckpt_path: Any, module: Any) -> None:
    """Refuse to resume a checkpoint of LoRA adapters into a run that trains every weight, or the reverse, before any
    process or model starts (the keys of the distributed checkpoint's ``.metadata`` say which it holds). Runs on: the
    launching process. Leaves Lightning's keywords, single files and modules without roles alone.

    Raises:
        ValueError: the checkpoint and ``module`` disagree, naming the setting and the fix.
    """
    roles = getattr(module, "roles", None)
    if ckpt_path is None or not callable(roles):
        return
    path = Path(str(ckpt_path)).expanduser()
    if not (path / ".metadata").is_file():
        return
    from torch.distributed.checkpoint import FileSystemReader

    saved = any(LORA_MARK in key for key in FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    wanted = any(getattr(role, "lora", None) is not None for role in roles().values())
    if saved == wanted:
        return
    had = "LoRA adapters (RLHFModule(lora=...))" if saved else "every weight (RLHFModule(lora=None))"
    has = "LoRA adapters (RLHFModule(lora=...))" if wanted else "every weight (no lora)"
    raise ValueError(
        f"fit(ckpt_path={str(ckpt_path)!r}) was saved by a run that trained {had}, but this module trains {has}. "
        "HINT: resume with the lora setting the checkpoint was saved with; to go on from it the other way, export it "
        "(`lightning-rlhf export`, merged for LoRA) and start a new run from that folder."
    )


def check_ckpt_argument(arguments: Mapping[str, Any], fitting: bool = False) -> None:
    """Check the ``ckpt_path`` that ``trainer.fit``/``validate`` is about to get (``arguments``: the call's, a
    launcher's check), before any process or model starts. Runs on: the launching process (rank 0, or every rank
    when processes are created externally)."""
    ckpt_path = arguments.get("ckpt_path")
    check_resume_path(ckpt_path)
    check_resume_lora(ckpt_path, arguments.get("model"))
