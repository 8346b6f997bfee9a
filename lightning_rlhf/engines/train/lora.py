"""LoRA adapters on a role's model, through ``peft`` (docs/lora.md).

:func:`apply_lora` wraps the transformers model in a ``peft.PeftModel`` before FSDP2 shards it, so only the adapters
(and a critic's value head) require gradients; deferred loading starts the adapters as ``peft`` does, seeded by
their names so every rank builds the same values. The rollout engines take plain weights (:func:`merged_weights`).
What this relies on of peft beyond its public API lives in :mod:`lightning_rlhf.compat.peft`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rlhf.compat.peft import (
    LORA_MARK,
    base_name,
    fresh_value,
    layer_scales,
    merge_stream,
    saved_key,
    target_layers,
)
from lightning_rlhf.engines.train.fsdp import whole

__all__ = [
    "adapter_start",
    "adapter_tensors",
    "apply_lora",
    "base_weights",
    "check_lora_model",
    "has_lora",
    "merged_specs",
    "merged_weights",
    "resolve_lora",
    "unadapted_copy",
    "write_adapter",
]

_START_ATTR = "lightning_rlhf_adapter_path"
"""Attribute of a resolved ``LoraConfig`` naming the adapter folder its adapters start from (``lora="folder"``)."""
_FIELDS = (
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "modules_to_save",
    "bias",
    "use_rslora",
    "layers_to_transform",
)


def resolve_lora(
    lora: Any,
    *,
    setting: str,
    task_type: str,
    modules_to_save: list[str] | None = None,
    model: str | None = None,
) -> Any:
    """A ``peft.LoraConfig`` for a role from what the user gave (None, a ``LoraConfig``, its fields as a dict, or the
    folder of a saved peft adapter to start from), checked before any model is built; None when ``lora`` is None.

    ``target_modules`` not given is ``"all-linear"``; a dict without ``lora_alpha`` gets ``2 * r`` (peft's own
    default is 8 whatever the rank). A folder takes the saved adapter's settings and, at load, its weights as the
    starting point (:func:`adapter_start`). ``task_type``: ``CAUSAL_LM`` (actor) or ``TOKEN_CLS`` (critic).
    ``model``: the role's model, whose ``config.json`` the targets and the rank are checked against.

    Runs on: the launching process (the module's constructor), before any process starts.

    Raises:
        ValueError: an unknown field, a rank that is not a positive integer, dropout outside [0, 1), a ``bias``
            other than ``none``, a folder without a peft LoRA adapter, or (with ``model``) targets that match no
            linear layer or a rank larger than a targeted layer takes.
    """
    if lora is None:
        return None
    from peft import LoraConfig

    start: str | None = None
    if isinstance(lora, Mapping):
        unknown = sorted(set(lora) - set(_FIELDS))
        if unknown:
            raise ValueError(
                f"{setting}: unknown LoRA field(s) {unknown}. HINT: use {list(_FIELDS)} (peft.LoraConfig's names)."
            )
        config = LoraConfig(**{"target_modules": "all-linear", "lora_alpha": 2 * int(lora.get("r", 8)), **lora})
    elif isinstance(lora, LoraConfig):
        config = dataclasses.replace(lora, target_modules=lora.target_modules or "all-linear")
    elif isinstance(lora, str | os.PathLike):
        config = _saved_adapter_config(os.fspath(lora), setting=setting)
        start = os.path.abspath(os.fspath(lora))
    else:
        raise ValueError(
            f"{setting}={lora!r} is invalid: expected None, a peft.LoraConfig, a dict of its fields or a saved "
            "adapter's folder. HINT: lora={'r': 16, 'lora_alpha': 32} (target_modules defaults to 'all-linear')."
        )
    if not isinstance(config.r, int) or isinstance(config.r, bool) or config.r < 1:
        raise ValueError(f"{setting}: LoRA rank r={config.r!r} is invalid. HINT: a positive integer, e.g. 8 or 16.")
    if not 0.0 <= float(config.lora_dropout) < 1.0:
        raise ValueError(f"{setting}: lora_dropout={config.lora_dropout!r} must be in [0, 1). HINT: 0.0 for RL.")
    if config.bias != "none":
        raise ValueError(
            f"{setting}: LoRA bias={config.bias!r} is not supported: it trains the base model's biases, which "
            "every hand-off would then carry in full. HINT: bias='none'."
        )
    config.task_type = task_type
    config.inference_mode = False
    if modules_to_save:
        config.modules_to_save = sorted({*(config.modules_to_save or []), *modules_to_save})
    if start is not None:
        setattr(config, _START_ATTR, start)
    if model is not None:
        check_lora_model(config, model, setting=setting)
    return config


VISION_TOWER_MODULES = r".*\bvisual\b.*"
"""peft's ``exclude_modules`` for a vision-language model's ``"all-linear"`` adapters: the language model's layers only
(the vision tower is frozen by default, and vLLM serves adapters on the language model only)."""


def _saved_adapter_config(folder: str, *, setting: str) -> Any:
    """The ``LoraConfig`` of a folder written by peft's ``save_pretrained`` (its ``adapter_config.json``)."""
    from peft import LoraConfig

    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, "adapter_model.safetensors")):
        raise ValueError(
            f"{setting}={folder!r}: not a saved peft adapter (no adapter_config.json and adapter_model.safetensors "
            "there). HINT: pass the folder peft's save_pretrained wrote (an SFT LoRA run's <run folder>/actor/adapter, "
            "or `lightning-rlhf export CKPT OUT` of its checkpoint), or lora={'r': 16, ...} for fresh adapters."
        )
    with open(path) as f:
        kind = json.load(f).get("peft_type")
    if kind != "LORA":
        raise ValueError(f"{setting}={folder!r}: the adapter is {kind!r}, not LoRA. HINT: a LoRA adapter's folder.")
    return LoraConfig.from_pretrained(folder)


