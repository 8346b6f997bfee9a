"""Checkpoints of a run whose roles live on rank pools of their own (``RLHFStrategy(placement=...)``), and the
sharded checkpoints of a LoRA run (its frozen base weights left out).

With pools, a rank holds only its pool's roles, so each rank writes what it holds into one
torch.distributed.checkpoint folder, under the module's own names (``lightning-rlhf export`` reads either kind);
docs/placement.md and docs/lora.md describe what a checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_rlhf.checkpoint.export import CHECKPOINT_KEY, lora_files
from lightning_rlhf.compat.lightning import checkpoint_metadata_filename

if TYPE_CHECKING:
    from lightning_rlhf.module import RLHFModule

__all__ = [
    "complete_checkpoint",
    "is_placeholder",
    "load_pooled_checkpoint",
    "pooled_model_state",
    "pooled_optimizer_state",
]


def is_placeholder(optimizer: Any) -> bool:
    """Whether ``optimizer`` stands in for a role this rank does not hold (``Role.placeholder_optimizer``)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's wrapper
    return bool(getattr(optimizer, "lightning_rlhf_placeholder", False))


def _held_models(module: RLHFModule) -> dict[str, torch.nn.Module]:
    """The role models this rank holds (a rank outside a role's pool has no model for it)."""
    return {name: role.model for name, role in module.roles().items() if role.model is not None}


def _frozen_left_out(module: RLHFModule, name: str) -> bool:
    """Whether role ``name``'s frozen weights stay out of checkpoints (a role with LoRA adapters: its base)."""
    return getattr(module.roles()[name], "lora", None) is not None


def _outside_roles(module: RLHFModule, state: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``state`` outside the roles (e.g. a Lagrange multiplier), the same on every rank."""
    roles = tuple(f"{name}." for name in module.roles())
    return {key: value for key, value in state.items() if not key.startswith(roles)}


def _model_state(module: RLHFModule, options: Any = None) -> dict[str, Any]:
    """This rank's model state: its roles' under the module's names (``<role>.model.<key>``), without a LoRA role's
    frozen weights (dropped by name: ``StateDictOptions(ignore_frozen_params=True)`` would keep a tied head), and
    the module's state outside the roles."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = _outside_roles(module, module.state_dict())
    for name, model in _held_models(module).items():
        kept = get_model_state_dict(model, options=options)
        if _frozen_left_out(module, name):
            for key, value in model.state_dict(keep_vars=True).items():
                if isinstance(value, torch.nn.Parameter) and not value.requires_grad:
                    kept.pop(key, None)
        state |= {f"{name}.model.{key}": value for key, value in kept.items()}
    return state


def pooled_model_state(module: RLHFModule) -> dict[str, Any]:
    """This rank's part of the model state: its roles' shards and the module's state outside the roles. Runs on: every
    rank, when Lightning collects a checkpoint (``lightning_module_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return _model_state(module, StateDictOptions(full_state_dict=False, cpu_offload=True))


def _owner(module: RLHFModule, optimizer: Any) -> torch.nn.Module:
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    for role in module.roles().values():
        if role.model is not None and role.optimizer is optimizer:
            return role.model
    raise RuntimeError(
        f"A `{type(optimizer).__name__}` in trainer.optimizers belongs to no role this rank holds. HINT: optimizers "
        "of an RLHFModule come from its roles (RLHFModule.configure_optimizers)."
    )


def pooled_optimizer_state(module: RLHFModule, optimizer: Any) -> dict[str, Any]:
    """One optimizer's state on this rank, keyed by names relative to its role's model; empty for a stand-in.

    Runs on: every rank, when Lightning collects a checkpoint (``optimizer_state``)."""
    if is_placeholder(optimizer):
        return {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=False, cpu_offload=True)
    raw = getattr(optimizer, "_optimizer", optimizer)
    return get_optimizer_state_dict(_owner(module, optimizer), raw, options=options)


def complete_checkpoint(
    checkpoint: dict[str, Any], module: RLHFModule, pools: Mapping[str, Sequence[int]] | None
) -> None:
    """Add to a checkpoint what Lightning's leaves out: a LoRA run's adapter settings and base model's name (for
    ``lightning-rlhf export``, unless an ``ExportActor`` put them there), and with rank pools (``pools``; None: every
    role on every rank) each learning-rate schedule as its role's pool has it (rank 0's copy of a role it does not
    hold was never stepped). Runs on: every rank (one broadcast per schedule), before the checkpoint is written."""
    lora = {} if CHECKPOINT_KEY in checkpoint else lora_files(module)
    if lora:
        checkpoint[CHECKPOINT_KEY] = lora
    if pools is not None and "lr_schedulers" in checkpoint:
        owners = [name for name, role in module.roles().items() if role.trainable]
        fixed = []
        for state, role in zip(checkpoint["lr_schedulers"], owners, strict=True):
            box = [state]
            dist.broadcast_object_list(box, src=min(pools[role]))
            fixed.append(box[0])
        checkpoint["lr_schedulers"] = fixed


def load_pooled_checkpoint(
    path: Path, module: RLHFModule, optimizers: Sequence[Any], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Read this rank's part of a pooled checkpoint into its roles' shards and optimizers; return the rest of the
    checkpoint (loops, callbacks, schedules) for Lightning to restore. Runs on: every rank (a collective read), in
    ``RLHFStrategy.load_checkpoint``."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    metadata = path / checkpoint_metadata_filename()
    if not metadata.is_file():
        raise FileNotFoundError(
            f"{path} is not a sharded checkpoint of a run with a placement (no {metadata.name}). HINT: a run with "
            "RLHFStrategy(placement=...) resumes from the folders it saves."
        )
    to_load: dict[str, Any] = {"state_dict": _model_state(module)}
    owners = {}
    for index, optimizer in enumerate(optimizers):
        if is_placeholder(optimizer):
            continue
        owners[index] = _owner(module, optimizer)
        raw = getattr(optimizer, "_optimizer", optimizer)
        to_load[f"optimizer_{index}"] = get_optimizer_state_dict(owners[index], raw)
    load(to_load, checkpoint_id=path)
    loaded = to_load["state_dict"]
    for name, model in _held_models(module).items():
        prefix = f"{name}.model."
        state = {key.removeprefix(prefix): value for key, value in loaded.items() if key.startswith(prefix)}
        # a LoRA role's base is not in the checkpoint (it came from the run's model); every key asked for was read
        strict_here = strict and not _frozen_left_out(module, name)
        set_model_state_dict(model, state, options=StateDictOptions(strict=strict_here))
    if outside := _outside_roles(module, loaded):
        module.load_state_dict(outside, strict=False)
    for index, model in owners.items():
        optimizer = getattr(optimizers[index], "_optimizer", optimizers[index])
        set_optimizer_state_dict(model, optimizer, optim_state_dict=to_load[f"optimizer_{index}"])
    return torch.load(metadata, weights_only=weights_only)
