"""Peak memory per rank of loading a ~1B-parameter model over 2 ranks: whole-model ``from_pretrained`` then FSDP2
(before) against deferred loading on meta + FSDP2 + :func:`materialize` (after).

    python benchmarks/bench_sharded_load.py                     # builds the model once under /tmp, then measures
    python benchmarks/bench_sharded_load.py --cache-dir DIR --nproc 2

The model is Qwen2-shaped (hidden 2048, 16 layers, 16 heads, intermediate 5504, vocabulary 32000, untied
embeddings: 0.94B parameters, 3.8 GB in float32), random, written once with ``save_pretrained`` (2 GB shards).
Each variant runs in its own ``torchrun`` launch (gloo, CPU), so ``ru_maxrss`` is that variant's high-water mark.
Per rank it reports the resident size before loading (``VmRSS``, after the imports and the process group), the
peak (``ru_maxrss``), their difference, this rank's shard bytes, the largest full tensor, and the goal
``(shard + largest tensor) * 1.25``. Not a test: it needs ~4 GB of disk and ~9 GB of memory for "before".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HIDDEN, LAYERS, HEADS, INTERMEDIATE, VOCAB = 2048, 16, 16, 5504, 32000


def _rss_bytes() -> int:
    """Current resident set size of this process (``VmRSS``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def build_model(path: str) -> None:
    """Writes the random ~1B model (float32 safetensors) to ``path`` unless it is already there.

    Runs on: the launching process, once.
    """
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    began = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = path + ".partial"
    model.save_pretrained(tmp, max_shard_size="2GB")
    os.replace(tmp, path)
    n = sum(p.numel() for p in model.parameters())
    print(f"built {n / 1e9:.2f}B parameters into {path} in {time.perf_counter() - began:.0f} s", flush=True)


def worker(path: str, variant: str, dtype_name: str) -> None:
    """One rank of one variant: load, shard, measure; prints one JSON line. Runs on: every rank (torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from lightning_rlhf.engines.train.fsdp import shard_model
    from lightning_rlhf.engines.train.loading import load_pretrained, materialize

    dtype = getattr(torch, dtype_name)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    dist.barrier()
    before = _rss_bytes()
    began = time.perf_counter()
    if variant == "before":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        shard_model(model, mesh)
        bytes_read = -1
    else:
        model = load_pretrained(AutoModelForCausalLM, path, setting="bench", dtype=dtype, deferred=True)
        shard_model(model, mesh)
        bytes_read = materialize(model, device=torch.device("cpu")).bytes_read
    seconds = time.perf_counter() - began
    import gc

    gc.collect()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # a check that the loaded weights are real: the same sum on both variants
    checksum = float(sum(p.to_local().double().sum() for p in model.parameters()))  # type: ignore[attr-defined]
    out = {
        "variant": variant if dtype == torch.float32 else f"{variant} ({dtype_name})",
        "rank": rank,
        "rss_before": before,
        "peak": peak,
        "rss_after": _rss_bytes(),
        "shard": shard,
        "largest": largest,
        "bytes_read": bytes_read,
        "seconds": seconds,
        "checksum": checksum,
    }
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Builds the model if needed, runs both variants under torchrun, prints the table. Runs on: the launcher."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default="/tmp/lightning_rlhf_bench_1b")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--variants", default="before,after")
    parser.add_argument("--dtype", default="float32", help="storage dtype of the loaded model (bfloat16: cast)")
    parser.add_argument("--worker", choices=["before", "after"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = os.path.join(args.cache_dir, "qwen2-1b-untied")
    if args.worker:
        worker(path, args.worker, args.dtype)
        return
    os.makedirs(args.cache_dir, exist_ok=True)
    build_model(path)
    rows = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
        cmd += [os.path.abspath(__file__), "--cache-dir", args.cache_dir, "--worker", variant, "--dtype", args.dtype]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{variant} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        rows += [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    gib = 1024**3
    print(f"\n{args.nproc} ranks over gloo, model at {path}\n")
    print(
        "| variant | rank | RSS before GiB | peak GiB | peak - before GiB | shard GiB | largest tensor GiB "
        "| goal GiB | met? | read GiB | load s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: |")
    for r in sorted(rows, key=lambda r: (not r["variant"].startswith("before"), r["rank"])):
        grew = r["peak"] - r["rss_before"]
        goal = 1.25 * (r["shard"] + r["largest"])
        read = f"{r['bytes_read'] / gib:.2f}" if r["bytes_read"] >= 0 else "all (mmap)"
        met = "yes" if grew <= goal else "no"
        print(
            f"| {r['variant']} | {r['rank']} | {r['rss_before'] / gib:.2f} | {r['peak'] / gib:.2f} | {grew / gib:.2f} "
            f"| {r['shard'] / gib:.2f} | {r['largest'] / gib:.3f} | {goal / gib:.2f} | {met} "
            f"| {read} | {r['seconds']:.1f} |"
        )
    sums: dict[str, float] = {}
    for r in rows:
        sums[r["variant"]] = sums.get(r["variant"], 0.0) + r["checksum"]
    print("\nchecksum of all shards (must agree):", {k: round(v, 3) for k, v in sums.items()})


if __name__ == "__main__":
    main()
