"""The causal LM head and the token log-probs: the whole ``[T, V]`` logits against the blocked head
(``engines/train/head.py``), at a real vocabulary: peak memory and time of a training forward + backward, and of a
scoring forward.

    python benchmarks/bench_token_head.py                       # Qwen2.5-0.5B's width, 2 layers, 2 x 578 tokens
    python benchmarks/bench_token_head.py --layers 24 --repeats 2

Model: ``build_family("qwen2.5-0.5b", layers=--layers)`` (hidden 896, vocabulary 151,936, tied embeddings; random
weights, built locally once), float32, one process, ``--threads`` torch threads, no FSDP. Workload: ``--rows`` rows
of ``--prompt-len`` prompt + ``--resp-len`` response tokens, the loss ``sum(logp * a) + 0.01 sum(entropy)``. Each
measurement is a child process (whole and blocked alternate, ``--repeats`` of each): one warm-up pass, then one
measured; the parent reads the child's peak resident memory from outside (``os.wait4``'s ``ru_maxrss``) less a child
that only loads the model. Time: the child's CPU time of the measured pass. Prints a markdown table and, last, one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(args: argparse.Namespace) -> None:
    """One measured pass (``--mode``: ``whole`` or ``blocked``; ``--train`` or a scoring forward). Runs on: child."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_rlhf.batch import Batch
    from lightning_rlhf.engines.train import forward_response, head

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
    if args.mode == "load":
        print(json.dumps({"cpu_s": 0.0}))
        return
    if args.mode == "whole":
        head.HEAD_CHUNK_ELEMENTS = 1 << 62
    g = torch.Generator().manual_seed(0)
    rows, p, r = args.rows, args.prompt_len, args.resp_len
    batch = Batch(
        {
            "prompts": torch.randint(10, 1000, (rows, p), generator=g),
            "prompt_mask": torch.ones(rows, p, dtype=torch.long),
            "responses": torch.randint(10, 1000, (rows, r), generator=g),
            "response_mask": torch.ones(rows, r, dtype=torch.long),
        }
    )

    def one_pass() -> None:
        with torch.set_grad_enabled(args.train):
            out = forward_response(model, batch, output="logprobs", with_entropy=True)
            if args.train:
                (out["logprobs"].sum() + 0.01 * out["entropy"].sum()).backward()
                model.zero_grad(set_to_none=True)

    one_pass()
    start = time.process_time()
    one_pass()
    print(json.dumps({"cpu_s": time.process_time() - start}))


def run_child(args: argparse.Namespace, mode: str, train: bool) -> tuple[float, float]:
    """(peak MiB, CPU seconds) of one child."""
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--model-path", args.model_path]
    cmd += ["--rows", str(args.rows), "--prompt-len", str(args.prompt_len), "--resp-len", str(args.resp_len)]
    cmd += ["--threads", str(args.threads)] + (["--train"] if train else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    out = proc.stdout.read() if proc.stdout else ""
    if status:
        raise SystemExit(f"child {mode} failed ({status}): {out}")
    return usage.ru_maxrss / 1024, json.loads(out.strip().splitlines()[-1])["cpu_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=66)
    parser.add_argument("--resp-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--mode", default="whole")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--model-path", default="")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from lightning_rlhf.config.models import embedded_cache_dir
    from lightning_rlhf.demo import warmstart
    from lightning_rlhf.demo.families import build_family

    name = f"bench-qwen2.5-0.5b-{args.layers}l"
    folder = warmstart.build_once(
        embedded_cache_dir(),
        name,
        lambda tmp: build_family("qwen2.5-0.5b", os.path.join(tmp, "model"), layers=args.layers),
    )
    args.model_path = folder
    base = run_child(args, "load", False)[0]
    figures: dict[str, dict[str, float]] = {}
    print("| pass | head | peak over the loaded model (MiB) | CPU s |\n| --- | --- | ---: | ---: |")
    for train in (True, False):
        samples: dict[str, list[tuple[float, float]]] = {"whole": [], "blocked": []}
        for _ in range(args.repeats):
            for mode in samples:
                samples[mode].append(run_child(args, mode, train))
        for mode, got in samples.items():
            peak = statistics.median(m for m, _ in got) - base
            cpu = statistics.median(c for _, c in got)
            kind = "train" if train else "score"
            figures[f"{kind}/{mode}"] = {"peak_mib": peak, "cpu_s": cpu}
            print(f"| {kind} | {mode} | {peak:.0f} | {cpu:.2f} |")
    print(json.dumps({"layers": args.layers, "rows": args.rows, "tokens": args.prompt_len + args.resp_len, **figures}))


if __name__ == "__main__":
    main()
