"""Two levers of one rank's share of the vs-TRL step, each A/B in one process: the fused RMS norms of the update
(``lightning_rlhf/cpu/kernels.py``) and the decoding loop's attention over the written cache slots only
(``lightning_rlhf/cpu/decode.py``).

    python benchmarks/bench_kernels.py                         # small model, bf16 and fp32, 8 repeats each
    python benchmarks/bench_kernels.py --precisions bf16 --repeats 12 --model tiny --parts update

Workload: one rank's share of the vs-TRL step in the ``hf2`` configuration (``benchmarks/vs_trl/workload.py``'s
model, built locally): 64 sequences of 11 prompt + 64 response tokens, micro-batches of 32, token-mean loss, clip
0.2, ``entropy_coef=0``, AdamW lr 1e-6, grad clip 1, eager attention; the model FSDP2-sharded over a one-rank gloo
group as the strategy shards it (``param_dtype=bfloat16`` for bf16: float32 master weights). The update is
:meth:`ActorRole.update` itself. One process, 1 thread; the two configurations alternate update by update in the
same process (``fuse_rms_norms`` / ``unfuse_rms_norms`` on the same model) after 2 warm-ups each, so a busy moment
of a shared machine hits both alike. Also times the norm alone (forward + backward of one ``[32, 75, 256]``
activation).

Decoding: the rank's 8 prompts x 8 samples x 64 new tokens (EOS suppressed, temperature 1) through
:func:`~lightning_rlhf.cpu.decode.sample_loop` on the model loaded in the precision (eager
attention), alternating attention over the whole cache capacity (the loop before) and over the written slots only
(forced either way whatever the loop's own rule, which picks the written slots in float32 only on CPU).

Prints markdown tables and, as its last line, one JSON object.

Use the allocator settings of ``benchmarks/vs_trl/bench.py`` (``MALLOC_MMAP_THRESHOLD_=33554432
MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=1073741824``) for figures comparable with it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "vs_trl"))

import torch

CONFIGS = ("eager", "fused")
DECODE_CONFIGS = ("capacity", "written")


def build(folder: str, name: str) -> str:
    """The workload's model ``name`` and tokenizer under ``folder``. Runs on: this process."""
    import workload as W  # benchmarks/vs_trl/workload.py

    from lightning_rlhf.demo.tiny import build_tiny_tokenizer

    path = os.path.join(folder, name)
    os.makedirs(path, exist_ok=True)
    tok = build_tiny_tokenizer()
    tok.add_bos_token = False  # type: ignore[misc]  # as bench.py saves it
    tok.model_max_length = W.MAX_POSITIONS
    tok.save_pretrained(path)
    W.build_model(path, W.MODELS[name], pad_id=tok.pad_token_id, bos_id=tok.bos_token_id, eos_id=tok.eos_token_id)
    return path


def norm_alone(dtype: torch.dtype, repeats: int = 40) -> dict[str, float]:
    """Median ms of forward + backward of one norm on ``[32, 75, 256]``, module vs fused. Runs on: this process."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from lightning_rlhf.cpu.kernels import rms_norm

    norm = Qwen2RMSNorm(256).to(dtype)
    x0, grad = torch.randn(32, 75, 256, dtype=dtype), torch.randn(32, 75, 256, dtype=dtype)
    out: dict[str, float] = {}
    for config in CONFIGS:
        times = []
        for _ in range(repeats):
            x = x0.clone().requires_grad_()
            t0 = time.perf_counter()
            y = norm(x) if config == "eager" else rms_norm(x, norm.weight, norm.variance_epsilon)
            y.backward(grad)
            times.append(time.perf_counter() - t0)
        out[config] = 1e3 * statistics.median(times)
    return out


def updates(path: str, bf16: bool, repeats: int) -> dict[str, list[float]]:
    """Seconds per :meth:`ActorRole.update`, per configuration, alternating. Runs on: this process (rank 0 of 1)."""
    import torch.distributed as dist
    from bench_update import rollout_batch  # benchmarks/bench_update.py
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig
    from lightning_rlhf.cpu.kernels import fuse_rms_norms, unfuse_rms_norms
    from lightning_rlhf.roles import ActorRole

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29571")
        dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    actor = ActorRole(
        path,
        tokenizer=AutoTokenizer.from_pretrained(path),
        rollout=RolloutConfig(n=8, temperature=1.0, max_new_tokens=64),
        algorithm=AlgorithmConfig(micro_batch_size=32, entropy_coef=0.0, loss_agg="token-mean", clip_ratio_low=0.2),
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
    )
    actor.load()
    engine = actor.train_engine
    engine.attn_implementation = "eager"
    engine.shard(mesh, param_dtype=torch.bfloat16 if bf16 else None)
    engine.materialize(torch.device("cpu"))
    actor.configure_optimizer(total_steps=1000)
    assert actor.model is not None
    config: Any = actor.model.config
    batch = rollout_batch(64, 11, 64, 8, int(config.vocab_size))
    times: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for i in range(2 * (2 + repeats)):
        config = CONFIGS[i % 2]
        (fuse_rms_norms if config == "fused" else unfuse_rms_norms)(actor.model)
        t0 = time.perf_counter()
        actor.update(batch)
        if i >= 4:
            times[config].append(time.perf_counter() - t0)
    return times


def _forced(on: bool, cache: Any) -> bool:
    """Stands in for the loop's ``_written_slots_only`` rule: the same answer whatever the cache."""
    return on


