"""Where prompts come from (a ``datasets`` object, a local file or folder, or a hub dataset name), and the
validation rows split off the training data. Runs on: every process (``datasets`` locks its cache, so concurrent
loads of one hub dataset download it once)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

__all__ = ["FILE_BUILDERS", "load_prompt_dataset", "split_off"]

FILE_BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}
"""Data-file extensions and the ``datasets`` builder that reads each."""


def load_prompt_dataset(source: Any, *, setting: str, config: str | None = None, split: str = "train") -> Any:
    """Load ``source`` as a ``datasets.Dataset``.

    Runs on: any process, before any model is loaded.

    Args:
        source: a ``datasets.Dataset``; a ``datasets.DatasetDict`` (``split`` is taken); a ``.jsonl``/``.json``/
            ``.parquet``/``.csv`` file; a local folder (data files named by split, e.g. ``train.jsonl``, or written by
            ``save_to_disk``); or a hub dataset name: ``datasets.load_dataset(source, config, split=split)``.
        setting: the argument it came from, for error messages (``"train"`` or ``"val"``).
        split: any ``datasets`` split expression (``"test[:200]"``); single files have one split and ignore it.

    Raises:
        FileNotFoundError: a data file that does not exist, or a name that is neither a local path nor a hub
            dataset this machine can reach (offline machines need it in the ``datasets`` cache).
        ValueError: an unknown file type, split or configuration.
        TypeError: any other kind of ``source``.
    """
    import datasets

    where = f"PromptDataModule({setting}={source!r})"
    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, datasets.DatasetDict):
        if split not in source:
            raise ValueError(
                f"PromptDataModule({setting}=DatasetDict): no split {split!r}; it has {sorted(source)}. "
                f"HINT: pass {setting}_split=<one of those> (or the split itself as {setting}=...)."
            )
        return source[split]
    if not isinstance(source, str | os.PathLike):
        raise TypeError(
            f"PromptDataModule({setting}=...) expects a datasets.Dataset, a file or folder path, or a hub dataset "
            f"name, got {type(source).__name__}."
        )
    path = os.fspath(source)
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if os.path.isfile(path):
        builder = FILE_BUILDERS.get(ext)
        if builder is None:
            raise ValueError(
                f"{where}: unknown file type '.{ext}'. Expected .jsonl, .json, .parquet or .csv "
                "(or a folder, or a hub dataset name)."
            )
        return datasets.load_dataset(builder, data_files=path, split="train")
    if ext in FILE_BUILDERS:
        raise FileNotFoundError(f"{where}: no such file.")
    saved = any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))
    if os.path.isdir(path) and saved:  # written by save_to_disk
        return load_prompt_dataset(datasets.load_from_disk(path), setting=setting, split=split)
    try:
        return datasets.load_dataset(path, config, split=split)
    except Exception as err:
        kind = "the local folder" if os.path.isdir(path) else "a hub dataset (no local file or folder has this name)"
        message = (
            f"{where}: could not load {kind} with config={config!r}, split={split!r}: "
            f"{type(err).__name__}: {err}. HINT: check the name, `{setting}_split` and `dataset_config`; an offline "
            "machine (HF_HUB_OFFLINE=1) needs the dataset in its datasets cache; or pass a local .jsonl, .parquet "
            "or .csv file."
        )
        if isinstance(err, FileNotFoundError | ConnectionError):
            raise FileNotFoundError(message) from err
        raise ValueError(message) from err


def split_off(dataset: Any, size: float | int, *, seed: int) -> tuple[Any, Any]:
    """Split ``size`` rows (an int) or a fraction of the rows (a float in (0, 1)) off ``dataset``, at random with
    ``seed``: the same rows on every rank and in every run with that seed. Runs on: any process. Returns ``(train,
    val)``; nothing is written to the ``datasets`` cache (ranks would race on its files)."""
    total = len(dataset)
    count = size if isinstance(size, int) else math.ceil(size * total)  # datasets rounds the test part up
    if count < 1 or count >= total:
        raise ValueError(
            f"PromptDataModule(val_size={size!r}): splits {count} of the {total} training rows off for "
            "validation; at least 1 must go to each side. HINT: a fraction in (0, 1) or a row count below "
            f"{total}."
        )
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    val, train = sorted(order[:count]), sorted(order[count:])  # both keep the file's row order
    return dataset.select(train, keep_in_memory=True), dataset.select(val, keep_in_memory=True)
