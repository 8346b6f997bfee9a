"""Sharded loading: build role models with their parameters on the meta device, shard them with FSDP2 while
they hold no memory, then let each rank read only its own rows from the safetensors checkpoint.

    with deferred_loading():                        # the strategy, while the roles load
        model = load_pretrained(AutoModelForCausalLM, path, setting="RLHFModule(actor=...)")
    shard_model(model, mesh)                         # fully_shard on meta: nothing allocated yet
    report = materialize(model, device=device)       # this rank's rows, straight from the file

Why not ``from_pretrained`` then shard: every rank would hold the whole model in float32 at once before FSDP2
frees all but its shard; here a rank's peak is its shard plus one tensor's rows in flight (docs/architecture.md).
Why not torch's ``HuggingFaceStorageReader``: it keeps a rank's rows of a whole file mapped (and counted in the
resident size) until the file is done, and needs a load plan (a collective), while the name matching would
still be ours.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import math
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_rlhf.compat.torch import local_shape_and_offset, put_buffer, put_parameter

__all__ = [
    "LoadReport",
    "deferred_loading",
    "load_pretrained",
    "loading_deferred",
    "materialize",
    "needs_materialize",
    "safetensors_index",
]

_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_rlhf_deferred_loading", default=False)
_SOURCE_ATTR = "_lightning_rlhf_load_source"
_FRESH_SEED = 20240611
"""Base seed of freshly initialised parameters (mixed with a CRC of the parameter's name): the same on every rank."""
_MODEL_KWARGS = frozenset({"attn_implementation", "trust_remote_code", "experts_implementation"})
"""``from_pretrained`` keyword arguments that go to ``from_config`` (all others update the config)."""

_DTYPES: dict[str, torch.dtype] = {  # safetensors dtype codes (``get_slice(key).get_dtype()``) read here
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors checkpoint: the file holding it, its key there, its dtype and shape."""

    file: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def rows(self) -> int:  # a 0-dim tensor is one row
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:  # in the file
        return (math.prod(self.shape[1:]) if self.shape else 1) * self.dtype.itemsize


@dataclass(frozen=True)
class _Source:
    """What :func:`materialize` needs, recorded on the model by :func:`load_pretrained`."""

    path: str
    dtype: torch.dtype
    setting: str
    entries: dict[str, _Entry]  # model name (parameter or persistent buffer) -> checkpoint tensor
    fresh: tuple[str, ...]  # parameters the checkpoint does not hold (a new head): initialised fresh
    init_std: float
    fresh_value: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None  # a wrapper's own fresh values


@dataclass
class LoadReport:
    """What one :func:`materialize` call did on this rank: the bytes it read (this rank's rows), the parameters
    and buffers it filled, its wall time, the parameters initialised fresh (e.g. a new ``score`` head), the bytes of
    this rank's parameter storage, of the largest full parameter, and of all the model's tensors in the checkpoint."""

    bytes_read: int = 0
    tensors: int = 0
    seconds: float = 0.0
    fresh: list[str] = field(default_factory=list)
    local_bytes: int = 0
    largest_tensor_bytes: int = 0
    checkpoint_bytes: int = 0


@contextmanager
def deferred_loading(enabled: bool = True) -> Iterator[None]:
    """Inside this context :func:`load_pretrained` (with ``deferred=None``) builds models on the meta device.
    Runs on: every worker rank (the strategy enters it around the roles' ``load``). Nests; restores on exit."""
    token = _DEFERRED.set(bool(enabled))
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def loading_deferred() -> bool:
    """True inside :func:`deferred_loading` (``enabled=True``). Runs on: any process."""
    return _DEFERRED.get()


def rename_source(
    base: nn.Module,
    wrapped: nn.Module,
    to_base: Callable[[str], str],
    fresh_value: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None,
) -> None:
    """Carry the checkpoint plan of a deferred ``base`` model over to ``wrapped`` (the same modules under other names,
    e.g. a ``peft`` model): each of ``wrapped``'s tensors reads the entry of ``to_base(name)``; its parameters that
    map to nothing of ``base`` (adapters) start fresh, from ``fresh_value(name, param)`` where it gives a value.
    Nothing happens for a model loaded whole. Runs on: every process (a role's ``load``, before sharding).
    """
    source: _Source | None = base.__dict__.get(_SOURCE_ATTR)
    if source is None:
        return
    tensors = [*wrapped.named_buffers(), *wrapped.named_parameters()]
    entries = {name: source.entries[to_base(name)] for name, _ in tensors if to_base(name) in source.entries}
    # a fresh head of the base, or a parameter the base does not have (an adapter)
    fresh = tuple(name for name, _ in wrapped.named_parameters() if to_base(name) not in source.entries)
    renamed = dataclasses.replace(source, entries=entries, fresh=fresh, fresh_value=fresh_value)
    setattr(wrapped, _SOURCE_ATTR, renamed)


def needs_materialize(model: nn.Module) -> bool:
    """True when ``model`` came from a deferred :func:`load_pretrained` and still has parameters on meta. Runs on:
    any process."""
    return getattr(model, _SOURCE_ATTR, None) is not None and any(p.is_meta for p in model.parameters())


def _open(file: str, *, setting: str) -> safe_open:
    """``safe_open(file, framework="pt")``, a file that is not a complete safetensors file refused naming the
    setting."""
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as err:
        raise ValueError(
            f"{setting}: {file} is not a readable safetensors file ({err}). HINT: the file is truncated or "
            "corrupt; download the checkpoint again, or re-save it with save_pretrained(..., safe_serialization=True)."
        ) from None


def _read_header(file: str, *, setting: str) -> dict[str, _Entry]:
    """Every tensor of one safetensors file: key -> dtype and shape (reads only the header)."""
    entries: dict[str, _Entry] = {}
    with _open(file, setting=setting) as f:
        for key in f.keys():  # noqa: SIM118 - a safe_open is not iterable
            view = f.get_slice(key)
            code = view.get_dtype()
            dtype = _DTYPES.get(code)
            if dtype is None:
                raise ValueError(
                    f"{setting}: tensor {key!r} in {file} has dtype {code}, which deferred loading does not read. "
                    "HINT: use RLHFStrategy(sharded_loading=False), or convert the checkpoint."
                )
            entries[key] = _Entry(file, key, dtype, tuple(int(s) for s in view.get_shape()))
    return entries


def _locate(path: str, name: str) -> str | None:
    """A checkpoint file of ``path`` (a local folder, or a hub id's cached snapshot), or None."""
    if os.path.isdir(path):
        candidate = os.path.join(path, name)
        return candidate if os.path.isfile(candidate) else None
    from transformers.utils import cached_file

    try:
        return cached_file(path, name, _raise_exceptions_for_missing_entries=False)
    except OSError:
        return None


def safetensors_index(path: str, *, setting: str = "model") -> dict[str, _Entry]:
    """Every tensor of the checkpoint at ``path`` (sharded via ``model.safetensors.index.json``, or one file):
    key -> file, dtype and shape, from the headers only. Runs on: any process.

    Raises:
        FileNotFoundError: no safetensors files there (naming ``setting``).
        ValueError: a file is not a complete safetensors file, or holds a dtype not read here.
    """
    index = _locate(path, "model.safetensors.index.json")
    if index is not None:
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        folder = os.path.dirname(index)
        entries: dict[str, _Entry] = {}
        for file in sorted(set(weight_map.values())):
            local = os.path.join(folder, file) if os.path.isdir(path) else _locate(path, file)
            if local is None or not os.path.isfile(local):
                raise FileNotFoundError(
                    f"{setting}={path!r}: {file} (listed in model.safetensors.index.json) is missing. "
                    "HINT: download the whole checkpoint again."
                )
            entries.update(_read_header(local, setting=f"{setting}={path!r}"))
        return entries
    single = _locate(path, "model.safetensors")
    if single is None:
        raise FileNotFoundError(
            f"{setting}={path!r}: no model.safetensors or model.safetensors.index.json there; deferred (sharded) "
            "loading reads only safetensors. HINT: re-save the model with save_pretrained(..., "
            "safe_serialization=True), or load it without deferred loading."
        )
    return _read_header(single, setting=f"{setting}={path!r}")


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (buffers stay where they are built). Not
    thread-safe: patches ``nn.Module.register_parameter``. A parameter already on meta is registered as is, so weight
    tying keeps one shared parameter."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            kind = type(param)
            put_parameter(module, name, kind(param.to("meta"), requires_grad=param.requires_grad))

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _checkpoint_keys(model: nn.Module, name: str) -> list[str]:
    """The keys under which a checkpoint may hold model tensor ``name``: itself and the names of parameters tied to
    it, each with or without the base model's prefix (a bare ``Qwen2Model`` checkpoint has ``layers.*``)."""
    names = [name]
    tied: dict[str, str] = getattr(model, "all_tied_weights_keys", None) or {}
    names += [target for target, source in tied.items() if source == name]
    prefix = getattr(model, "base_model_prefix", "") or ""
    keys: list[str] = []
    for n in names:
        keys.append(n)
        if prefix:
            keys.append(n[len(prefix) + 1 :] if n.startswith(prefix + ".") else f"{prefix}.{n}")
    return keys


def _is_head(model: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` lies outside the base model (a task head such as ``score`` or ``lm_head``)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    return isinstance(base, nn.Module) and base is not model and not name.startswith(prefix + ".")


def _plan(
    model: nn.Module, entries: dict[str, _Entry], *, path: str, setting: str
) -> tuple[dict[str, _Entry], list[str]]:
    """Match every parameter and persistent buffer of ``model`` to a checkpoint tensor (ValueError naming what is
    missing or mis-shaped); a task head the checkpoint's architecture lacks (e.g. ``score.*``) is returned fresh."""
    config = getattr(model, "config", None)
    architectures = list(getattr(config, "architectures", None) or [])
    new_head = type(model).__name__ not in architectures  # built as another class than the checkpoint was saved as
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    persistent = [n for n in model.state_dict(keep_vars=True) if n in buffers]
    matched: dict[str, _Entry] = {}
    fresh: list[str] = []
    missing: list[str] = []
    mismatched: list[str] = []
    for name, tensor in [*params.items(), *((n, buffers[n]) for n in persistent)]:
        entry = next((entries[k] for k in _checkpoint_keys(model, name) if k in entries), None)
        if entry is None:
            if name in params and ((new_head and _is_head(model, name)) or any(p.search(name) for p in ignore)):
                fresh.append(name)
            elif name in params:
                missing.append(name)
            continue  # a persistent buffer absent from the checkpoint keeps its built value (as from_pretrained)
        if entry.shape != tuple(tensor.shape):
            mismatched.append(f"{name} (checkpoint {list(entry.shape)}, model {list(tensor.shape)})")
            continue
        matched[name] = entry
    if missing or mismatched:
        parts = []
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            parts.append(f"{len(missing)} tensor(s) the model needs are missing from the checkpoint: {shown}")
        if mismatched:
            more = f" and {len(mismatched) - 8} more" if len(mismatched) > 8 else ""
            parts.append("shapes differ: " + ", ".join(mismatched[:8]) + more)
        raise ValueError(
            f"{setting}={path!r}: {'; '.join(parts)}. HINT: check that the folder holds the complete checkpoint of "
            f"this model (config.json and the safetensors files from the same save), or re-save it with "
            "save_pretrained. A model whose checkpoint transformers renames while loading (legacy names, fused "
            "experts) loads with RLHFStrategy(sharded_loading=False)."
        )
    return matched, fresh


def load_pretrained(
    auto_class: type,
    path: str,
    *,
    setting: str,
    dtype: torch.dtype = torch.float32,
    deferred: bool | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Load a transformers model: whole (``from_pretrained``), or deferred with parameters on meta.

    Runs on: every worker rank (each builds its own copy; deferred, nothing is read but the headers).

    Args:
        setting: The user setting that named ``path`` (e.g. ``"CriticRole(path=...)"``), for error messages.
        dtype: Storage dtype of the parameters (the checkpoint's tensors are converted to it as they are read).
        deferred: None follows :func:`loading_deferred`. False: ``auto_class.from_pretrained(path, dtype=dtype,
            **kwargs)``. True: ``auto_class.from_config`` with every parameter on the meta device (buffers real),
            in eval mode like ``from_pretrained``; call :func:`materialize` (after sharding) before use.
        **kwargs: As for ``from_pretrained`` (e.g. ``num_labels=1``); ``attn_implementation`` and
            ``trust_remote_code`` go to ``from_config``, the rest update the config.

    Raises:
        FileNotFoundError: deferred, and ``path`` has no safetensors checkpoint.
        ValueError: deferred, and the checkpoint lacks a tensor the model needs (other than a new task head's), or
            holds one with another shape. Both are raised before any weight is allocated.
    """
    from transformers import AutoConfig, GenerationConfig

    from lightning_rlhf.compat.transformers import checkpoint_key_renamer
    from lightning_rlhf.engines.train.vision import causal_lm_class

    if deferred is None:
        deferred = loading_deferred()
    config_kwargs = {k: v for k, v in kwargs.items() if k not in _MODEL_KWARGS or k == "trust_remote_code"}
    model_kwargs = {k: v for k, v in kwargs.items() if k in _MODEL_KWARGS}
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    auto_class = causal_lm_class(auto_class, config)  # a vision-language model: AutoModelForImageTextToText
    if not deferred:
        model: nn.Module = auto_class.from_pretrained(path, dtype=dtype, **kwargs)  # type: ignore[attr-defined]
        return model
    entries = safetensors_index(path, setting=setting)  # the files exist and their headers parse
    with _parameters_on_meta():
        model = auto_class.from_config(config, dtype=dtype, **model_kwargs)  # type: ignore[attr-defined]
    rename = checkpoint_key_renamer(model)  # legacy names transformers renames while loading (Qwen2-VL's)
    if rename is not None:
        entries = {rename(k): v for k, v in entries.items()}
    matched, fresh = _plan(model, entries, path=path, setting=setting)
    std = getattr(config, "initializer_range", None) or 0.02
    setattr(model, _SOURCE_ATTR, _Source(path, dtype, setting, matched, tuple(fresh), float(std)))
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate():  # as from_pretrained: the folder's generation_config.json
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:
            generation = GenerationConfig.from_pretrained(path, config_file_name="config.json", _from_model_config=True)
        model.generation_config = generation  # type: ignore[assignment]
    return model.eval()


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(local tensor, first row, row count)`` of this rank: FSDP2 ``Shard(0)`` rows, or the whole tensor."""
    if not isinstance(param, DTensor):
        return param, 0, (param.shape[0] if param.dim() else 1)
    local = param.to_local()
    shape, offset = local_shape_and_offset(param)
    full = tuple(param.shape)
    if tuple(shape) != tuple(local.shape) or tuple(shape[1:]) != full[1:] or any(offset[1:]):
        raise NotImplementedError(
            f"materialize reads row blocks (FSDP2 Shard(0)); this parameter is placed as {param.placements} "
            f"(local {list(local.shape)} of {list(full)})."
        )
    count = local.shape[0] if local.dim() else 1
    return local, (int(offset[0]) if full else 0), count


def _fresh_full(model: nn.Module, name: str, param: torch.Tensor, std: float) -> torch.Tensor:
    """The full initial value of a parameter the checkpoint lacks, the same on every rank (seeded by its name):
    biases zeros, norm weights ones, other weights normal(0, std)."""
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(param.shape, dtype=param.dtype)
    if "Norm" in type(owner).__name__:
        return torch.ones(param.shape, dtype=param.dtype)
    gen = torch.Generator().manual_seed(_FRESH_SEED ^ zlib.crc32(name.encode()))
    return torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen).to(param.dtype)


def _read_rows(entry: _Entry, first: int, count: int, dest: torch.Tensor, *, setting: str) -> int:
    """Fill ``dest`` (``count`` rows, any dtype and device) with rows ``[first, first+count)`` of ``entry``;
    returns the bytes read from the file. The rows are a view of the file's memory map (only those pages are read),
    cast by ``copy_``. The file is opened for this one tensor and unmapped before the next: mapped pages count in
    the resident size, and this way no more than one tensor's rows are ever mapped.
    """
    nbytes = count * entry.row_bytes
    if nbytes == 0:
        return 0
    with _open(entry.file, setting=setting) as f:
        try:
            view = f.get_slice(entry.key)
        except SafetensorError as err:
            raise ValueError(
                f"{setting}: {entry.file} no longer holds tensor {entry.key!r} ({err}). HINT: the checkpoint "
                "changed after load_pretrained read it; load the model again."
            ) from None
        rows = view[first : first + count] if entry.shape else view[...]
        dest.detach().copy_(rows.view(dest.shape))
        del rows, view  # the map stays alive while a view of it does
    return nbytes


def _allocate(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter uninitialised storage on ``device``; shared (tied) parameters stay shared and
    buffers keep their values."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        # FSDP2's _apply re-registers (and pads) its sharded parameters; to_empty re-allocates the buffers too,
        # uninitialised, so keep the built values and put them back.
        kept = [
            (module, name, buf)
            for module in model.modules()
            for name, buf in module.named_buffers(recurse=False, remove_duplicate=False)
            if not buf.is_meta
        ]
        model.to_empty(device=device)
        for module, name, buf in kept:
            put_buffer(module, name, buf.to(device))
    else:  # nn.Module.to_empty would give each holder of a tied parameter its own copy
        new: dict[int, nn.Parameter] = {}
        old: list[nn.Parameter] = []  # alive until the end, so no id is reused
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                if not param.is_meta:
                    continue
                if id(param) not in new:
                    old.append(param)
                    new[id(param)] = type(param)(
                        torch.empty_like(param, device=device), requires_grad=param.requires_grad
                    )
                put_parameter(module, name, new[id(param)])
        for module in model.modules():
            for name, maybe in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                if maybe.device != device:
                    put_buffer(module, name, maybe.to(device))


def materialize(model: nn.Module, *, device: torch.device | str) -> LoadReport:
    """Allocate every meta parameter's local storage on ``device`` and fill it with exactly its rows.

    Call after ``fully_shard`` (:func:`~lightning_rlhf.engines.train.fsdp.shard_model`) and before the first
    forward, or on an unsharded model (whole tensors). A DTensor parameter (FSDP2 ``Shard(0)``) gets rows
    ``[r*ceil(n/w), min((r+1)*ceil(n/w), n))``, cast on the way as ``from_pretrained(dtype=...)`` casts. Parameters
    the checkpoint lacks (a new head) get a deterministic full initial value, the same on every rank (weights
    normal(0, ``config.initializer_range``), biases zeros, norm weights ones), then this rank's rows. Buffers keep
    the values they were built with (persistent ones in the checkpoint are read whole).

    Runs on: every worker rank (no collective; every rank reads its own rows).

    Raises:
        ValueError: ``model`` did not come from a deferred :func:`load_pretrained`, or a checkpoint file changed since.
    """
    began = time.perf_counter()
    source: _Source | None = getattr(model, _SOURCE_ATTR, None)
    if source is None:
        raise ValueError(
            f"materialize() got a {type(model).__name__} that was not built by load_pretrained(..., deferred=True). "
            "HINT: load it with load_pretrained inside deferred_loading(), or do not call materialize on it."
        )
    _allocate(model, torch.device(device))
    report = LoadReport(
        fresh=list(source.fresh), checkpoint_bytes=sum(e.rows * e.row_bytes for e in source.entries.values())
    )
    setting = f"{source.setting}={source.path!r}"
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, first, count = _local_rows(param)
            report.local_bytes += local.numel() * local.element_size()
            report.largest_tensor_bytes = max(report.largest_tensor_bytes, param.numel() * param.element_size())
            entry = source.entries.get(name)
            if entry is not None:
                report.bytes_read += _read_rows(entry, first, count, local, setting=setting)
                report.tensors += 1
            elif name in source.fresh:
                given = source.fresh_value(name, param) if source.fresh_value is not None else None
                full = given if given is not None else _fresh_full(model, name, param, source.init_std)
                local.copy_(full.narrow(0, first, count) if full.dim() else full)
            else:  # cannot happen: load_pretrained checked every parameter
                raise RuntimeError(f"{source.setting}: no source for parameter {name}")
        buffers = dict(model.named_buffers())
        for name, entry in source.entries.items():
            if name in buffers:
                report.bytes_read += _read_rows(entry, 0, entry.rows, buffers[name], setting=setting)
                report.tensors += 1
    report.seconds = time.perf_counter() - began
    return report
