"""The planner's predicted step time against measured runs, for several placements on this machine (issue 12).

    python benchmarks/placement_validation.py [--models tiny,small] [--steps 8] [--configs ppo-colocated,...]

Each configuration is a real run (``PPOModule`` or ``GRPOModule`` with a reference, the transformers rollout
engine, 2 processes over gloo, ``RLHFStrategy(placement=...)``) on the side-by-side benchmark's workload models
(``benchmarks/vs_trl/workload.py``): 16 prompts x 4 samples per step, exactly 32 new tokens. The measured step is
the median ``timing_s/step`` of the last half of the steps. The prediction is :func:`placement.cost_model.predict`
for the same roles, pools and workload, on this machine as the planner calibrates it: ``cpu_hardware`` (one
process's float32 matmul peak, memory bandwidth, host time per layer), ``calibrate_for_shape`` (what the model's
own shapes reach of the peak), and ``fit_call_costs`` on the calibration run (:data:`CALIBRATION`: every role on
both ranks), whose calls give the host cost per role call and per training call. The other placements are
predictions. Prints a markdown table and, as its last line, one JSON object.

    python benchmarks/placement_validation.py --task demo [--steps 8] [--devices 4] [--rounds 2]

The oversubscribed case (issue 31): PPO on the demo task (``python -m lightning_rlhf.demo --algo ppo``: the demo
model as actor and critic, a reward function, 32 prompts x 8 samples, at most 6 new tokens) on 4 processes of one
thread each, on however many cores this machine gives them (2 here), colocated and split (the actor and the reward
on the first half of the ranks, the critic on the second), each ``--rounds`` times in turn (the median). The
prediction counts the cores
(``cpu_hardware(cores=..., threads=...)``, ``cost_model.core_share``); the table also says which placement
``cost_model.plan`` chooses, against the faster measured one.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "vs_trl"))
sys.path.insert(0, os.path.dirname(HERE))

PROMPTS, SAMPLES, NEW_TOKENS, MICRO_BATCH = 16, 4, 32, 32
CALIBRATION = "ppo-colocated"
"""The run whose calls fit the host cost per role call (``calibration.fit_call_costs``); the others are predicted."""

CONFIGS: dict[str, tuple[str, list[list[str]]]] = {
    # name: (algorithm, pools of roles; pool i holds the ranks after pool i-1's, one rank each when split)
    "ppo-colocated": ("ppo", [["actor", "reward", "critic", "reference"]]),
    "ppo-split-critic+ref": ("ppo", [["actor", "reward"], ["critic", "reference"]]),
    "ppo-split-critic": ("ppo", [["actor", "reward", "reference"], ["critic"]]),
    "grpo-colocated": ("grpo", [["actor", "reward", "reference"]]),
    "grpo-split-ref": ("grpo", [["actor", "reward"], ["reference"]]),
}


DEMO_PROMPTS, DEMO_SAMPLES, DEMO_NEW_TOKENS, DEMO_MICRO_BATCH = 32, 8, 6, 128
"""``python -m lightning_rlhf.demo``'s defaults."""
DEMO_CONFIGS: dict[str, tuple[str, list[list[str]]]] = {
    "demo-ppo-colocated": ("ppo", [["actor", "reward", "critic"]]),
    "demo-ppo-split": ("ppo", [["actor", "reward"], ["critic"]]),  # the demo's --placement split
}
DEMO_CALIBRATION = "demo-ppo-colocated"
DEMO_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "lightning_rlhf")
"""The demo's own model cache (its warm-started model is built there once)."""


def placement_of(pools: list[list[str]], devices: int) -> dict[str, list[int]]:
    """Role -> ranks: one pool holds every rank; several pools split the ranks evenly, in order."""
    if len(pools) == 1:
        return {role: list(range(devices)) for role in pools[0]}
    per = devices // len(pools)
    return {role: list(range(i * per, (i + 1) * per)) for i, pool in enumerate(pools) for role in pool}


