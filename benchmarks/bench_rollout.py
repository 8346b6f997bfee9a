"""Rollout throughput (transformers vs vLLM engine) and weight hand-off cost vs model size.

    python benchmarks/bench_rollout.py                # everything (a few minutes on 2 CPU cores)
    python benchmarks/bench_rollout.py --part rollout # or: --part sync
    python benchmarks/bench_rollout.py --part sync --engines hf

Rollout: one process, the same tiny Qwen2 and workload for both engines (64 prompts x 4 samples, 32 new
tokens, temperature 1, EOS disabled by a stop id that never occurs so every response has the full length);
response tokens per second over 3 timed rounds after a warm-up round.

Hand-off: two processes (torchrun), the actor sharded with FSDP2 over both, a colocated engine per rank
(transformers, or vLLM with TP=1) with full tensors moved by gloo's all-gather ("collective") or through the
host's shared memory ("shared"), or with the transformers engines reading one shared copy of the weights
that each rank writes its rows into ("store": ``SharedWeights``, timed from before its entry barrier), and a
vLLM engine with TP=2 (one engine over both ranks, full tensors as the
peers do, or only each rank's TP slices); median time of ``load_weights(weights_for(...))`` (exchange +
hand-off + the engine's own loading), bytes each rank received from the other and bytes it handed to its
engine, for three model sizes. The physical scale beside each: both ranks copying the bytes their engine
takes at the same time (one flat tensor copy each), and the time as a multiple of it.
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

import torch

SIZES = {  # parameters: (hidden, layers, heads, kv_heads, intermediate); head_dim 32 or 64 (CPU attention sizes)
    "0.3M": (128, 2, 4, 2, 256),
    "9.5M": (512, 4, 8, 4, 1024),
    "94M": (1024, 8, 16, 8, 2816),
}


def memcpy_gbps(mb: int = 256) -> float:
    """Host memcpy bandwidth (GB/s) of one large tensor copy: the scale for the hand-off figures."""
    src = torch.empty(mb << 18, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.numel() * 4 / min(times) / 1e9


def _model(folder: str, size: str) -> str:
    from lightning_rlhf.demo import save_tiny

    hidden, layers, heads, kv, inter = SIZES[size]
    path = os.path.join(folder, size)
    if not os.path.isdir(path):
        save_tiny(
            path, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv, intermediate_size=inter
        )
    return path


def bench_rollout(folder: str, size: str) -> None:
    """Both engines on one model size, in this process (vLLM builds one engine per process)."""
    from transformers import AutoModelForCausalLM

    from lightning_rlhf.config import VLLMConfig
    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.engines.rollout import HFRolloutEngine, SamplingParams
    from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine

    path = _model(folder, size)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(4, 18, (8,), generator=gen).tolist()] for _ in range(64)]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=32, stop_token_ids=(23,))
    hf = HFRolloutEngine(
        model, pad_token_id=0, eos_token_id=23, device=torch.device("cpu"), decode_loop=CPULayer().decode_loop()
    )
    engine = VLLMRolloutEngine(
        path,
        param_names=[n for n, _ in model.named_parameters()],
        config=VLLMConfig(load_format="auto"),
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=64,
        tie_word_embeddings=True,
        layer=CPULayer(),
    )
    for name, eng in (("transformers", hf), ("vllm", engine)):
        eng.generate(prompts, params)  # warm-up
        rates = []
        for seed in range(3):
            t0 = time.perf_counter()
            out = eng.generate(prompts, SamplingParams(**{**params.__dict__, "seed": seed}))
            rates.append(sum(len(r) for r in out.responses) / (time.perf_counter() - t0))
        print(f"rollout  {size:<5} {name:<13} {statistics.median(rates):>9.0f} response tokens/s", flush=True)


def sync_worker(path: str, engine_kind: str, tp: int, transfer: str, transport: str, out: str) -> None:
    """One rank of the hand-off benchmark (under torchrun)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from lightning_rlhf.config import VLLMConfig
    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.engines.rollout import HFRolloutEngine
    from lightning_rlhf.engines.rollout.reshard import weights_for
    from lightning_rlhf.engines.train import shard_model

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if engine_kind == "hf":
        engine = HFRolloutEngine(
            model, pad_token_id=0, eos_token_id=23, device=torch.device("cpu"), decode_loop=CPULayer().decode_loop()
        )
    else:
        from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine

        engine = VLLMRolloutEngine(
            path,
            param_names=[n for n, _ in model.named_parameters()],
            config=VLLMConfig(tensor_parallel_size=tp, kv_cache_memory_bytes=64 << 20, weight_transfer=transfer),
            dtype=torch.float32,
            device=torch.device("cpu"),
            max_model_len=64,
            tie_word_embeddings=True,
            hf_config=model.config,
            layer=CPULayer(),
        )
    shard_model(model, dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),)), layer=CPULayer())
    store = None
    if transport == "store":  # the engines read one shared copy: each rank writes its rows (two barriers)
        from lightning_rlhf.cpu.shared_weights import SharedWeights

        store = SharedWeights.attempt(engine, model)
        assert store is not None, "no shared store on this host"
    times, received, handed = [], 0, 0
    for _ in range(12):
        dist.barrier()
        box = [0]
        t0 = time.perf_counter()
        if store is not None:
            store.hand_off(box)
            handed = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        else:
            handed = engine.load_weights(
                weights_for(engine, model, box, transport=transport, into_engine=True, layer=CPULayer())
            )
        times.append(time.perf_counter() - t0)
        received = box[0]
    # the physical scale: every rank copies the bytes its engine takes at the same time (one flat copy each)
    src = torch.ones(max(handed, 4) // 4)
    dst = torch.empty_like(src)
    copies = []
    for _ in range(12):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        result = {"params": params, "s": statistics.median(times[2:]), "received": received, "handed": handed}
        with open(out, "w") as f:
            json.dump({**result, "memcpy_s": statistics.median(copies[2:])}, f)
    dist.barrier()


CASES = (  # engine, TP, transfer, transport
    ("hf", 1, "full", "collective"),
    ("hf", 1, "full", "shared"),
    ("hf", 1, "full", "store"),
    ("vllm", 1, "full", "collective"),
    ("vllm", 1, "full", "shared"),
    ("vllm", 2, "full", "auto"),
    ("vllm", 2, "slices", "auto"),
)


def bench_sync(folder: str, engines: tuple[str, ...] = ("hf", "vllm")) -> None:
    print(f"memcpy   {memcpy_gbps():.1f} GB/s (one 256 MB host copy)")
    print(
        "hand-off  size   engine TP transfer transport   params   time ms   received/rank MB   handed/rank MB"
        "   memcpy ms   x memcpy"
    )
    for size in SIZES:
        path = _model(folder, size)
        for engine, tp, transfer, transport in (case for case in CASES if case[0] in engines):
            out = os.path.join(folder, f"sync-{size}-{engine}-{tp}-{transfer}-{transport}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
            cmd += ["--worker", path, "--engine", engine, "--tp", str(tp), "--transfer", transfer]
            cmd += ["--transport", transport, "--out", out]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"sync worker failed ({size}, {engine}, TP={tp}, {transfer}):\n{proc.stderr[-3000:]}")
            with open(out) as f:
                r = json.load(f)
            print(
                f"          {size:<6} {engine:<6} {tp:>2} {transfer:<8} {transport:<10} {r['params'] / 1e6:>6.1f}M "
                f"{r['s'] * 1e3:>9.2f} {r['received'] / 2**20:>18.2f} {r['handed'] / 2**20:>16.2f} "
                f"{r['memcpy_s'] * 1e3:>11.2f} {r['s'] / r['memcpy_s']:>10.1f}",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["all", "rollout", "sync"], default="all")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rollout-size", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--transfer", default="full", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="vllm", help=argparse.SUPPRESS)
    p.add_argument("--transport", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--engines", default="hf,vllm", help="hand-off cases of these engines (comma-separated)")
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    folder = os.path.join(tempfile.gettempdir(), "lightning_rlhf_bench_models")
    if args.worker:
        sync_worker(args.worker, args.engine, args.tp, args.transfer, args.transport, args.out)
        return
    if args.rollout_size:
        bench_rollout(folder, args.rollout_size)
        return
    if args.part in ("all", "rollout"):
        print("rollout: 64 prompts x 4 samples x 32 new tokens, one process")
        for size in ("0.3M", "9.5M"):
            proc = subprocess.run([sys.executable, __file__, "--rollout-size", size], capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"rollout benchmark failed ({size}):\n{proc.stderr[-3000:]}")
            print("".join(line + "\n" for line in proc.stdout.splitlines() if line.startswith("rollout")), end="")
    if args.part in ("all", "sync"):
        bench_sync(folder, tuple(args.engines.split(",")))


if __name__ == "__main__":
    main()
