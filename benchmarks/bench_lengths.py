"""The actor's update against response length, activation checkpointing off and on: peak memory and step time.

    python benchmarks/bench_lengths.py                                  # 1k .. 16k, off and on, 3 repeats
    python benchmarks/bench_lengths.py --lengths 1024 4096 --repeats 2 --budget-gb 6
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/bench_lengths.py    # the peak of live tensors (see below)

Model: the vs-TRL benchmark's ``small`` shape (benchmarks/vs_trl/workload.py: Qwen2, hidden 256, 4 layers, 4/2 heads,
head_dim 64, MLP 704, vocabulary 4,096, tied embeddings; 4,002,048 parameters), float32, built locally with random
weights. Workload: ``--rows`` sequence(s) of ``--prompt-len`` prompt + L response tokens (no padding), group-normalised
advantages, on-policy, ``micro_batch_size`` 1 (each forward/backward holds one sequence), ``entropy_coef=0``, AdamW.
The update is :meth:`ActorRole.update` itself, on one process, ``--threads`` torch threads.

Each measurement is a child process of its own that loads the actor, runs a warm-up update on one 64-token row
(kernel set-up and AdamW's moments), then ``--updates`` measured updates, and exits; the parent reads the child's peak
resident memory from outside (``os.wait4``'s ``ru_maxrss``) and subtracts the peak of a child that does the same but
the measured updates (the baseline: the loaded model, its gradients and optimizer state). One measured update of
one row is one forward/backward: more of them make glibc's heap keep freed blocks, which the peak would count (it
keeps blocks under 32 MB freed within one update too; a fixed ``MALLOC_MMAP_THRESHOLD_`` gives every large tensor
a mapping of its own, returned when freed, so that the peak is the live tensors'). Off
and on alternate child by child (a busy moment of this shared machine hits both alike); the time is the median over
``--repeats`` children of each child's last update, in the process's CPU time (time other jobs take on a shared
machine is not counted; with one thread it is the update's compute) and in wall time. A point whose prediction
(the previous length's figure scaled by the length) exceeds ``--budget-gb`` is skipped and reported as over the
budget. Prints a markdown table and, as its last line, one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 1024 * 1024


def child(args: argparse.Namespace) -> None:
    """Loads the actor, runs ``--updates`` updates; prints one JSON line of times. Runs on: the child."""
    import torch
    from bench_update import rollout_batch  # benchmarks/bench_update.py
    from transformers import AutoTokenizer

    from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig
    from lightning_rlhf.roles import ActorRole

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model_path)
    actor = ActorRole(
        args.model_path,
        tokenizer=tok,
        rollout=RolloutConfig(n=args.rows, max_new_tokens=args.resp_len),
        algorithm=AlgorithmConfig(micro_batch_size=args.micro_batch_size, entropy_coef=0.0),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
    )
    actor.load()
    actor.train_engine.activation_checkpointing = args.checkpointing
    actor.configure_optimizer(total_steps=1000)
    assert actor.model is not None
    vocab = min(len(tok), actor.model.config.vocab_size)
    # A warm-up update on one short row: one-off costs (kernel set-up, AdamW's moments) out of the measured update.
    actor.update(rollout_batch(1, args.prompt_len, 64, 1, vocab))
    batch = rollout_batch(args.rows, args.prompt_len, args.resp_len, args.rows, vocab)
    times, cpu = [], []
    for _ in range(args.updates):
        t0, c0 = time.perf_counter(), time.process_time()
        actor.update(batch)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    print(json.dumps({"times": times, "cpu": cpu}))


def run_child(path: str, resp_len: int, checkpointing: bool, updates: int, args: argparse.Namespace) -> dict[str, Any]:
    """One child process; its times and its peak RSS (MiB) read from outside. Runs on: the parent."""
    cmd = [
        sys.executable, __file__, "--child", "--model-path", path, "--resp-len", str(resp_len),
        "--updates", str(updates), "--rows", str(args.rows), "--prompt-len", str(args.prompt_len),
        "--micro-batch-size", str(args.micro_batch_size), "--threads", str(args.threads),
        *(["--checkpointing"] if checkpointing else []),
    ]  # fmt: skip
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise SystemExit(f"L={resp_len} checkpointing={checkpointing} failed:\n{err.read().decode()[-4000:]}")
        result = json.loads(out.read().decode().strip().splitlines()[-1])
    return result | {"peak_mib": usage.ru_maxrss / 1024}  # Linux: ru_maxrss in KiB


def measure(path: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every length, off and on alternating, skipping points predicted over the budget. Runs on: the parent."""
    base = min(run_child(path, args.lengths[-1], False, 0, args)["peak_mib"] for _ in range(2))
    print(f"# loaded-model baseline: {base:.0f} MiB", file=sys.stderr, flush=True)
    results: dict[str, dict[str, Any]] = {}
    previous: dict[bool, tuple[int, float]] = {}
    for length in args.lengths:
        modes = []
        for ac in (False, True):
            if ac in previous:
                prev_len, prev_mib = previous[ac]
                predicted = prev_mib * length / prev_len
                if (base + predicted) * MIB > args.budget_gb * 1e9:
                    results[f"{length}/{'on' if ac else 'off'}"] = {"skipped": f"over the {args.budget_gb:g} GB budget"}
                    continue
            modes.append(ac)
        runs: dict[bool, list[dict[str, Any]]] = {ac: [] for ac in modes}
        for _ in range(args.repeats):
            for ac in modes:
                runs[ac].append(run_child(path, length, ac, args.updates, args))
        for ac in modes:
            peak = max(r["peak_mib"] for r in runs[ac]) - base
            previous[ac] = (length, peak)
            times, cpu = [r["times"][-1] for r in runs[ac]], [r["cpu"][-1] for r in runs[ac]]
            results[f"{length}/{'on' if ac else 'off'}"] = {
                "update_mib": peak,
                "step_s": statistics.median(times),
                "cpu_s": statistics.median(cpu),
                "step_s_all": times,
                "cpu_s_all": cpu,
            }
        print(f"# {json.dumps({k: v for k, v in results.items() if k.startswith(f'{length}/')})}", file=sys.stderr)
        if len(modes) == 2:
            off, on = results[f"{length}/off"], results[f"{length}/on"]
            print(
                f"# L={length}: off {off['update_mib']:.0f} MiB {off['cpu_s']:.2f} CPU s, on {on['update_mib']:.0f} "
                f"MiB {on['cpu_s']:.2f} CPU s",
                file=sys.stderr,
                flush=True,
            )
    results["baseline"] = {"peak_mib": base}
    return results


