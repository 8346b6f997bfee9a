"""Asynchronous rollouts on a long-tail workload: one step off-policy, streamed, and partial rollouts (transformers
engine, vLLM's engine server), steps per second and the rollout pool's idle share.

    python benchmarks/bench_long_tail.py [--steps 14] [--engines hf,vllm] [--quick]

The workload: a tiny random model (the demo's width) samples nearly uniformly, and one id in ``--mean-tokens`` of its
vocabulary ends a response, so response lengths are geometric (mean 16 tokens by default, capped at 8x the mean);
GRPO, 16 prompts x 8 samples a step, 2 processes (the actor and the reward on rank 0, a rollout pool on rank 1),
``max_staleness=2``. A run's figure is the median of its steps after the third; the pool's idle share is 1 - its
engine's busy seconds / the step (one step off: ``timing_s/gen``, the pool's whole call, an episode's tool time
included; streamed: ``rollout/stream/engine_s``, the engine's steps only). ``--workload tools``: the tool task's
episodes (its warm-started model, 16 x 8 a step, up to 3 turns) with a calculator whose latency is lognormal (median
40 ms, a tenth of the calls over 200 ms). Each mode
runs in its own child process (``--run``). Prints a table and, last, one JSON line.
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

MODES = {
    "one_step_off": {"max_staleness": 1},
    "stream": {"max_staleness": 2, "stream": True},
    "partial": {"max_staleness": 2, "partial_rollouts": True},
}


def short_answer(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """1 for a completion under 40 characters: a reward that varies within a group, so that GRPO updates."""
    return [float(len(c) < 40) for c in completions]


def slow_calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression with +, - and *, taking a while (lognormal latency: median 40 ms, a
    tenth of the calls over 200 ms).

    Args:
        expression: The expression, e.g. "482+397".
    """
    import random
    import time

    from lightning_rlhf.demo.calculator import calculator

    time.sleep(min(2.0, random.lognormvariate(-3.2, 1.25)))
    return calculator(expression)


def tool_module(mode: str) -> tuple[Any, Any]:
    """The tool task with a slow calculator: its module (GRPO, 16 x 8 episodes) and data module."""
    from lightning_rlhf import AlgorithmConfig, AsyncConfig, GRPOModule, KLConfig, PromptDataModule, RolloutConfig
    from lightning_rlhf.config import EpisodeConfig
    from lightning_rlhf.config.models import embedded_cache_dir
    from lightning_rlhf.demo.tool_task import CalculatorEnvironment, tool_splits
    from lightning_rlhf.demo.warmstart import prepare_tool_model

    class SlowCalculatorEnvironment(CalculatorEnvironment):
        tools = (slow_calculator,)

    module = GRPOModule(
        prepare_tool_model(embedded_cache_dir()),
        environment=SlowCalculatorEnvironment,
        reference=False,
        rollout=RolloutConfig(n=8, max_new_tokens=96, episode=EpisodeConfig(max_turns=3, tool_workers=4)),
        algorithm=AlgorithmConfig(kl=KLConfig(coef=0.0), asynchronous=AsyncConfig(**MODES[mode])),
    )
    return module, PromptDataModule(tool_splits()["train"], batch_size=16, max_prompt_length=64, seed=0)


