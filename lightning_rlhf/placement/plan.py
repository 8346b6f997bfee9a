"""``lightning-rlhf plan`` (also ``python -m lightning_rlhf.placement.plan``): the fastest placement of a recipe's
roles on a number of devices, from the cost model (:mod:`.cost_model`), calibrated on this machine for CPUs
(:mod:`.calibration`) or from a GPU's datasheet. Loads no model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from lightning_rlhf.placement.calibration import calibrated_cpu_hardware
from lightning_rlhf.placement.cost_model import (
    GB,
    HARDWARE,
    MODELS,
    Call,
    Hardware,
    InfeasiblePlacementError,
    ModelShape,
    Plan,
    Workload,
    core_share,
    dataflow_for,
    hardware_for,
    plan,
    shape_of,
)

__all__ = ["main", "recipe_inputs"]


def _dtype_bytes(name: str | None) -> int:
    """Bytes per element of a recipe's dtype setting (None: float32, the default)."""
    return 2 if str(name).removeprefix("torch.") in ("bfloat16", "float16", "bf16", "fp16", "half") else 4


def recipe_inputs(recipe: str, *, model_shape: str | None = None) -> tuple[list[list[Call]], ModelShape, Workload]:
    """The dataflow, the actor's shape and one step's workload a recipe describes: its module's model roles (a
    ``reward`` that is a model path, not a function's), the data module's ``batch_size`` and ``max_prompt_length``,
    ``rollout.n`` and ``rollout.max_new_tokens`` (:class:`~lightning_rlhf.config.RolloutConfig`'s defaults when
    the recipe leaves them out), the micro-batch (rows x sequence, or ``micro_batch_tokens``) and the dtypes
    (``param_dtype``, ``frozen_dtype``; float32 when left out). Runs on: the ``plan`` command's process. Raises for
    a recipe without an actor.
    """
    import yaml

    from lightning_rlhf.config import BatchingConfig, RolloutConfig

    with open(recipe) as f:
        config = yaml.safe_load(f) or {}
    module = (config.get("model") or {}).get("init_args") or {}
    data = (config.get("data") or {}).get("init_args") or {}
    if "actor" not in module:
        raise InfeasiblePlacementError(f"{recipe}: no model.init_args.actor. HINT: pass an RLHF recipe.")
    roles = ["actor", *(role for role in ("critic", "reference") if module.get(role))]
    reward = module.get("reward")
    if isinstance(reward, str) and (Path(reward).is_dir() or reward.count("/") == 1):  # a folder or "org/name"
        roles.append("reward")
    rollout = module.get("rollout") or {}
    defaults = RolloutConfig()
    prompt_len = int(data.get("max_prompt_length") or 512)
    response_len = int(rollout.get("max_new_tokens", defaults.max_new_tokens))
    batching = (module.get("algorithm") or {}).get("batching") or {}
    rows = int(batching.get("micro_batch_size") or BatchingConfig().micro_batch_size)
    strategy = ((config.get("trainer") or {}).get("strategy") or {}).get("init_args") or {}
    workload = Workload(
        prompts=int(data.get("batch_size", 8)),
        n=int(rollout.get("n", defaults.n)),
        prompt_len=prompt_len,
        response_len=response_len,
        micro_tokens=int(batching.get("micro_batch_tokens") or rows * (prompt_len + response_len)),
        activation_dtype_bytes=_dtype_bytes(strategy.get("param_dtype")),
        frozen_dtype_bytes=_dtype_bytes(module.get("frozen_dtype")),
        lora_rank=int((module.get("lora") or {}).get("r", 8)) if module.get("lora") else 0,
        activation_checkpointing=bool(module.get("activation_checkpointing", False)),
        sequence_parallel=int(module.get("sequence_parallel") or 1),
    )
    return dataflow_for(roles), shape_of(str(module["actor"]), override=model_shape), workload


def _hardware(device_type: str, devices: int, shape: ModelShape, workload: Workload) -> Hardware:
    """The datasheet's device, or this machine calibrated for ``devices`` CPU processes."""
    if device_type != "cpu":
        return hardware_for(device_type)
    import torch

    from lightning_rlhf.perf import threads_per_process
    from lightning_rlhf.placement.auto import rank_memory_bytes

    threads = threads_per_process(devices)  # what Lightning gives each process of the run
    torch.set_num_threads(threads)
    memory = rank_memory_bytes(torch.device("cpu"), devices)
    hardware = calibrated_cpu_hardware(shape, workload, processes=devices, memory=memory, threads=threads)
    cores = hardware.cores
    share = core_share(cores=cores, processes=devices, threads=threads)
    print(
        f"cpu: {cores:g} cores for {devices} processes of {threads} thread(s): each gets {share:.2f} of its "
        "compute while every process is busy"
    )
    return hardware