def main() -> None:
    """Parses the arguments; builds the model; runs the children; prints the table. Runs on: the parent."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--updates", type=int, default=1, help="updates per child; the last one is timed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget-gb", type=float, default=6.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--resp-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from bench_models import save_qwen2  # benchmarks/bench_models.py
    from vs_trl.workload import MODELS

    spec = MODELS["small"]
    with tempfile.TemporaryDirectory(prefix="bench_lengths_") as root:
        path = save_qwen2(
            os.path.join(root, "small"), vocab_size=spec.vocab, max_positions=max(args.lengths) + args.prompt_len,
            hidden_size=spec.hidden, intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
        )  # fmt: skip
        results = measure(path, args)
    print(
        f"\nactor update, small model ({spec.num_params():,} parameters, float32), {args.rows} rows x "
        f"({args.prompt_len} + L) tokens, micro-batch {args.micro_batch_size}, {args.threads} thread(s); memory: "
        f"peak RSS minus the baseline ({results['baseline']['peak_mib']:.0f} MiB); time: median of "
        f"{args.repeats}\n"
    )
    print(
        "| response tokens | update memory off (MiB) | on (MiB) | on / off | CPU s off | on | time cost | "
        "wall s off / on |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for length in args.lengths:
        off, on = results[f"{length}/off"], results[f"{length}/on"]
        if "skipped" in off or "skipped" in on:
            cells = [off.get("skipped") or f"{off['update_mib']:.0f}", on.get("skipped") or f"{on['update_mib']:.0f}"]
            print(f"| {length:,} | {cells[0]} | {cells[1]} | - | - | - | - | - |")
            continue
        print(
            f"| {length:,} | {off['update_mib']:.0f} | {on['update_mib']:.0f} | "
            f"{on['update_mib'] / off['update_mib']:.2f} | {off['cpu_s']:.2f} | {on['cpu_s']:.2f} | "
            f"{on['cpu_s'] / off['cpu_s'] - 1:+.0%} | {off['step_s']:.2f} / {on['step_s']:.2f} |"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
