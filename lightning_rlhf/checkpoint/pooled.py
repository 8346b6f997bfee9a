"""Checkpoints of a run whose roles live on rank pools of their own (``RLHFStrategy(placement=...)``).

Lightning's FSDP2 strategy asks the whole module for its state on every rank; with pools, a rank holds only the
roles of its pool (the others have no model there). So each rank contributes what it holds:

- the model state: the FSDP2 shards of its roles, under the module's own names (``actor.model.<...>``, as a run
  without pools writes them, so ``lightning-rlhf export`` reads either), plus the module's state outside the roles;
- the optimizer states: one per trainable role, at the role's index in ``trainer.optimizers`` (every rank lists the
  same roles in the same order; a rank outside a role's pool lists a stand-in, which contributes nothing), keyed by
  names relative to the role's model;
- the learning-rate schedules: Lightning writes them from rank 0, so the strategy first fetches each from a rank of
  its role's pool (:func:`schedules_from_holders`).

All of it goes into one torch.distributed.checkpoint folder; loading reads back each rank's part, resharded if the
pool sizes changed.

A run with LoRA adapters writes its sharded checkpoints this way too, with or without pools: a LoRA role's frozen base
weights are left out, so a checkpoint holds the adapters, their
optimizer state and the rest of the module (a 7B actor's checkpoint: tens of MB instead of 14 GB). Resume loads the
base from the model the run starts from, as a fresh run does, then the adapters from the checkpoint.
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
    "schedules_from_holders",
]


def is_placeholder(optimizer: Any) -> bool:
    """Whether ``optimizer`` stands in for a role this rank does not hold (``Role.placeholder_optimizer``)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's wrapper
    return bool(getattr(optimizer, "lightning_rlhf_placeholder", False))


def _role_prefixes(module: RLHFModule) -> dict[str, str]:
    """Role name -> the prefix of its model's keys in the module's state dict (``"<role>.model."``)."""
    return {name: f"{name}.model." for name in module.roles()}


def _held_models(module: RLHFModule) -> dict[str, torch.nn.Module]:
    """The role models this rank holds (a rank outside a role's pool has no model for it)."""
    return {name: role.model for name, role in module.roles().items() if role.model is not None}


def _frozen_left_out(module: RLHFModule, name: str) -> bool:
    """Whether role ``name``'s frozen weights stay out of checkpoints (a role with LoRA adapters: its base)."""
    return getattr(module.roles()[name], "lora", None) is not None


def _role_state(state: dict[str, Any], model: torch.nn.Module, left_out: bool) -> dict[str, Any]:
    """``state`` (a role model's) without its frozen weights if ``left_out``. A tied weight is frozen under each of its
    names (``StateDictOptions(ignore_frozen_params=True)`` would keep a tied head)."""
    if left_out:
        for key, value in model.state_dict(keep_vars=True).items():
            if isinstance(value, torch.nn.Parameter) and not value.requires_grad:
                state.pop(key, None)
    return state


def _outside_roles(module: RLHFModule) -> dict[str, Any]:
    """The module's own state outside the roles (e.g. a Lagrange multiplier), the same on every rank."""
    roles = tuple(f"{name}." for name in module.roles())
    return {key: value for key, value in module.state_dict().items() if not key.startswith(roles)}


def pooled_model_state(module: RLHFModule) -> dict[str, Any]:
    """This rank's part of the model state: its roles' shards and the module's state outside the roles.

    Runs on: every rank, when Lightning collects a checkpoint (``lightning_module_state_dict``).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=False, cpu_offload=True)
    prefixes = _role_prefixes(module)
    state = _outside_roles(module)
    for name, model in _held_models(module).items():
        kept = _role_state(get_model_state_dict(model, options=options), model, _frozen_left_out(module, name))
        state |= {prefixes[name] + key: value for key, value in kept.items()}
    return state


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

    Runs on: every rank, when Lightning collects a checkpoint (``optimizer_state``).
    """
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
    ``lightning-rlhf export``, unless an ``ExportActor`` put them there), and with rank pools (``pools``; None:
    every role on every rank) each learning-rate schedule as its role's pool has it (rank 0 writes them).

    Runs on: every rank, before the checkpoint is written.
    """
    lora = {} if CHECKPOINT_KEY in checkpoint else lora_files(module)
    if lora:
        checkpoint[CHECKPOINT_KEY] = lora
    if pools is not None and "lr_schedulers" in checkpoint:
        owners = [name for name, role in module.roles().items() if role.trainable]
        checkpoint["lr_schedulers"] = schedules_from_holders(checkpoint["lr_schedulers"], owners, pools)


def schedules_from_holders(
    schedules: Sequence[Any], owners: Sequence[str], pools: Mapping[str, Sequence[int]]
) -> list[Any]:
    """Each learning-rate schedule's state as a rank of its role's pool has it (rank 0's copy of a role it does not
    hold was never stepped).

    Runs on: every rank (one broadcast per schedule, in order), before rank 0 writes the checkpoint's metadata.

    Args:
        schedules: this rank's ``lr_schedulers`` states, in ``trainer.optimizers`` order.
        owners: the trainable role of each, in the same order.
        pools: each role's ranks.
    """
    fixed = []
    for state, role in zip(schedules, owners, strict=True):
        box = [state]
        dist.broadcast_object_list(box, src=min(pools[role]))
        fixed.append(box[0])
    return fixed


def load_pooled_checkpoint(
    path: Path, module: RLHFModule, optimizers: Sequence[Any], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Read this rank's part of a pooled checkpoint into its roles' shards and optimizers; return the rest of the
    checkpoint (loops, callbacks, schedules) for Lightning to restore.

    Runs on: every rank (a collective read), in ``RLHFStrategy.load_checkpoint``.
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
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
    prefixes = _role_prefixes(module)
    models = _held_models(module)
    left_out = {name: _frozen_left_out(module, name) for name in models}
    role_states = {
        name: _role_state(get_model_state_dict(model), model, left_out[name]) for name, model in models.items()
    }
    outside = _outside_roles(module)
    model_state = dict(outside)
    for name, state in role_states.items():
        model_state |= {prefixes[name] + key: value for key, value in state.items()}
    to_load: dict[str, Any] = {"state_dict": model_state}
    owners = {}
    for index, optimizer in enumerate(optimizers):
        if is_placeholder(optimizer):
            continue
        owners[index] = _owner(module, optimizer)
        raw = getattr(optimizer, "_optimizer", optimizer)
        to_load[f"optimizer_{index}"] = get_optimizer_state_dict(owners[index], raw)
    load(to_load, checkpoint_id=path)
    loaded = to_load["state_dict"]
    for name, model in models.items():
        state = {key: loaded[prefixes[name] + key] for key in role_states[name]}
        # a LoRA role's base is not in the checkpoint (it came from the run's model); every key asked for was read
        set_model_state_dict(model, state, options=StateDictOptions(strict=strict and not left_out[name]))
    if outside:
        module.load_state_dict({key: loaded[key] for key in outside}, strict=False)
    for index, model in owners.items():
        optimizer = getattr(optimizers[index], "_optimizer", optimizers[index])
        set_optimizer_state_dict(model, optimizer, optim_state_dict=to_load[f"optimizer_{index}"])
    return torch.load(metadata, weights_only=weights_only)
