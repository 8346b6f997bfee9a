"""Wall-clock overheads that unit tests used to assert (flaky on a shared machine), measured here instead.

    python benchmarks/bench_overheads.py                 # everything (about a minute on 2 free CPU cores)
    python benchmarks/bench_overheads.py --part demo     # or: --part rewards, --part hub
    python benchmarks/bench_overheads.py --json out.json # also write the figures as JSON

The tests keep only the behaviour (a cached model is not rebuilt, a hung call is killed and counted, calls
overlap); the times live here, each with the bound a test once asserted, for comparison:

- ``demo``: ``save_tiny`` (the tiny random Qwen2 and its tokenizer, built and saved; was < 1 s), the demo
  model's first ``prepare_demo_model`` (build + 60 warm-start steps) and a cache hit (was < 0.1 s).
- ``rewards``: a reward call with a timeout whose function hangs (``timeout_s=1``, was < 3 s) or ignores
  SIGTERM (``timeout_s=0.5``, was < 3 s): the time until the call returns with its samples failed, i.e. the
  timeout plus the kill; and four 1 s calls on four reward workers (was < 3 s; 4 s one after another). The
  workers are started before the timed calls (benchmarks/bench_reward_calls.py measures per-call overhead).
- ``hub``: ``resolve_model_path`` of a hub id that is not in the cache while the hub does not answer
  (a closed local port): how soon it fails (transformers' own retries take about 30 s).

Each figure is the median of ``--repeats`` runs (min and max shown), after one untimed warm-up where that
makes sense.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """Median, min and max wall time (seconds) of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": repeats}


def bench_demo(repeats: int) -> dict[str, dict[str, float]]:
    """``save_tiny``, a cold ``prepare_demo_model`` and a cache hit."""
    from lightning_rlhf.demo import prepare_demo_model, save_tiny

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(10**6))
        out["save_tiny (first in this process)"] = timed(lambda: save_tiny(os.path.join(tmp, "first"), seed=1), 1)
        out["save_tiny"] = timed(lambda: save_tiny(os.path.join(tmp, f"m{next(counter)}"), seed=1), repeats)
        cold = [os.path.join(tmp, f"cache{i}") for i in range(max(1, repeats // 3))]
        it = iter(cold)
        out["prepare_demo_model (cold: build + warm start)"] = timed(lambda: prepare_demo_model(next(it)), len(cold))
        out["prepare_demo_model (cache hit)"] = timed(lambda: prepare_demo_model(cold[0]), repeats)
    return out


def _hang(prompts: list[str], completions: list[str], **kw: object) -> list[float]:
    time.sleep(1000)
    return [0.0] * len(completions)


def _stubborn(prompts: list[str], completions: list[str], **kw: object) -> list[float]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(1000)
    return [0.0] * len(completions)


def _one_second(prompts: list[str], completions: list[str], **kw: object) -> list[float]:
    time.sleep(1.0)
    return [1.0] * len(completions)


def bench_rewards(repeats: int) -> dict[str, dict[str, float]]:
    """Time until a hung call returns after its timeout, and four 1 s calls on four workers."""
    from lightning_rlhf.rewards.runner import call_reward_fn, close_reward_pools, reward_workers

    prompts, completions = ["1+1=", "2+2=", "3+3=", "4+4="], ["2", "4", "6", "8"]
    out = {}
    try:
        for fn, timeout_s in ((_hang, 1.0), (_stubborn, 0.5)):
            reward_workers(fn).start(1)

            def call(fn: Callable[..., list[float]] = fn, timeout_s: float = timeout_s) -> None:
                result = call_reward_fn(fn, prompts, completions, {}, timeout_s=timeout_s)
                assert result.timeouts == 1 and bool(result.failed.all()), result

            out[f"{fn.__name__.strip('_')} call, timeout_s={timeout_s}: until it returns"] = timed(call, repeats)
        reward_workers(_one_second).start(4)

        def four_calls() -> None:
            result = call_reward_fn(_one_second, prompts, completions, {}, timeout_s=30.0, batch_size=1, num_workers=4)
            assert result.scores.tolist() == [1.0] * 4, result

        four_calls()  # warm-up
        out["4 calls of 1 s on 4 workers (4 s one after another)"] = timed(four_calls, repeats)
    finally:
        close_reward_pools()
    return out


def bench_hub(repeats: int) -> dict[str, dict[str, float]]:
    """How soon an uncached hub id fails while the hub does not answer (a closed local port)."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
    os.environ.pop("HF_HUB_OFFLINE", None)
    from lightning_rlhf.config.models import hub_reachable, resolve_model_path

    def resolve() -> None:
        hub_reachable.cache_clear()
        try:
            resolve_model_path("someone/made-up-model", setting="RLHFModule(actor=...)")
        except FileNotFoundError:
            return
        raise AssertionError("an unreachable hub id resolved")

    return {"resolve an uncached hub id, hub unreachable": timed(resolve, repeats)}


PARTS = {"demo": bench_demo, "rewards": bench_rewards, "hub": bench_hub}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median reported)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    results = {}
    for name, bench in PARTS.items():
        if args.part in (name, "all"):
            results[name] = bench(args.repeats)
    load = os.getloadavg()
    print(f"cpus {os.cpu_count()}, load average {load[0]:.1f} (1 min): figures scale with it")
    print(f"{'what':70s} {'median s':>9s} {'min s':>8s} {'max s':>8s}")
    for name, figures in results.items():
        for what, f in figures.items():
            low, high = f.get("min_s"), f.get("max_s")
            extra = f"{low:8.3f} {high:8.3f}" if low is not None and high is not None else ""
            print(f"{name + ': ' + what:70s} {f['median_s']:9.3f} {extra}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_average": load, **results}, indent=2))


if __name__ == "__main__":
    main()
