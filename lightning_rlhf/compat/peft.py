"""Every place the package relies on how ``peft`` lays out a LoRA model beyond its public API, for the peft versions
in :data:`SUPPORTED_PEFT`.

Public peft serves where it can (``get_peft_model``, ``LoraConfig``, ``load_peft_weights``, ``save_pretrained``,
``unload``). What it does not offer is here, each a small function whose docstring names what it relies on, checked
against the installed peft by ``tests/unit/test_compat_peft.py``: an upgrade that changes one fails there, not in a
training run. Why ``>=0.17,<0.22``: checked on peft 0.21 (0.17 is the oldest this package was run with); a minor
release may rename the wrapper's prefixes or change the initialisation. To support a new one: install it, run the
test, fix what fails here, then move the bound here and in ``pyproject.toml``.

Runs on: any process (a leaf module: it imports nothing of ``lightning_rlhf``; peft itself only inside functions).
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "LORA_MARK",
    "SUPPORTED_PEFT",
    "adapter_layers",
    "base_layer_weight",
    "base_name",
    "config_scale",
    "fresh_value",
    "layer_scales",
    "merge_stream",
    "saved_key",
    "target_layers",
    "wrapped_name",
]

SUPPORTED_PEFT = ">=0.17,<0.22"
"""The peft versions this module is written (and tested) against; ``pyproject.toml`` states the same range."""
LORA_MARK = ".lora_"
"""What the names of adapter parameters contain (``...q_proj.lora_A.default.weight``)."""
_PREFIX = "base_model.model."
_SEED = 20261127
"""Base seed of the adapters' initial values (mixed with a CRC of the parameter's name): the same on every rank."""


def base_name(name: str) -> str:
    """The base model's name of a wrapped model's parameter: ``base_model.model.x.q_proj.base_layer.weight`` ->
    ``x.q_proj.weight`` (a ``modules_to_save`` copy maps to its original); adapters keep their own names. Relies on:
    ``PeftModel``'s ``base_model.model.`` prefix, ``LoraLayer``'s ``base_layer`` and ``ModulesToSaveWrapper``'s
    ``original_module`` / ``modules_to_save.<adapter>`` children. Runs on: any process.
    """
    name = name.removeprefix(_PREFIX)
    name = name.replace(".base_layer.", ".").replace(".original_module.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def wrapped_name(key: str, adapted: set[str]) -> str:
    """A base model's state key under the wrapped model's name (the inverse of :func:`base_name` for the base's
    own weights): ``x.q_proj.weight`` -> ``base_model.model.x.q_proj.base_layer.weight`` when
    ``base_model.model.x.q_proj`` is in ``adapted`` (the wrapped names of the adapted layers), else
    ``base_model.model.x.q_proj.weight``. Relies on: what :func:`base_name` relies on. Runs on: any process."""
    layer, _, leaf = f"{_PREFIX}{key}".rpartition(".")
    return f"{layer}.base_layer.{leaf}" if layer in adapted else f"{layer}.{leaf}"


def base_layer_weight(layer: str) -> str:
    """The wrapped name of an adapted layer's own weight (``<layer>.base_layer.weight``), ``layer`` its wrapped name.
    Relies on: ``LoraLayer``'s ``base_layer`` child. Runs on: any process."""
    return f"{layer}.base_layer.weight"


def saved_key(name: str) -> str:
    """The key under which peft saves a wrapped model's parameter (``adapter_model.safetensors``): the adapter's name
    dropped (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``,
    ``...score.modules_to_save.default.weight`` -> ``...score.weight``). Relies on: ``get_peft_model_state_dict``'s key
    format (a model-free form of it: a checkpoint's state needs no model). Runs on: any process."""
    name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
    return re.sub(r"\.(lora_[A-Za-z_]+)\.[^.]+\.", r".\1.", name)


def adapter_layers(names: Iterator[str] | list[str]) -> list[str]:
    """The adapted layers' wrapped names among parameter ``names`` (those with a ``lora_A``). Relies on: ``LoraLayer``'s
    ``lora_A`` child. Runs on: any process."""
    return sorted({name.split(".lora_A.")[0] for name in names if ".lora_A." in name})


def fresh_value(name: str, param: Tensor) -> Tensor:
    """The initial value of adapter parameter ``name`` as peft draws it (``lora_B``: zeros; ``lora_A``: Kaiming uniform
    with ``a = sqrt(5)``, that is uniform in ``+-1/sqrt(fan_in)``), seeded by the name: the same on every rank, without
    building the layer. Relies on: ``LoraLayer.reset_lora_parameters`` with ``init_lora_weights=True`` (peft's default).
    Runs on: every process."""
    if ".lora_B." in name or ".lora_embedding_B" in name:
        return torch.zeros(param.shape, dtype=param.dtype)
    fan_in = param.shape[1] if param.dim() > 1 else param.shape[0]
    bound = 1.0 / math.sqrt(max(1, fan_in))
    gen = torch.Generator().manual_seed(_SEED ^ zlib.crc32(name.encode()))
    return torch.empty(param.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen).to(param.dtype)


