"""Episodes per second on the embedded tool task: lightning_rlhf (2 processes, vLLM and transformers engines) against
TRL 1.16's ``GRPOTrainer`` with ``tools=`` (issue 33), alternating in one run.

    make bench-tools-vs-trl          # or: python benchmarks/vs_trl/bench_tools.py --trl-python .venv-trl/bin/python

Both sides start from the same model folder (``lightning-rlhf/tiny-tools``, built here first), train on the same
prompts (``recipes/data/tools_train.jsonl``), 16 prompts x 8 samples per step, temperature 1, up to 3 assistant turns,
one optimizer step per generation, no KL, and get the same ``MALLOC_*`` settings. Runs alternate (TRL, ours with
vLLM, ours with transformers, TRL, ...) ``--repeats`` times, ``--steps`` steps each; a run's figure is the median
step time of its last 6 steps, an episode per sample. Prints a table and, last, one JSON line.
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
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench import MALLOC_ENV  # noqa: E402  (the allocator settings of the main benchmark)

EPISODES_PER_STEP = 16 * 8


def _median_tail(values: list[float], tail: int = 6) -> float:
    return statistics.median(values[-tail:])


def run_trl(python: str, model: str, steps: int, out: str) -> dict[str, Any]:
    """One TRL run (``run_trl_tools.py`` in TRL's venv). Runs on: the benchmark's process (a child runs TRL)."""
    path = os.path.join(out, "trl.json")
    command = [python, os.path.join(HERE, "run_trl_tools.py"), "--model-dir", model, "--steps", str(steps)]
    command += ["--data", os.path.join(ROOT, "recipes", "data", "tools_train.jsonl"), "--out", path]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV}, cwd=out)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    with open(path) as f:
        report = json.load(f)
    step = _median_tail([r["step"] for r in report["steps"]])
    return {"s_per_step": step, "episodes_per_s": EPISODES_PER_STEP / step, "rewards": report["rewards"]}


def run_ours(engine: str, cache: str, steps: int, out: str) -> dict[str, Any]:
    """One run of ``python -m lightning_rlhf.demo --task tools`` on 2 processes. Runs on: the benchmark's process."""
    command = [sys.executable, "-m", "lightning_rlhf.demo", "--task", "tools", "--rollout", engine]
    command += ["--steps", str(steps), "--cache", cache, "--out", out]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV}, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    run = proc.stdout.strip().splitlines()[-1].removeprefix("run folder: ")
    with open(os.path.join(run, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("timing_s/step")]
    step = _median_tail([float(r["timing_s/step"]) for r in rows])
    rewards = [float(r["critic/score/mean"]) for r in rows if r.get("critic/score/mean")]
    return {"s_per_step": step, "episodes_per_s": EPISODES_PER_STEP / step, "rewards": rewards}


def main() -> None:
    """Run the alternating benchmark. Runs on: one process (each run in children)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trl-python", default=os.path.join(ROOT, ".venv-trl", "bin", "python"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sides", default="trl,vllm,hf", help="which runs, in the order they alternate")
    p.add_argument("--cache", default=os.environ.get("LIGHTNING_RLHF_CACHE") or os.path.join(ROOT, ".bench_cache"))
    args = p.parse_args()
    args.trl_python = os.path.abspath(args.trl_python)  # the runs start in other folders
    from lightning_rlhf.demo.warmstart import prepare_tool_model

    model = prepare_tool_model(args.cache)
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in args.sides.split(",")}
    with tempfile.TemporaryDirectory(prefix="bench-tools-") as tmp:
        for r in range(args.repeats):
            for side in results:
                out = os.path.join(tmp, f"{side}-{r}")
                os.makedirs(out)
                if side == "trl":
                    res = run_trl(args.trl_python, model, args.steps, out)
                else:
                    res = run_ours(side, args.cache, args.steps, out)
                results[side].append(res)
                shown = res.get("error", "")[-2000:] or f"{res['s_per_step']:.3f} s/step"
                print(f"run {r} {side}: {shown}", flush=True)
    summary: dict[str, Any] = {}
    for side, runs in results.items():
        good = [x["episodes_per_s"] for x in runs if "error" not in x]
        if good:
            summary[f"{side}_episodes_per_s"] = round(statistics.median(good), 2)
    print(f"{'side':>6} {'episodes/s':>11} {'vs TRL':>7}")
    for side in results:
        eps = summary.get(f"{side}_episodes_per_s")
        trl = summary.get("trl_episodes_per_s")
        ratio = f"{eps / trl:.2f}x" if eps and trl else "-"
        summary[f"{side}_vs_trl"] = round(eps / trl, 3) if eps and trl else None
        print(f"{side:>6} {eps if eps is not None else 'failed':>11} {ratio:>7}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