def _print_turned_on(best: Plan, workload: Workload) -> None:
    """Say which memory setting the planner turned on to fit, if any."""
    chosen = [
        f"{setting}={value}"
        for setting, value, asked in (
            ("activation_checkpointing", best.activation_checkpointing, workload.activation_checkpointing),
            ("sequence_parallel", best.sequence_parallel, workload.sequence_parallel),
        )
        if value != asked
    ]
    if chosen:
        print(f"  fits only with RLHFModule({', '.join(chosen)}) (the planner turned it on)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``lightning-rlhf plan --config RECIPE --devices N --device-type TYPE [--model-shape S] [--rollout E]
    [--activation-checkpointing] [--sequence-parallel N] [--fixed-memory-settings]``: print the fastest placement
    of the recipe's roles, the predicted time of each stage and, as the last line, one JSON object (``placement``,
    ``parallel``, ``activation_checkpointing``, ``sequence_parallel``, ``predicted_step_s``, ...). Returns it.

    Runs on: one process; loads no model. ``--device-type`` takes any case (``H100``); ``cpu`` calibrates on this
    machine (:func:`.calibration.calibrated_cpu_hardware`).
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="lightning-rlhf plan", description="the fastest placement of a recipe's roles on a number of devices"
    )
    parser.add_argument("--config", required=True, help="an RLHF recipe (YAML)")
    parser.add_argument("--devices", type=int, required=True, help="devices (GPUs, or CPU processes) to plan for")
    parser.add_argument(
        "--device-type", required=True, type=str.lower, choices=[*HARDWARE, "cpu"], help="any case (H100 or h100)"
    )
    parser.add_argument("--model-shape", choices=sorted(MODELS), help="plan for this shape instead of the actor's")
    parser.add_argument("--tp-sizes", default="1,2,4,8", help="rollout tensor-parallel sizes to consider")
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="the trained roles checkpoint their blocks"
    )
    parser.add_argument("--sequence-parallel", type=int, help="ranks per sequence (Ulysses); default: the recipe's")
    parser.add_argument(
        "--fixed-memory-settings",
        action="store_true",
        help="do not turn on activation checkpointing or sequence parallelism when nothing fits without them",
    )
    parser.add_argument(
        "--rollout",
        choices=["vllm", "hf"],
        default="vllm",
        help="the rollout engine: vllm (an actor on part of the devices pays its engine servers' hand-off copies "
        "and memory) or hf",
    )
    args = parser.parse_args(argv)
    if args.devices < 1:
        parser.error(f"--devices {args.devices}: expected at least 1")
    if args.sequence_parallel is not None and args.sequence_parallel < 1:
        parser.error(f"--sequence-parallel {args.sequence_parallel}: expected at least 1")
    flow, shape, workload = recipe_inputs(args.config, model_shape=args.model_shape)
    workload = dataclasses.replace(
        workload,
        activation_checkpointing=workload.activation_checkpointing or args.activation_checkpointing,
        sequence_parallel=args.sequence_parallel or workload.sequence_parallel,
        activation_dtype_bytes=4 if args.device_type == "cpu" else 2,  # CPU runs train in float32
    )
    hardware = _hardware(args.device_type, args.devices, shape, workload)
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    # CPU processes are split one by one, as placement="auto" does: the machine is one "node" of all of them, and
    # whole-node pools would leave colocation as the only choice.
    unit = 1 if args.device_type == "cpu" else None
    best = plan(
        model=shape, hardware=hardware, devices=args.devices, workload=workload, algorithm=flow, tp_sizes=tp_sizes,
        unit=unit, engine_servers=args.rollout == "vllm", memory_levers=not args.fixed_memory_settings,
    )  # fmt: skip
    tokens = f"{workload.prompt_len} + {workload.response_len} tokens"
    print(
        f"{args.config}: {shape.params / 1e9:.2f}B parameters, {workload.sequences} sequences of {tokens} per step, "
        f"{args.devices} x {hardware.name}"
    )
    for i, (group, n) in enumerate(zip(best.groups, best.devices, strict=True)):
        print(f"  pool {i}: {n} devices, {', '.join(group)} (peak {best.memory[i] / GB:.2f} GB per device)")
    for stage, seconds in zip(flow, best.stage_s, strict=True):
        print(f"  stage {' + '.join(f'{role}.{kind}' for role, kind in stage)}: {seconds:.3f} s")
    _print_turned_on(best, workload)
    out = best.to_json() | {"devices": args.devices, "device_type": hardware.name}
    print(f"  predicted step: {best.step_s:.3f} s (rollout TP {best.rollout_tp})")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