def decodes(path: str, bf16: bool, repeats: int) -> dict[str, list[float]]:
    """Seconds per :func:`sample_loop` of the rank's share, per attention span, alternating. Runs on: this process."""
    import workload as W  # benchmarks/vs_trl/workload.py
    from transformers import AutoModelForCausalLM

    import lightning_rlhf.cpu.decode as decode
    from lightning_rlhf.engines.rollout import SamplingParams

    dtype = torch.bfloat16 if bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    prompts = W.prompt_ids(path, 1)[: W.PROMPTS_PER_STEP // 2]
    new = W.NEW_TOKENS
    params = SamplingParams(n=W.SAMPLES_PER_PROMPT, temperature=1.0, max_new_tokens=new, min_new_tokens=new)
    rule = decode._written_slots_only
    times: dict[str, list[float]] = {span: [] for span in DECODE_CONFIGS}
    try:
        for i in range(2 * (2 + repeats)):
            span = DECODE_CONFIGS[i % 2]
            decode._written_slots_only = functools.partial(_forced, span == "written")  # type: ignore[assignment]
            t0 = time.perf_counter()
            decode.sample_loop(model, prompts, params, stops=set(), pad_token_id=0, device=torch.device("cpu"))
            if i >= 4:
                times[span].append(time.perf_counter() - t0)
    finally:
        decode._written_slots_only = rule  # type: ignore[assignment]
    return times


def spread(times: list[float]) -> dict[str, float]:
    """Median, fastest and slowest of a configuration's runs."""
    return {"s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main() -> None:
    """Parses the arguments, runs both precisions, prints the table and the JSON line. Runs on: this process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=["tiny", "small", "m30"])
    p.add_argument("--precisions", default="bf16,fp32")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parts", default="update,decode", help="comma-separated, of: update,decode")
    args = p.parse_args()
    parts = args.parts.split(",")
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_kernels_") as folder:
        path = build(folder, args.model)
        for precision in args.precisions.split(","):
            bf16 = precision == "bf16"
            if "update" in parts:
                alone = norm_alone(torch.bfloat16 if bf16 else torch.float32)
                times = updates(path, bf16, args.repeats)
                for config in CONFIGS:
                    results[f"{args.model}_{precision}_update_{config}"] = spread(times[config]) | {
                        "norm_fwd_bwd_ms": alone[config]
                    }
            if "decode" in parts:
                times = decodes(path, bf16, args.repeats)
                for span in DECODE_CONFIGS:
                    results[f"{args.model}_{precision}_decode_{span}"] = spread(times[span])
    print(f"\none rank's share of the step, {args.threads} thread(s), median of {args.repeats} alternating runs\n")
    print("| model / precision | part | configuration | s (min-max) | one norm fwd + bwd ms |")
    print("| --- | --- | --- | ---: | ---: |")
    for key, r in results.items():
        name, precision, part, config = key.split("_")
        norm = f"{r['norm_fwd_bwd_ms']:.2f}" if "norm_fwd_bwd_ms" in r else ""
        print(f"| {name} {precision} | {part} | {config} | {r['s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) | {norm} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
