"""Soak: thousands of reward calls with timeouts from a process shaped like a trainer rank.

    python benchmarks/soak_rewards.py --calls 2000
    python benchmarks/soak_rewards.py --calls 300 --impl fork   # the runner that forked per call, for contrast

Not a test (it takes minutes). The process holds what a worker rank holds while it scores: an in-process vLLM
engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the tiny demo model, eager, small KV cache) that generates every
``--generate-every`` calls, a live gloo process group (an all-reduce after every call), and an OpenMP pool kept
busy by a background thread multiplying matrices the whole time. Each step scores 64 samples with two rewards:
a closure defined here (one call, by value) and ``gsm8k_reward`` (two calls of 32 on two workers, by reference).
Every call has a timeout and no function ever hangs or crashes, so every failed sample is the runner's fault.
Prints calls, failed calls and samples, timeouts, crashes, and the latency percentiles of ``call_reward_fn``
(one per reward and step: what the rank waits for).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


def load_fork_runner(rev: str):
    source = subprocess.run(
        ["git", "show", f"{rev}:lightning_rlhf/rewards/runner.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.gettempdir()) / "soak_fork_runner.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("soak_fork_runner", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_fork_runner"] = module
    spec.loader.exec_module(module)
    return module.call_reward_fn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="reward calls in all (3 per step)")
    p.add_argument("--timeout", type=float, default=30.0, help="RewardConfig.timeout_s of every call")
    p.add_argument("--generate-every", type=int, default=10, help="steps between vLLM generate calls")
    p.add_argument("--impl", choices=["pool", "fork"], default="pool")
    p.add_argument("--fork-rev", default="b837941", help="git revision whose runner.py forks per call")
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    from lightning_rlhf.demo.tiny import save_tiny
    from lightning_rlhf.rewards import gsm8k_reward

    if args.impl == "fork":
        call_reward_fn = load_fork_runner(args.fork_rev)
    else:
        from lightning_rlhf.rewards.runner import call_reward_fn

    # gloo first, as on a trainer rank; vLLM joins it as an external launcher
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    model_dir = save_tiny(Path(tempfile.mkdtemp(prefix="soak_rewards_")) / "tiny")
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        kv_cache_memory_bytes=64 << 20,
        distributed_executor_backend="external_launcher",
        seed=0,
    )
    print(f"vLLM engine built in {time.perf_counter() - t0:.1f} s", flush=True)
    torch.set_num_threads(2)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    prompt_ids = [{"prompt_token_ids": [1, 10 + i % 50, 20, 30]} for i in range(32)]

    stop = threading.Event()
    matmuls = [0]

    def openmp_load() -> None:  # the OpenMP pool stays busy while the reward calls fork or spawn
        a = torch.randn(256, 256)
        while not stop.is_set():
            (a @ a).sum()
            matmuls[0] += 1

    thread = threading.Thread(target=openmp_load, name="openmp-load", daemon=True)
    thread.start()

    def addition(prompts, completions, answer, **kw):  # a closure over nothing: sent by value from __main__
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    n = 64
    prompts = [f"{i}+{i}=" for i in range(n)]
    completions = [f"The answer is #### {2 * i + (i % 4 == 0)}" for i in range(n)]
    columns = {"answer": [str(2 * i) for i in range(n)]}
    latencies: list[float] = []
    failed_calls = failed_samples = timeouts = crashes = 0
    ones = torch.ones(4)
    start = time.perf_counter()
    step = 0
    n_calls = 0
    while n_calls < args.calls:
        if step % args.generate_every == 0:
            outs = llm.generate(prompt_ids, params, use_tqdm=False)
            assert len(outs) == len(prompt_ids)
        for fn, batch, workers in ((addition, None, 1), (gsm8k_reward, n // 2, 2)):
            if n_calls >= args.calls:
                break
            t = time.perf_counter()
            out = call_reward_fn(
                fn, prompts, completions, columns, timeout_s=args.timeout, batch_size=batch, num_workers=workers
            )
            latencies.append(time.perf_counter() - t)  # what the rank waits for: the calls run at once
            n_calls += 1 if batch is None else n // batch
            failed_calls += out.timeouts + out.crashes
            failed_samples += int(out.failed.sum())
            timeouts += out.timeouts
            crashes += out.crashes
            dist.all_reduce(ones)
        step += 1
        if step % 100 == 0:
            print(f"  {n_calls} calls, {failed_calls} failed, {time.perf_counter() - start:.0f} s", flush=True)
    wall = time.perf_counter() - start
    stop.set()
    thread.join()
    lat = sorted(x * 1e3 for x in latencies)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))]

    print(
        f"SOAK impl={args.impl} calls={n_calls} call_reward_fn={len(lat)} failed_calls={failed_calls} "
        f"failed_samples={failed_samples} "
        f"timeouts={timeouts} crashes={crashes} p50_ms={pct(0.5):.2f} p99_ms={pct(0.99):.2f} max_ms={lat[-1]:.1f} "
        f"first_ms={latencies[0] * 1e3:.0f} wall_s={wall:.1f} steps={step} matmuls={matmuls[0]} "
        f"generate_calls={(step - 1) // args.generate_every + 1}"
    )
    sys.exit(0 if failed_calls == 0 else 1)  # vLLM's exit handler tears down the process groups


if __name__ == "__main__":
    main()