# ---------------------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    """One run (every rank; Lightning's launcher starts rank 1 by running this script again)."""
    import datasets
    import lightning as L
    import torch
    import workload as W
    from lightning.pytorch.loggers import CSVLogger

    from lightning_rlhf import AlgorithmConfig, OptimConfig, PromptDataModule, RLHFStrategy, RolloutConfig
    from lightning_rlhf.config import RewardConfig
    from lightning_rlhf.modules import GRPOModule, PPOModule

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    algo, pools = CONFIGS[args.config]
    rollout = RolloutConfig(n=SAMPLES, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, seed=0)
    common: dict[str, Any] = dict(
        reward=W.reward,
        reference=True,
        rollout=rollout,
        reward_config=RewardConfig(timeout_s=None),
        actor_optim=OptimConfig(lr=1e-6),
        attn_implementation="eager",
    )
    if algo == "ppo":
        module: Any = PPOModule(
            args.model_dir,
            critic=args.model_dir,
            critic_optim=OptimConfig(lr=1e-5),
            algorithm=AlgorithmConfig(
                advantage="gae", kl_in_reward=True, kl_estimator="k1", kl_coef=0.04, micro_batch_size=MICRO_BATCH
            ),
            **common,
        )
    else:
        module = GRPOModule(
            args.model_dir,
            algorithm=AlgorithmConfig(advantage="grpo", kl_coef=0.04, kl_estimator="k3", micro_batch_size=MICRO_BATCH),
            **common,
        )
    rows = W.prompt_rows(args.steps, PROMPTS)
    data = PromptDataModule(datasets.Dataset.from_list(rows), batch_size=PROMPTS, max_prompt_length=64, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=RLHFStrategy("hf", placement=placement_of(pools, args.devices)),
        max_steps=args.steps,
        logger=CSVLogger(args.out, name="", version=""),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)


