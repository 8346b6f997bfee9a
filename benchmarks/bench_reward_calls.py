"""Per-call overhead of a reward function with a timeout, from a process holding a large heap.

    python benchmarks/bench_reward_calls.py --heap-gib 3 --impl pool
    python benchmarks/bench_reward_calls.py --heap-gib 3 --impl fork   # the forked child of each call (git HEAD~)

``pool`` is the reward worker pool (``lightning_rlhf.rewards.runner``); ``fork`` loads the runner that forked
a child per call from git (``--fork-rev``, default the last commit whose runner forked) and runs it the same
way; ``inline`` calls the function in-process (``timeout_s=None``). The heap is a float32 tensor filled with
ones, so its pages are resident: the cost of a fork grows with them, the pool's should not.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def addition(prompts, completions, answer, **kw):
    """The demo's kind of rule reward: exact match of the completion's first number."""
    return [float(c.strip().split(" ")[0] == a) for c, a in zip(completions, answer, strict=True)]


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return kb / 2**20


def load_fork_runner(rev: str):
    source = subprocess.run(
        ["git", "show", f"{rev}:lightning_rlhf/rewards/runner.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    if 'get_context("fork")' not in source:
        raise SystemExit(f"runner.py at {rev} does not fork; pass --fork-rev with a revision whose runner does")
    path = Path("/tmp/bench_fork_runner.py")
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("bench_fork_runner", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_fork_runner"] = module
    spec.loader.exec_module(module)
    return module.call_reward_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heap-gib", type=float, default=0.5, help="resident memory of the process to reach")
    p.add_argument("--impl", choices=["pool", "fork", "inline"], default="pool")
    p.add_argument("--fork-rev", default="b837941", help="git revision whose runner.py forks per call")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--samples", type=int, default=64)
    args = p.parse_args()

    torch.set_num_threads(1)
    from lightning_rlhf.rewards.runner import call_reward_fn  # what a trainer has imported, for every impl

    if args.impl == "fork":
        call_reward_fn = load_fork_runner(args.fork_rev)
    extra = max(0.0, args.heap_gib - rss_gib())
    heap = torch.ones(int(extra * 2**30 / 4))  # touched: resident
    prompts = [f"{i}+{i}=" for i in range(args.samples)]
    completions = [str(2 * i + (i % 3 == 0)) for i in range(args.samples)]
    columns = {"answer": [str(2 * i) for i in range(args.samples)]}
    timeout_s = None if args.impl == "inline" else 60.0

    t0 = time.perf_counter()
    call_reward_fn(addition, prompts, completions, columns, timeout_s=timeout_s)
    first_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        out = call_reward_fn(addition, prompts, completions, columns, timeout_s=timeout_s)
        times.append((time.perf_counter() - t0) * 1e3)
        assert not out.failed.any()
    times.sort()
    print(
        f"impl={args.impl} rss={rss_gib():.2f}GiB samples={args.samples} calls={args.calls} "
        f"first_ms={first_ms:.1f} median_ms={statistics.median(times):.2f} "
        f"p90_ms={times[int(0.9 * (len(times) - 1))]:.2f} max_ms={times[-1]:.2f} load={os.getloadavg()[0]:.1f}"
    )
    del heap


if __name__ == "__main__":
    main()
