"""The planner's simulation table for docs/placement.md: the chosen placement, rollout TP, predicted step time
and throughput for PPO (four model roles) and GRPO, Llama-shaped 7B to 70B models, 8 to 1,024 GPUs; then the
fewest GPUs each fits on, full fine-tuning against LoRA (``--lora-rank``).

    python benchmarks/plan_simulation.py [--device-type a100] [--prompts 1024] [--n 1] [--prompt-len 1024]
        [--response-len 1024]

Prints a markdown table and, as its last line, one JSON object (every row). Pure arithmetic (no model loads), a
few seconds. "colocated" is the predicted step with all roles on every device (the best TP for it), for
comparison with the chosen plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from lightning_rlhf.placement.cost_model import HARDWARE, MODELS, InfeasiblePlacementError, Workload, plan, predict


def main() -> None:
    """Print the table. Runs on: the calling process."""
    p = argparse.ArgumentParser()
    p.add_argument("--device-type", default="a100", type=str.lower, choices=sorted(HARDWARE), help="any case")
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--lora-rank", type=int, default=16, help="the LoRA rows' adapter rank")
    args = p.parse_args()
    hw = HARDWARE[args.device_type]
    wl = Workload(prompts=args.prompts, n=args.n, prompt_len=args.prompt_len, response_len=args.response_len)
    rows = []
    print(f"| algorithm | model | {args.device_type} GPUs | pools (roles: devices) | rollout TP | step s | "
          "colocated step s | tokens/s |")  # fmt: skip
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for algorithm in ("ppo", "grpo"):
        for name, shape in MODELS.items():
            for devices in (8, 16, 32, 64, 128, 256, 512, 1024):
                try:
                    best = plan(model=shape, hardware=hw, devices=devices, workload=wl, algorithm=algorithm)
                except InfeasiblePlacementError:
                    print(f"| {algorithm} | {name} | {devices} | does not fit | | | | |")
                    continue
                together = []
                for tp in (1, 2, 4, 8):
                    try:
                        roles = [sorted({r for g in best.groups for r in g})]
                        same = dataclasses.replace(  # the memory settings the plan needed
                            wl, activation_checkpointing=best.activation_checkpointing,
                            sequence_parallel=best.sequence_parallel,
                        )  # fmt: skip
                        kw = {"model": shape, "hardware": hw, "workload": same, "algorithm": algorithm}
                        together.append(predict(roles, [devices], tp, **kw).step_s)
                    except InfeasiblePlacementError:
                        pass
                pools = "; ".join(f"{'+'.join(g)}: {n}" for g, n in zip(best.groups, best.devices, strict=True))
                colocated = f"{min(together):.1f}" if together else "does not fit"
                tokens = wl.tokens / best.step_s
                print(f"| {algorithm} | {name} | {devices} | {pools} | {best.rollout_tp} | {best.step_s:.1f} | "
                      f"{colocated} | {tokens:,.0f} |")  # fmt: skip
                rows.append({"algorithm": algorithm, "model": name, "devices": devices, **best.to_json()})
    lora_rows = fewest_devices_table(hw, wl, args.lora_rank)
    print(json.dumps({"placements": rows, "fewest_devices": lora_rows}))


def fewest_devices_table(hw: object, wl: Workload, rank: int) -> list[dict[str, object]]:
    """The fewest devices (1, 2, 4, 8, then whole nodes) on which each model and algorithm fits, full fine-tuning
    against LoRA of ``rank`` (the reference then is the actor's base, adapters off); prints a markdown table."""
    lora = dataclasses.replace(wl, lora_rank=rank)
    print(
        f"\n| algorithm | model | fewest GPUs, full fine-tuning | fewest GPUs, LoRA r={rank} | step s (full / LoRA) |"
    )
    print("| --- | --- | ---: | ---: | --- |")
    out: list[dict[str, object]] = []
    for algorithm in ("ppo", "grpo"):
        for name, shape in MODELS.items():
            found = []
            for work in (wl, lora):
                for devices in (1, 2, 4, 8, 16, 32, 64, 128, 256):
                    try:
                        best = plan(model=shape, hardware=hw, devices=devices, workload=work, algorithm=algorithm)
                    except InfeasiblePlacementError:
                        continue
                    found.append((devices, best.step_s))
                    break
                else:
                    found.append((0, float("nan")))
            (full_n, full_s), (lora_n, lora_s) = found
            print(f"| {algorithm} | {name} | {full_n or '> 256'} | {lora_n or '> 256'} | {full_s:.1f} / {lora_s:.1f} |")
            out.append({"algorithm": algorithm, "model": name, "full": full_n, "lora": lora_n})
    return out


if __name__ == "__main__":
    main()
