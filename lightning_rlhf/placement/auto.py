"""``RLHFStrategy(placement="auto")``: the planner's placement for this run, and the sizes the placement checks use.

The planner (:mod:`.cost_model`) gets this run's model roles, the actor's shape from its ``config.json``, one step's
workload from the data module and the rollout settings, and the hardware: calibrated here on CPUs (a few seconds),
from the device's datasheet on GPUs. Roles the planner does not model (a reward function, a role a subclass added)
go with the actor.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch

import lightning_rlhf.placement.cost_model as cost_model
from lightning_rlhf.placement.calibration import calibrated_cpu_hardware

if TYPE_CHECKING:
    from lightning_rlhf.module import RLHFModule
    from lightning_rlhf.roles.base import Role

__all__ = ["auto_placement", "rank_memory_bytes", "role_params", "role_state_bytes"]


def role_params(role: Role) -> float | None:
    """The parameter count of the role's model from its ``config.json`` (None: no model, or a shape the planner
    cannot read). Runs on: any process, before any model loads (reads the configuration only)."""
    path = getattr(role, "path", None)
    if not isinstance(path, str):
        return None
    try:
        return cost_model.shape_of(path).params
    except Exception:  # a configuration the planner's Llama-family shape does not describe
        return None


def role_state_bytes(role: Role) -> float:
    """Bytes of the role's whole-model state: 16 per parameter for a trainable role (float32 weights, gradients and
    two Adam moments), the held dtype's size for a frozen one or a LoRA role's base, nothing for a reference that is
    the actor's base; 0 when the size is unknown. Runs on: any process."""
    params = role_params(role)
    if params is None or getattr(role, "base", None) is not None:  # LoRA's reference: the actor's base, adapters off
        return 0.0
    if getattr(role, "lora", None) is None and role.trainable:  # LoRA: a frozen base (the adapters are a small share)
        return 16.0 * params
    return float(torch.finfo(role.dtype).bits // 8) * params


def rank_memory_bytes(device: torch.device, processes_per_node: int) -> float:
    """The memory one rank may use: its GPU's, or this machine's RAM shared by the node's processes. Runs on: every
    process, at set-up."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total) / max(1, processes_per_node)


def _hardware(world_size: int, shape: cost_model.ModelShape, workload: cost_model.Workload) -> cost_model.Hardware:
    """The device type the run is on, as the planner sees it."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for key in cost_model.HARDWARE:
            if key in name:
                return cost_model.HARDWARE[key]
        raise ValueError(
            f"RLHFStrategy(placement='auto'): no specification for the GPU {name!r} (known: "
            f"{sorted(cost_model.HARDWARE)}). HINT: give a placement mapping, or plan with `lightning-rlhf plan "
            "--device-type ...` and copy its placement."
        )
    return calibrated_cpu_hardware(  # with the threads Lightning gave this rank, as every rank has
        shape, workload, processes=world_size, memory=rank_memory_bytes(torch.device("cpu"), world_size),
        threads=torch.get_num_threads(),
    )  # fmt: skip


def auto_placement(module: RLHFModule, *, world_size: int) -> dict[str, list[int]]:
    """The planner's fastest placement of ``module``'s roles on ``world_size`` ranks (role -> ranks). Runs on: rank 0,
    in the strategy's ``setup_environment``, before any model loads. Raises
    :class:`~lightning_rlhf.placement.cost_model.InfeasiblePlacementError` when nothing fits in memory.
    """
    roles = module.roles()
    path = getattr(roles.get("actor"), "path", None)
    if not isinstance(path, str):
        raise ValueError("RLHFStrategy(placement='auto') plans around the actor's model: the module has no actor path.")
    planned = [name for name, role in roles.items() if name in cost_model.ROLES and role_params(role) is not None]
    if "actor" not in planned:
        raise ValueError(
            f"RLHFStrategy(placement='auto'): the planner cannot read the shape of the actor {path!r} (a Llama-family "
            "config.json is needed). HINT: give a placement mapping instead."
        )
    datamodule: Any = getattr(module.trainer, "datamodule", None)
    rollout = module.rollout_config
    workload = cost_model.Workload(
        prompts=int(getattr(datamodule, "batch_size", 8) or 8),
        n=rollout.n,
        prompt_len=int(getattr(datamodule, "max_prompt_length", None) or 512),
        response_len=rollout.max_new_tokens,
        activation_checkpointing=bool(getattr(module, "activation_checkpointing", False)),
        sequence_parallel=int(getattr(module, "sequence_parallel", 1) or 1),
        activation_dtype_bytes=2 if torch.cuda.is_available() else 4,  # CPU runs train in float32
    )
    shape = cost_model.shape_of(path)
    best = cost_model.plan(
        model=shape,
        hardware=_hardware(world_size, shape, workload),
        devices=world_size,
        workload=workload,
        algorithm=cost_model.dataflow_for(planned),
        tp_sizes=(1,),
        unit=1,
        # vLLM on part of the ranks runs engine servers: their hand-off copies and memory are part of the cost.
        engine_servers=getattr(module.trainer.strategy, "rollout", None) == "vllm",
    )
    _check_memory_settings(best, workload, world_size)
    # The actor's pool first, so that it starts at rank 0, beside the controller (exports, sample logs).
    pools = sorted(zip(best.groups, best.devices, best.memory, strict=True), key=lambda pool: "actor" not in pool[0])
    groups, devices, memory = zip(*pools, strict=True)
    best = dataclasses.replace(best, groups=groups, devices=devices, memory=memory)
    placement: dict[str, list[int]] = best.to_json()["placement"]
    chosen = {name: placement.get(name, placement["actor"]) for name in roles}
    print(
        f"[lightning_rlhf] placement='auto': {chosen} (predicted {best.step_s:.3f} s per step; stages "
        f"{[round(s, 3) for s in best.stage_s]} s)",
        flush=True,
    )
    return chosen


def _check_memory_settings(best: cost_model.Plan, workload: cost_model.Workload, world_size: int) -> None:
    """Raise when the planner fitted the roles only by turning on a memory setting the module has off: every rank
    reads the module's settings, so rank 0's planner cannot change them for the run."""
    needed = {
        "activation_checkpointing": (best.activation_checkpointing, workload.activation_checkpointing),
        "sequence_parallel": (best.sequence_parallel, workload.sequence_parallel),
    }
    missing = [f"{name}={value!r}" for name, (value, asked) in needed.items() if value != asked]
    if missing:
        raise cost_model.InfeasiblePlacementError(
            f"RLHFStrategy(placement='auto'): the roles fit on {world_size} ranks only with "
            f"RLHFModule({', '.join(missing)}). HINT: set {' and '.join(missing)} on the module, or use more ranks."
        )
