"""The planner's simulation table for docs/placement.md: the chosen placement, rollout TP, predicted step time
and throughput for PPO (four model roles) and GRPO, Llama-shaped 7B to 70B models, 8 to 1,024 GPUs.

    python benchmarks/plan_simulation.py [--device-type a100] [--prompts 1024] [--n 1] [--prompt-len 1024]
        [--response-len 1024]

Prints a markdown table and, as its last line, one JSON object (every row). Pure arithmetic (no model loads), a
few seconds. "colocated" is the predicted step with all roles on every device (the best TP for it), for
comparison with the chosen plan.
"""

from __future__ import annotations

import argparse
import json

from lightning_rlhf.planner import HARDWARE, MODELS, InfeasiblePlacementError, Workload, plan, predict


def main() -> None:
    """Print the table. Runs on: the calling process."""
    p = argparse.ArgumentParser()
    p.add_argument("--device-type", default="a100", type=str.lower, choices=sorted(HARDWARE), help="any case")
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=1024)
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
                        kw = {"model": shape, "hardware": hw, "workload": wl, "algorithm": algorithm}
                        together.append(predict(roles, [devices], tp, **kw).step_s)
                    except InfeasiblePlacementError:
                        pass
                pools = "; ".join(f"{'+'.join(g)}: {n}" for g, n in zip(best.groups, best.devices, strict=True))
                colocated = f"{min(together):.1f}" if together else "does not fit"
                tokens = wl.tokens / best.step_s
                print(f"| {algorithm} | {name} | {devices} | {pools} | {best.rollout_tp} | {best.step_s:.1f} | "
                      f"{colocated} | {tokens:,.0f} |")  # fmt: skip
                rows.append({"algorithm": algorithm, "model": name, "devices": devices, **best.to_json()})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
