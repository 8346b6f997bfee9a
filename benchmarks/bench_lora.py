"""Full fine-tuning against LoRA on 2 CPU processes: each rank's peak memory, step time, the hand-off's bytes and
seconds, with the KL term on (so a reference is needed: its own model with full fine-tuning, the actor's
base with its adapters off with LoRA).

    python benchmarks/bench_lora.py [--models small,m100] [--steps 8] [--rank 16]

Each run is ``tests/scripts/train.py`` (GRPO on the addition prompts, 8 prompts x 4 samples, 5 new tokens, the
transformers rollout engine) on a random-init model of ``benchmarks/vs_trl/workload.py``; a figure is the median of
the last 4 steps (peak memory: each rank's peak resident size over the run, ``perf/cpu_memory_peak_gb/rank<r>``;
hand-off bytes: what rank 0's engine takes, ``perf/weight_sync_bytes``, and what rank 0 gathered from rank 1 for
it, ``perf/weight_sync_gathered_bytes``). Prints a table and, last, one JSON line.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "vs_trl"))

import workload as W  # noqa: E402
from bench import MALLOC_ENV, build_models  # noqa: E402


def run(model: str, out: str, steps: int, rank: int | None) -> dict[str, float]:
    """One training run; returns its figures. Runs on: the benchmark's process (the run in children)."""
    command = [sys.executable, os.path.join(ROOT, "tests", "scripts", "train.py"), "--model", model, "--out", out]
    command += ["--steps", str(steps), "--prompts", "8", "--n", "4", "--kl-coef", "0.05", "--micro-batch-size", "32"]
    command += ["--lora-rank", str(rank)] if rank else []
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV}, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError((proc.stdout + proc.stderr)[-3000:])
    with open(os.path.join(out, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("timing_s/step")]

    def tail(key: str) -> float:
        return statistics.median(float(r[key]) for r in rows[-4:] if r.get(key))

    return {
        "peak_rss_gb_rank0": max(float(r["perf/cpu_memory_peak_gb/rank0"]) for r in rows),
        "peak_rss_gb_rank1": max(float(r["perf/cpu_memory_peak_gb/rank1"]) for r in rows),
        "s_per_step": tail("timing_s/step"),
        "update_s": tail("timing_s/update_actor"),
        "handoff_s": tail("timing_s/update_weights"),
        "handoff_mb": tail("perf/weight_sync_bytes") / 1e6,
        "gathered_mb": tail("perf/weight_sync_gathered_bytes") / 1e6,
    }


def main() -> None:
    """Build the models, run full and LoRA on each, print the table. Runs on: one process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small,m100")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--cache", default=os.path.join(ROOT, ".bench_cache"))
    args = p.parse_args()
    models = args.models.split(",")
    build_models(args.cache, models)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        for name in models:
            params = W.MODELS[name].num_params()
            for label, rank in (("full", None), (f"lora r={args.rank}", args.rank)):
                key = f"{name} ({params / 1e6:.1f}M) {label}"
                results[key] = run(
                    os.path.join(args.cache, name), os.path.join(tmp, key.replace(" ", "_")), args.steps, rank
                )
                print(key, json.dumps(results[key]), flush=True)
    print(
        f"{'run':32s} {'peak RSS GiB r0/r1':>18s} {'s/step':>7s} {'update s':>8s} {'hand-off s':>10s} {'MB taken':>9s}"
    )
    for key, r in results.items():
        peaks = f"{r['peak_rss_gb_rank0']:.2f}/{r['peak_rss_gb_rank1']:.2f}"
        print(
            f"{key:32s} {peaks:>18s} {r['s_per_step']:7.3f} {r['update_s']:8.3f} {r['handoff_s']:10.3f} "
            f"{r['handoff_mb']:9.1f}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