# ---------------------------------------------------------------------------------------------- driver
def measured(out: str, steps: int) -> dict[str, float]:
    """Median of the last half of the steps: the step, and each stage and call timing."""
    with open(os.path.join(out, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("timing_s/step")]
    tail = rows[steps // 2 :]
    keys = [k for k in rows[0] if k.startswith("timing_s/")]
    return {k: statistics.median(float(r[k]) for r in tail if r.get(k)) for k in keys}


def mean_prompt_tokens(model_dir: str, steps: int) -> float:
    """Mean tokens of the run's prompts, as its tokenizer counts them."""
    import workload as W
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = W.prompt_rows(steps, PROMPTS)
    return statistics.mean(len(tok(r["prompt"])["input_ids"]) for r in rows)


def predicted(model_dir: str, config: str, devices: int, prompt_len: float, hardware: Any) -> Any:
    """The planner's prediction for ``config``."""
    from lightning_rlhf.placement import cost_model

    algo, pools = CONFIGS[config]
    roles = [role for pool in pools for role in pool if role != "reward"]  # a reward function takes no devices
    groups = [[r for r in pool if r != "reward"] for pool in pools]
    groups = [g for g in groups if g]
    sizes = [devices] if len(pools) == 1 else [devices // len(pools)] * len(groups)
    workload = cost_model.Workload(
        prompts=PROMPTS, n=SAMPLES, prompt_len=round(prompt_len), response_len=NEW_TOKENS,
        micro_tokens=MICRO_BATCH * (round(prompt_len) + NEW_TOKENS),
    )  # fmt: skip
    flow = cost_model.dataflow_for(roles, old_logprobs=algo == "ppo")
    return cost_model.predict(
        groups, sizes, 1, model=cost_model.shape_of(model_dir), hardware=hardware, workload=workload, algorithm=flow
    )


def main() -> None:
    """Run every configuration, predict each, print the table. Runs on: the driver."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["vs_trl", "demo"], default="vs_trl", help="demo: the oversubscribed PPO case")
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="--task demo: runs of each placement, in turn (median)")
    p.add_argument("--devices", type=int, default=None, help="processes (default: 2; 4 with --task demo)")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "lightning_rlhf_bench_models"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.devices is None:
        args.devices = 4 if args.task == "demo" else 2
    if args.worker:
        worker(args)
        return
    if args.task == "demo":
        demo_main(args)
        return

    from bench import build_models  # benchmarks/vs_trl/bench.py: the side-by-side benchmark's model builder

    from lightning_rlhf.placement import calibration, cost_model

    models = args.models.split(",")
    build_models(args.cache, models)
    hardware = cpu_calibration(args.devices)
    calibrated, workloads = {}, {}
    for model in models:
        model_dir = os.path.join(args.cache, model)
        prompt_len = round(mean_prompt_tokens(model_dir, args.steps))
        workloads[model] = cost_model.Workload(
            prompts=PROMPTS, n=SAMPLES, prompt_len=prompt_len, response_len=NEW_TOKENS,
            micro_tokens=MICRO_BATCH * (prompt_len + NEW_TOKENS),
        )  # fmt: skip
        calibrated[model] = calibration.calibrate_for_shape(hardware, cost_model.shape_of(model_dir), workloads[model])
        h = calibrated[model]
        print(f"{model}: train {h.train_eff:.2f}, forward {h.forward_eff:.2f}, decode {h.decode_eff:.2f} of the peak")
    configs = args.configs.split(",")
    if CALIBRATION in configs:  # measured first: its calls fit the host cost per call
        configs = [CALIBRATION] + [c for c in configs if c != CALIBRATION]
    results = []
    for model in models:
        model_dir = os.path.join(args.cache, model)
        for config in configs:
            got = run(model_dir, config, args)
            if config == CALIBRATION:
                calibrated[model] = calibration.fit_call_costs(
                    calibrated[model], cost_model.shape_of(model_dir), workloads[model], args.devices,
                    forward_s=[got[f"timing_s/{k}"] for k in ("old_log_prob", "ref", "values")],
                    train_s=[got[f"timing_s/{k}"] for k in ("update_actor", "update_critic")],
                )  # fmt: skip
                h = calibrated[model]
                saved = calibration.save_call_costs(h, cost_model.shape_of(model_dir), args.devices)
                print(f"{model}: host cost {h.call_s * 1e3:.1f} ms per call, +{h.train_call_s * 1e3:.1f} ms per update "
                      f"(kept in {saved} for plan --device-type cpu and placement='auto')")  # fmt: skip
            plan = predicted(model_dir, config, args.devices, workloads[model].prompt_len, calibrated[model])
            error = plan.step_s / got["timing_s/step"] - 1
            results.append(
                {"model": model, "config": config, "calibration": config == CALIBRATION,
                 "measured_step_s": round(got["timing_s/step"], 4),
                 "predicted_step_s": round(plan.step_s, 4), "error": round(error, 3),
                 "predicted_stage_s": [round(s, 4) for s in plan.stage_s],
                 "measured": {k.removeprefix("timing_s/"): round(v, 4) for k, v in got.items()}}
            )  # fmt: skip
            print(f"{model} {config}: measured {got['timing_s/step']:.3f} s, predicted {plan.step_s:.3f} s "
                  f"({error:+.0%})", flush=True)  # fmt: skip
    print("\n| model | placement (2 processes) | measured step s | predicted step s | error |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in results:
        name = f"{r['config']} (calibration)" if r["calibration"] else r["config"]
        print(f"| {r['model']} | {name} | {r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | "
              f"{r['error']:+.0%} |")  # fmt: skip
    constants = {
        m: {"train_eff": h.train_eff, "forward_eff": h.forward_eff, "decode_eff": h.decode_eff, "call_s": h.call_s,
            "train_call_s": h.train_call_s}
        for m, h in calibrated.items()
    }  # fmt: skip
    print(json.dumps({"flops": hardware.flops, "constants": constants, "rows": results}))


def cpu_calibration(devices: int) -> Any:
    """This machine as the planner calibrates it for ``devices`` processes: one process's float32 matmul peak with
    the threads Lightning gives each, memory bandwidth, host time per layer and per call, and the cores they share."""
    import torch

    from lightning_rlhf.perf import available_cores, cpu_matmul_peak, threads_per_process
    from lightning_rlhf.placement import calibration, cost_model
    from lightning_rlhf.placement.auto import rank_memory_bytes

    cores, threads = available_cores(), threads_per_process(devices)
    torch.set_num_threads(threads)  # calibrate what one process of the run has
    layer_step_s, layer_micro_s = calibration.measure_host_overheads()
    hardware = cost_model.cpu_hardware(
        flops=cpu_matmul_peak(torch.float32), memcpy_bw=calibration.measure_memcpy_bw(),
        memory=rank_memory_bytes(torch.device("cpu"), devices), processes=devices,
        layer_step_s=layer_step_s, layer_micro_s=layer_micro_s, call_s=calibration.measure_call_overhead(),
        cores=cores, threads=threads,
    )  # fmt: skip
    share = cost_model.core_share(cores=cores, processes=devices, threads=threads)
    print(
        f"calibration: matmul {hardware.flops / 1e9:.0f} GFLOP/s per process, memcpy {hardware.hbm_bw / 1e9:.1f} GB/s, "
        f"layer x decoding step {layer_step_s * 1e6:.0f} us, layer x micro-batch {layer_micro_s * 1e6:.0f} us, "
        f"role call {hardware.call_s * 1e3:.1f} ms; {cores:g} cores for {devices} processes of {threads} thread(s) "
        f"(share {share:.2f} when all are busy)",
        flush=True,
    )
    return hardware


def demo_main(args: argparse.Namespace) -> None:
    """The oversubscribed case: PPO on the demo task, colocated and split, measured and predicted, with the cores
    counted and (for comparison) not; and the placement ``cost_model.plan`` chooses. Runs on: the driver."""
    import dataclasses

    from transformers import AutoTokenizer

    from lightning_rlhf.demo.task import addition_splits
    from lightning_rlhf.demo.warmstart import prepare_demo_model
    from lightning_rlhf.placement import calibration, cost_model

    model_dir = prepare_demo_model(DEMO_CACHE)
    shape = cost_model.shape_of(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_len = round(statistics.mean(len(tok(r)["input_ids"]) for r in addition_splits()["train"]["prompt"]))
    wl = cost_model.Workload(
        prompts=DEMO_PROMPTS, n=DEMO_SAMPLES, prompt_len=prompt_len, response_len=DEMO_NEW_TOKENS,
        micro_tokens=DEMO_MICRO_BATCH * (prompt_len + DEMO_NEW_TOKENS),
    )  # fmt: skip
    counted = calibration.calibrate_for_shape(cpu_calibration(args.devices), shape, wl)
    variants = {"cores counted": counted, "cores not counted": dataclasses.replace(counted, cores=None)}
    flow = cost_model.dataflow_for(["actor", "critic"])  # PPO: the actor's old log-probs beside the critic's values
    chosen = {
        f"{name}, as `plan` calibrates": choice(cost_model, shape, wl, h, args.devices) for name, h in variants.items()
    }
    configs = [DEMO_CALIBRATION] + [c for c in DEMO_CONFIGS if c != DEMO_CALIBRATION]
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for _ in range(args.rounds):  # the placements in turn: a change in the machine's load falls on each
        for config in configs:
            runs[config].append(demo_run(config, args))
            print(f"{config}: step {runs[config][-1]['timing_s/step']:.3f} s", flush=True)
    rows = []
    for config in configs:
        got = {k: statistics.median(r[k] for r in runs[config] if k in r) for k in runs[config][0]}
        if config == DEMO_CALIBRATION:
            variants = {
                name: calibration.fit_call_costs(
                    h,
                    shape,
                    wl,
                    args.devices,
                    forward_s=[got[f"timing_s/{k}"] for k in ("old_log_prob", "values")],
                    train_s=[got[f"timing_s/{k}"] for k in ("update_actor", "update_critic")],
                )
                for name, h in variants.items()
            }
        pools = [[r for r in pool if r != "reward"] for pool in DEMO_CONFIGS[config][1]]
        sizes = [args.devices // len(pools)] * len(pools)
        pred = {
            name: cost_model.predict(pools, sizes, 1, model=shape, hardware=h, workload=wl, algorithm=flow).step_s
            for name, h in variants.items()
        }
        rows.append({"config": config, "measured_step_s": round(got["timing_s/step"], 4),
                     "rounds_step_s": [round(r["timing_s/step"], 4) for r in runs[config]],
                     "predicted_step_s": {k: round(v, 4) for k, v in pred.items()},
                     "measured": {k.removeprefix("timing_s/"): round(v, 4) for k, v in got.items()}})  # fmt: skip
    fastest = min(rows, key=lambda r: r["measured_step_s"])["config"]
    for name, h in variants.items():
        chosen[f"{name}, call costs fitted"] = choice(cost_model, shape, wl, h, args.devices)
    print(f"\n| placement ({args.devices} processes) | measured step s (rounds) | predicted, cores counted | error | "
          "predicted, cores not counted | error |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        name = f"{r['config']} (calibration)" if r["config"] == DEMO_CALIBRATION else r["config"]
        cells = [f"{r['predicted_step_s'][v]:.3f} | {r['predicted_step_s'][v] / r['measured_step_s'] - 1:+.0%}"
                 for v in ("cores counted", "cores not counted")]  # fmt: skip
        each = ", ".join(f"{t:.3f}" for t in r["rounds_step_s"])
        print(f"| {name} | {r['measured_step_s']:.3f} ({each}) | {' | '.join(cells)} |")
    for name, c in chosen.items():
        print(f"planner's choice, {name}: {c['groups']} on {c['devices']} (predicted {c['predicted_step_s']:.3f} s); "
              f"measured fastest: {fastest}")  # fmt: skip
    print(json.dumps({"rows": rows, "chosen": chosen, "measured_fastest": fastest}))


def choice(cost_model: Any, shape: Any, wl: Any, hardware: Any, devices: int) -> dict[str, Any]:
    """The placement ``cost_model.plan`` picks for the demo's PPO roles (single-process pool steps, rollout TP 1)."""
    flow = cost_model.dataflow_for(["actor", "critic"])
    best = cost_model.plan(model=shape, hardware=hardware, devices=devices, workload=wl, algorithm=flow, tp_sizes=(1,),
                        unit=1)  # fmt: skip
    return {"groups": [list(g) for g in best.groups], "devices": list(best.devices),
            "predicted_step_s": round(best.step_s, 4)}  # fmt: skip


def demo_run(config: str, args: argparse.Namespace) -> dict[str, float]:
    """One measured run of the demo (``python -m lightning_rlhf.demo --algo ppo``), colocated or split."""
    placement = "colocate" if config == DEMO_CALIBRATION else "split"
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "lightning_rlhf.demo", "--algo", "ppo", "--devices", str(args.devices)]
        cmd += ["--placement", placement, "--rollout", "hf", "--steps", str(args.steps), "--out", out]
        cmd += ["--cache", DEMO_CACHE, "--prompts", str(DEMO_PROMPTS), "--n", str(DEMO_SAMPLES)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=os.path.dirname(HERE))
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            raise SystemExit(f"demo {config}: the run failed ({proc.returncode})")
        folder = proc.stdout.strip().splitlines()[-1].removeprefix("run folder: ")
        return measured(folder, args.steps)


def run(model_dir: str, config: str, args: argparse.Namespace) -> dict[str, float]:
    """One measured run of ``config`` (a subprocess; Lightning starts its other ranks)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--config", config, "--model-dir"]
        cmd += [model_dir, "--out", out, "--steps", str(args.steps), "--devices", str(args.devices)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            raise SystemExit(f"{os.path.basename(model_dir)} {config}: the run failed ({proc.returncode})")
        return measured(out, args.steps)


if __name__ == "__main__":
    main()