def run(mode: str, engine: str, steps: int, out: str, model: str, mean: int) -> None:
    """One run on 2 processes (this script relaunched by Lightning for rank 1). Runs on: every rank."""
    import torch
    from transformers import AutoConfig

    from lightning_rlhf import (
        AlgorithmConfig,
        AsyncConfig,
        GRPOModule,
        KLConfig,
        PromptDataModule,
        RolloutConfig,
    )
    from lightning_rlhf.demo import addition_dataset

    torch.set_num_threads(1)
    if model == "tools":  # episodes of the tool task, the calculator slow and uneven
        module, data = tool_module(mode)
        _fit(module, data, engine, steps, out)
        return
    vocab = AutoConfig.from_pretrained(model).vocab_size
    stops = tuple(range(vocab - vocab // mean, vocab))  # one id in ``mean`` ends a response
    module = GRPOModule(
        model,
        reward=short_answer,
        reference=False,
        rollout=RolloutConfig(n=8, max_new_tokens=8 * mean, stop_token_ids=stops, seed=0),
        algorithm=AlgorithmConfig(kl=KLConfig(coef=0.0), asynchronous=AsyncConfig(**MODES[mode])),
    )
    data = PromptDataModule(addition_dataset(num_prompts=100), batch_size=16, max_prompt_length=32, seed=0)
    _fit(module, data, engine, steps, out)


def _fit(module: Any, data: Any, engine: str, steps: int, out: str) -> None:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_rlhf import RLHFStrategy

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=RLHFStrategy(engine, placement={"actor": [0], "reward": [0], "rollout": [1]}),
        max_steps=steps,
        logger=CSVLogger(out, name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, datamodule=data)


def figures(out: str, mode: str) -> dict[str, float]:
    """Steps per second and the pool's idle share of a finished run (its steps after the third)."""
    with open(os.path.join(out, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("timing_s/step") and r.get("actor/grad_norm")][2:]
    step = statistics.median(float(r["timing_s/step"]) for r in rows)
    busy_key = "timing_s/gen" if mode == "one_step_off" else "rollout/stream/engine_s"
    busy = statistics.median(float(r[busy_key]) / float(r["timing_s/step"]) for r in rows)
    lengths = [float(r["response_length/mean"]) for r in rows]
    return {
        "s_per_step": round(step, 3),
        "steps_per_s": round(1 / step, 2),
        "pool_idle": round(max(0.0, 1 - busy), 3),
        "response_length_mean": round(statistics.mean(lengths), 1),
        "staleness_max": max(float(r["training/staleness_max"]) for r in rows),
        "mixed_versions": round(statistics.mean(float(r.get("rollout/stream/mixed_versions") or 0) for r in rows), 3),
    }


def main() -> None:
    """Run every mode in a child, alternating, and print the table. Runs on: the benchmark's process."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--mean-tokens", type=int, default=16, help="the responses' mean length (the cap is 8x)")
    p.add_argument(
        "--workload",
        choices=["lengths", "tools"],
        default="lengths",
        help="lengths: geometric response lengths; tools: the tool task's episodes with a slow, uneven calculator",
    )
    p.add_argument("--quick", action="store_true", help="5 steps, the transformers engine only (a smoke run)")
    p.add_argument("--run", choices=sorted(MODES), help=argparse.SUPPRESS)
    p.add_argument("--engine", default="hf", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        run(args.run, args.engine, args.steps, args.out, args.model, args.mean_tokens)
        return
    from lightning_rlhf.demo.tiny import save_tiny
    from lightning_rlhf.engines.rollout.vllm import vllm_available

    steps, engines = (5, ["hf"]) if args.quick else (args.steps, args.engines.split(","))
    engines = [e for e in engines if e != "vllm" or vllm_available()]
    work = tempfile.mkdtemp(prefix="bench_long_tail_")
    model = "tools"
    if args.workload == "lengths":
        model = save_tiny(os.path.join(work, "model"), seed=0, max_positions=max(256, 8 * args.mean_tokens + 64))
    report: dict[str, Any] = {"steps": steps, "workload": args.workload, "mean_tokens": args.mean_tokens}
    for engine in engines:
        for mode in MODES:
            out = os.path.join(work, f"{engine}-{mode}")
            command = [sys.executable, __file__, "--run", mode, "--engine", engine, "--steps", str(steps)]
            command += ["--mean-tokens", str(args.mean_tokens)]
            proc = subprocess.run([*command, "--out", out, "--model", model], capture_output=True, text=True)
            if proc.returncode != 0:
                report[f"{engine}/{mode}"] = {"error": (proc.stdout + proc.stderr)[-2000:]}
                print(f"{engine:>5} {mode:>13}: failed\n{report[f'{engine}/{mode}']['error']}", flush=True)
                continue
            report[f"{engine}/{mode}"] = found = figures(out, mode)
            print(f"{engine:>5} {mode:>13}: {json.dumps(found)}", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