def layer_scales(model: nn.Module) -> dict[str, float]:
    """Each adapted layer's ``scale`` (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), by the layer's wrapped name
    (``base_model.model.x.q_proj``). Relies on: ``peft.tuners.lora.LoraLayer.scaling`` (a dict by adapter name; one
    adapter here). Runs on: any process."""
    from peft.tuners.lora import LoraLayer

    return {
        name: float(next(iter(module.scaling.values())))
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }


def config_scale(adapter_config: Mapping[str, Any]) -> float:
    """The ``scale`` of ``W + scale * B @ A`` from a saved ``adapter_config.json``: ``lora_alpha / r``, or ``lora_alpha
    / sqrt(r)`` with rsLoRA. Relies on: ``LoraLayer.update_layer``'s formula (what :func:`layer_scales` reads from a
    built model). Runs on: any process."""
    r, alpha = int(adapter_config["r"]), float(adapter_config["lora_alpha"])
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r


def target_layers(model: nn.Module, config: Any) -> list[tuple[str, nn.Linear]]:
    """The linear layers ``config.target_modules`` selects in ``model`` (``"all-linear"``: every linear layer but the
    output head and ``modules_to_save``), as ``get_peft_model`` will wrap them, found without wrapping (the model may be
    a skeleton on the meta device). Relies on: ``peft.tuners.tuners_utils.check_target_module_exists`` (a list or regex
    of names) and peft's ``"all-linear"`` rule (``_maybe_include_all_linear_layers``). Runs on: any process."""
    from peft.tuners.tuners_utils import check_target_module_exists

    head = getattr(model, "get_output_embeddings", lambda: None)()
    saved = set(config.modules_to_save or [])
    found: list[tuple[str, nn.Linear]] = []
    excluded = getattr(config, "exclude_modules", None)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head or not name:
            continue
        if isinstance(excluded, str) and re.fullmatch(excluded, name):
            continue
        if isinstance(excluded, (list, set)) and any(name == e or name.endswith("." + e) for e in excluded):
            continue
        if config.target_modules == "all-linear":
            if not saved.intersection(name.split(".")):
                found.append((name, module))
        elif check_target_module_exists(config, name):
            found.append((name, module))
    return found


def merge_stream(
    stream: Iterator[tuple[str, Tensor]], scales: Mapping[str, float], dtype: torch.dtype | None
) -> Iterator[tuple[str, Tensor]]:
    """The base model's weights by its names (:func:`base_name`) from a wrapped model's full tensors in
    ``named_parameters`` order, each adapted weight merged as ``W + scale * B @ A`` in float32 then cast to ``dtype`` (a
    layer's weight is held until its two adapters have passed; a layer's bias passes unchanged); adapters themselves are
    not yielded. ``scales``: each adapted layer's scale by its wrapped name. Relies on: ``LoraLayer``'s children
    (``base_layer``, ``lora_A.<adapter>``, ``lora_B.<adapter>``) and ``merge_and_unload``'s arithmetic for ``nn.Linear``
    (``get_delta_weight``: ``B @ A * scaling``). Runs on: any process (the hand-off's workers, the export)."""
    held: dict[str, dict[str, Tensor]] = {}
    for name, tensor in stream:
        layer = next((lay for lay in (name.rsplit(".", 3)[0], name.rsplit(".", 2)[0]) if lay in scales), None)
        part = None if layer is None else _part(name)
        if layer is None or part is None:  # not adapted, or the base layer's bias
            yield base_name(name), tensor if dtype is None else tensor.to(dtype)
            continue
        parts = held.setdefault(layer, {})
        parts[part] = tensor
        if len(parts) == 3:
            merged = torch.addmm(parts["W"].float(), parts["B"].float(), parts["A"].float(), alpha=scales[layer])
            del held[layer]
            yield base_name(base_layer_weight(layer)), merged if dtype is None else merged.to(dtype)
    if held:
        raise RuntimeError(f"merge: adapted layers with missing parts: {sorted(held)[:4]}")


def _part(name: str) -> str | None:
    if ".lora_A." in name:
        return "A"
    if ".lora_B." in name:
        return "B"
    return "W" if name.endswith(".base_layer.weight") else None