def adapter_start(config: Any) -> str | None:
    """The saved adapter folder ``config``'s adapters start from, or None: fresh adapters. Runs on: any process."""
    return getattr(config, _START_ATTR, None)


def _start_values(wrapped: nn.Module, folder: str, *, setting: str) -> dict[str, Tensor]:
    """The saved adapter's ``lora_A``/``lora_B`` tensors by the wrapped model's parameter names; every adapter
    parameter of ``wrapped`` must have one. A saved ``modules_to_save`` copy is not used (as in a fresh run)."""
    from peft import load_peft_weights

    saved = load_peft_weights(folder, device="cpu")
    values = {
        name: saved[saved_key(name)]
        for name, _ in wrapped.named_parameters()
        if LORA_MARK in name and saved_key(name) in saved
    }
    missing = [name for name, _ in wrapped.named_parameters() if LORA_MARK in name and name not in values]
    wrong = [n for n, p in wrapped.named_parameters() if n in values and tuple(values[n].shape) != tuple(p.shape)]
    if missing or wrong:
        raise ValueError(
            f"{setting}={folder!r}: the saved adapter does not fit this model: "
            f"{'no tensor for ' + str(missing[:3]) if missing else 'other shapes for ' + str(wrong[:3])}. HINT: start "
            "from an adapter trained on this model (its adapter_config.json's base_model_name_or_path)."
        )
    return values


