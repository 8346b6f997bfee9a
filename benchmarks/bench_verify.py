"""The weight hand-off check's two sides, timed apart on one device: the trainer's fingerprints of its FSDP2 rows
(``shard_fingerprints``) and an engine's of the tensors it holds (``tensor_fingerprints``), with a profile of each.

Usage: python benchmarks/bench_verify.py MODEL_DIR [...] [--profile]. One process, a 1-rank process group (gloo on
CPU, NCCL on a GPU); the engine's copy in bfloat16 on a GPU, float32 on CPU, as the transformers engine holds it."""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from lightning_rlhf.engines.rollout.base import tensor_fingerprints
from lightning_rlhf.engines.rollout.reshard import shard_fingerprints


def timed(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    """Median seconds of ``fn`` over ``reps`` calls, the device idle before each."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    for path in args.models:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        engine = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        params = dict(engine.named_parameters())
        expected = shard_fingerprints(model, dtype=dtype)
        ranges = {name: rows for name, (rows, _) in expected.items()}
        sides = {
            "trainer": lambda m=model: shard_fingerprints(m, dtype=dtype),
            "engine": lambda p=params, r=ranges: tensor_fingerprints(p, r),
        }
        with torch.no_grad():
            for side, fn in sides.items():
                seconds = timed(fn, device)
                print(
                    f"{os.path.basename(path)} {side}: {seconds * 1e3:.2f} ms for {len(ranges)} tensors "
                    f"({seconds / len(ranges) * 1e6:.1f} us a tensor) on {device.type}"
                )
                if args.profile:
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(10):
                        fn()
                    prof.disable()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
