"""The colocated vLLM hand-off alone, at a real family's width: seconds, MB/s, and the machine's memcpy beside them.

    python benchmarks/bench_handoff.py                   # Qwen3-0.6B's width, 2 layers (187M parameters), TP 2
    python benchmarks/bench_handoff.py --size demo       # the demo-size model (hidden 1024, 8 layers, 95M)
    python benchmarks/bench_handoff.py --profile         # and a cProfile of one hand-off on rank 0, by stage

Two processes (torchrun, gloo), the actor sharded with FSDP2 over both, one vLLM engine with TP 2 colocated over
both ranks (dummy weights, float32 as on CPU); each hand-off is what ``HybridEngine.sync`` does for it: the weights
streamed out of the shards into the engine (``weights_for`` -> ``load_weights``: vLLM's layerwise reload, the tied
head's re-pack), then the check (fingerprints of both sides). Median of ``--repeats`` after one warm-up, the check
timed apart. The scale in the same run: a torch copy of a tensor as large as what each rank's engine takes, on both
ranks at once, and the same bytes written into the host's shared memory (``/dev/shm``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import mmap
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

QWEN3 = {  # Qwen3-0.6B's published configuration, depth cut to 2 layers
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 512,
    "num_hidden_layers": 2,
}


def build(folder: str, size: str) -> str:
    """The model's folder (config, random weights, the tiny tokenizer), made once. Runs on: the launcher."""
    path = os.path.join(folder, f"handoff-{size}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if size == "demo":
        from lightning_rlhf.demo import save_tiny

        return save_tiny(path, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=2816)
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_rlhf.demo import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(path)
    fields = {k: v for k, v in QWEN3.items() if k != "model_type"}
    config = AutoConfig.for_model("qwen3", **fields, pad_token_id=tokenizer.pad_token_id)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def copy_seconds(nbytes: int, repeats: int, *, shared: bool) -> float:
    """Median seconds of one flat copy of ``nbytes`` (into a fresh ``/dev/shm`` mapping with ``shared``), every rank
    at once. Runs on: every rank."""
    import torch.distributed as dist

    src = torch.ones(nbytes // 4)
    if shared:
        with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
            os.posix_fallocate(f.fileno(), 0, nbytes)
            region = mmap.mmap(f.fileno(), nbytes)
        dst = torch.frombuffer(region, dtype=torch.float32)
    else:
        dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(path: str, repeats: int, profile: bool, out: str) -> None:
    """One rank: shard, build the engine, time hand-offs. Runs on: each torchrun process."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from lightning_rlhf.config import RolloutConfig, VLLMConfig
    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.engines.hybrid import HybridEngine
    from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine
    from lightning_rlhf.engines.train import shard_model

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    layer = CPULayer()
    engine = VLLMRolloutEngine(
        path,
        param_names=[n for n, _ in model.named_parameters()],
        config=VLLMConfig(tensor_parallel_size=2, kv_cache_memory_bytes=64 << 20),
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=128,
        tie_word_embeddings=bool(model.config.tie_word_embeddings),
        hf_config=model.config,
        layer=layer,
    )
    shard_model(model, dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),)), layer=layer)
    trainer = SimpleNamespace(model=model, train_engine=SimpleNamespace(layer=layer), lora=None)
    hybrid = HybridEngine(rollout=RolloutConfig(verify_every=1), tokenizer=None, model_path=path, trainer=trainer)
    hybrid.engine = engine
    sync_s, verify_s = [], []
    for i in range(repeats + 1):
        hybrid.mark_changed()
        dist.barrier()
        prof = cProfile.Profile() if profile and rank == 0 and i == repeats else None
        if prof is not None:
            prof.enable()
        seconds, _ = hybrid.sync()
        if prof is not None:
            prof.disable()
            prof.dump_stats(out + ".prof")
        if i:
            sync_s.append(seconds)
            verify_s.append(hybrid.verify_s)
    taken = hybrid.engine_bytes
    memcpy = copy_seconds(taken, repeats, shared=False)
    shm = copy_seconds(taken, repeats, shared=True)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        with open(out, "w") as f:
            json.dump(
                {
                    "params": params,
                    "bytes": taken,
                    "sync_s": statistics.median(sync_s),
                    "verify_s": statistics.median(verify_s),
                    "all_sync_s": sync_s,
                    "memcpy_s": memcpy,
                    "shm_s": shm,
                },
                f,
            )
    dist.barrier()


def report(r: dict, size: str) -> None:
    """Print one run's figures. Runs on: the launcher."""
    mb = r["bytes"] / 1e6
    print(f"{size}: {r['params'] / 1e6:.1f}M parameters, {mb:.0f} MB into each rank's engine (TP 2, float32)")
    for what, key in (("hand-off", "sync_s"), ("check", "verify_s"), ("memcpy", "memcpy_s"), ("shm write", "shm_s")):
        print(f"  {what:<10} {r[key] * 1e3:9.1f} ms  {mb / max(r[key], 1e-9):9.0f} MB/s")
    print(
        f"  hand-off = {r['sync_s'] / r['memcpy_s']:.1f}x memcpy; repeats (s): {[round(s, 3) for s in r['all_sync_s']]}"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=["qwen3", "demo"], default="qwen3")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.worker:
        torch.set_num_threads(1)
        worker(args.worker, args.repeats, args.profile, args.out)
        return
    folder = os.path.join(tempfile.gettempdir(), "lightning_rlhf_bench_models")
    path = build(folder, args.size)
    out = os.path.join(folder, f"handoff-{args.size}-{os.getpid()}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    cmd += ["--worker", path, "--repeats", str(args.repeats), "--out", out] + (["--profile"] if args.profile else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"hand-off worker failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        report(json.load(f), args.size)
    if args.profile:
        stages(pstats.Stats(out + ".prof"))


STAGES = (  # (stage, file suffix, function): cumulative seconds in one hand-off and its check, rank 0
    ("hand-off (sync, check included)", "engines/hybrid.py", "sync"),
    ("  stream out of the shards (exchange)", "rollout/reshard.py", "exchange"),
    ("    of which gloo all_to_all", "distributed_c10d.py", "all_to_all_single"),
    ("  vLLM load_weights (buckets)", "rollout/transfer.py", "update_weights"),
    ("    layers materialized", "reload/meta.py", "materialize_layer"),
    ("    loaders' copies", "models/utils.py", "_load_param"),
    ("    repacked for oneDNN", "layers/utils.py", "dispatch_cpu_unquantized_gemm"),
    ("    copied back into vLLM's tensors", "reload/layerwise.py", "_copy_and_restore_kernel_tensors"),
    ("  finish the reload", "rollout/transfer.py", "finish_weight_update"),
    ("  tied head refreshed", "lightning_rlhf/cpu/__init__.py", "_refresh_tied_head"),
    ("  check (both sides' fingerprints)", "engines/hybrid.py", "verify"),
    ("    engine's row sums", "compat/vllm.py", "_worker_row_sums"),
    ("    trainer's fingerprints", "rollout/reshard.py", "shard_fingerprints"),
)


def stages(stats: pstats.Stats) -> None:
    """Print the profiled hand-off's seconds per stage (cumulative; nested stages indented). Runs on: the launcher."""
    table = stats.stats  # type: ignore[attr-defined]
    print("stage                                        seconds   calls")
    for label, suffix, function in STAGES:
        found = [(v[3], v[1]) for (path, _, name), v in table.items() if name == function and path.endswith(suffix)]
        seconds, calls = sum(s for s, _ in found), sum(c for _, c in found)
        print(f"{label:<44} {seconds:8.3f} {calls:7d}")


if __name__ == "__main__":
    main()