def check_lora_model(config: Any, model: str, *, setting: str) -> None:
    """Check ``config``'s targets and rank against the model at ``model`` (a folder or hub id), built from its
    ``config.json`` on the meta device. Runs on: the launching process, before any weight loads.

    Raises:
        ValueError: as :func:`apply_lora` does (no target matched; a rank larger than a targeted layer takes).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from lightning_rlhf.engines.train.vision import causal_lm_class, is_vision_language

    critic = config.task_type == "TOKEN_CLS"
    model_config = AutoConfig.from_pretrained(model, **({"num_labels": 1} if critic else {}))
    auto: Any = AutoModelForTokenClassification if critic else causal_lm_class(AutoModelForCausalLM, model_config)
    if is_vision_language(model_config) and config.target_modules == "all-linear" and not config.exclude_modules:
        config.exclude_modules = VISION_TOWER_MODULES
    with torch.device("meta"):
        skeleton = auto.from_config(model_config)
    _check_targets(skeleton, config, setting=setting)


def _check_targets(model: nn.Module, config: Any, *, setting: str) -> None:
    """Fail, naming the setting and the fix, when ``config`` targets no linear layer of ``model`` or its rank exceeds
    the smaller dimension of a targeted layer."""
    targets = target_layers(model, config)
    if not targets:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        given = config.target_modules
        shown = given if isinstance(given, str) else sorted(given)
        raise ValueError(
            f"{setting}: LoRA target_modules={shown!r} matches no linear layer of "
            f"{type(model).__name__}. HINT: name some of its linear layers, e.g. {linears[:8]}, or 'all-linear'."
        )
    bound = min(min(m.in_features, m.out_features) for _, m in targets)
    if config.r > bound:
        name, layer = next((n, m) for n, m in targets if min(m.in_features, m.out_features) == bound)
        kinds = sorted({n.rsplit(".", 1)[-1] for n, m in targets if config.r > min(m.in_features, m.out_features)})
        raise ValueError(
            f"{setting}: LoRA rank r={config.r} exceeds the smaller dimension of the targeted {'/'.join(kinds)} "
            f"layers (the smallest: {name}, {layer.in_features} x {layer.out_features}). HINT: r <= {bound} (the "
            "smallest bound over every targeted layer), or leave the smaller layers out of target_modules."
        )


def apply_lora(model: nn.Module, config: Any, *, setting: str) -> nn.Module:
    """``model`` wrapped in a ``peft.PeftModel`` with ``config``'s adapters (only they, and ``modules_to_save``,
    require gradients); a deferred model keeps its checkpoint plan, renamed. The adapters start fresh (``lora_B``
    zero), or from the saved adapter of :func:`adapter_start`.

    Runs on: every process (a role's ``load``, before FSDP2 shards the model).

    Raises:
        ValueError: ``target_modules`` selects no linear layer, or the rank exceeds the smaller dimension of a
            selected layer; a saved adapter that does not fit the model.
    """
    from peft import get_peft_model

    from lightning_rlhf.engines.train.loading import rename_source

    _check_targets(model, config, setting=setting)
    wrapped: nn.Module = get_peft_model(model, config)  # type: ignore[arg-type]
    folder = adapter_start(config)
    start = _start_values(wrapped, folder, setting=setting) if folder is not None else {}

    def initial(name: str, param: Tensor) -> Tensor | None:
        if name in start:
            return start[name].to(param.dtype)
        return fresh_value(name, param) if LORA_MARK in name else None

    rename_source(model, wrapped, base_name, initial)
    if not any(p.is_meta for p in wrapped.parameters()):  # loaded whole: the same start on every rank
        with torch.no_grad():
            for name, param in wrapped.named_parameters():
                value = initial(name, param)
                if value is not None:
                    param.copy_(value)
    return wrapped


def has_lora(model: nn.Module | None) -> bool:
    """Whether ``model`` is a ``peft`` model with adapters. Runs on: any process."""
    return model is not None and any(LORA_MARK in name for name, _ in model.named_parameters())


def merged_weights(
    model: nn.Module, stream: Iterator[tuple[str, Tensor]], dtype: torch.dtype | None
) -> Iterator[tuple[str, Tensor]]:
    """The base model's weights, by its names, from ``stream`` (the wrapped model's full tensors in order): each
    adapted weight merged as ``W + scale * B @ A`` in float32, then cast to ``dtype``. Runs on: every worker rank."""
    return merge_stream(stream, layer_scales(model), dtype)


def merged_specs(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of each tensor :func:`merged_weights` yields for ``model``, in its order. Runs on: any
    process (no data: meta tensors)."""
    meta = ((name, torch.empty(p.shape, device="meta")) for name, p in model.named_parameters())
    return [(name, tuple(t.shape)) for name, t in merged_weights(model, meta, None)]


def base_weights(stream: Iterator[tuple[str, Tensor]], dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
    """The base model's own weights (adapters left out, not merged) by its names, from a wrapped model's full
    tensors. Runs on: every worker rank."""
    for name, tensor in stream:
        if LORA_MARK not in name:
            yield base_name(name), tensor if dtype is None else tensor.to(dtype)


def adapter_tensors(model: nn.Module, received: list[int] | None = None) -> dict[str, Tensor]:
    """The adapters' full tensors by the wrapped model's names (an all-gather per sharded adapter, in the same
    order on every rank of the role). Runs on: every worker rank of the role."""
    with torch.no_grad():
        return {n: whole(p.data, received).detach().cpu() for n, p in model.named_parameters() if LORA_MARK in n}


def write_adapter(folder: str, adapter_config: Mapping[str, Any], state: Mapping[str, Tensor]) -> None:
    """Write ``state``'s adapters into ``folder`` as peft saves them (what ``PeftModel.from_pretrained`` and vLLM's
    ``LoRARequest`` load). Runs on: any process."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(dict(adapter_config), f, indent=2, default=sorted)
    tensors = {saved_key(k): v.contiguous() for k, v in state.items() if LORA_MARK in k}
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})


def unadapted_copy(model: nn.Module) -> nn.Module:
    """A copy of a wrapped model's base model without its adapters (the base's names and weights; on the meta
    device before loading): what a rollout engine is built from. Runs on: every worker rank, at set-up."""
    import copy

    unloaded: nn.Module = copy.deepcopy(model).unload()  # type: ignore[operator]
    return unloaded
