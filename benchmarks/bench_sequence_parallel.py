"""Memory per rank of one actor update on long sequences, with and without sequence parallelism (2 ranks, gloo).

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 2 benchmarks/bench_sequence_parallel.py \
        --sp 2 --tokens 8192 [--checkpointing] [--rows-per-micro 2 --left-pad 8]

(the fixed mmap threshold makes glibc return each freed block of the forward and backward to the system, so the
resident high-water mark measures live memory, not the allocator's fragmentation: without it the same runs read
1.18 against 0.99 GiB).

The vs-TRL ``small`` model (Qwen2-shaped, 4.0M parameters, 4 query / 2 key-value heads, float32, built locally)
is sharded with FSDP2 over both ranks by the training engine. The global batch is ``2 * --rows-per-micro`` rows of
``--tokens`` tokens (16 prompt columns, the rest response), ``--rows-per-micro`` rows per micro-batch: with ``--sp 1``
each rank trains its half of the rows; with ``--sp 2`` both ranks train all rows, each half of every sequence. With
``--left-pad K`` every other row's prompt is ``K`` tokens shorter (left padding in the micro-batch: what a rollout
batch holds; a micro-batch of one row has its padding columns cut before the forward). ``--updates`` (2) updates
(forward, backward, AdamW step); each rank prints its peak resident memory over them (``VmHWM`` after them minus
``VmRSS`` before: the process's high-water mark, so each configuration runs in a fresh launch) and the last
update's seconds, as one JSON line per rank.

On two GPUs (``gpu_check.sh``'s ``size`` part, issue 45)::

    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_sequence_parallel.py --device cuda --bf16 \
        --family qwen2.5-0.5b --layers 24 --sp 2 --tokens 8192 --checkpointing

``--device cuda``: NCCL, one GPU per rank; the peak is ``torch.cuda.max_memory_allocated`` over the updates less the
memory allocated before them (the sharded weights and, after the first update, nothing else: AdamW's state is created
in the first update, so it counts). ``--family NAME --layers N``: that family's model
(``lightning_rlhf/demo/families.py``, random weights, built in memory on every rank) instead of the small one;
``--bf16``: computed in bfloat16 (FSDP2's ``param_dtype``; float32 weights and gradient reduction).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen2Config

from lightning_rlhf.algorithms import MicroBatchAggregation
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import OptimConfig
from lightning_rlhf.controller.dispatch import data_parallel_group
from lightning_rlhf.demo.families import family_config
from lightning_rlhf.engines.train import TrainEngine, forward_response


def _status(field: str) -> float:
    """``field`` of /proc/self/status in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def _config(args: argparse.Namespace) -> PretrainedConfig:
    """The model's configuration: ``--family`` at ``--layers``, or the vs-TRL small model."""
    if args.family:
        config = family_config(args.family, layers=args.layers)
        config.max_position_embeddings = max(config.max_position_embeddings, args.tokens)
        return config
    return Qwen2Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=args.tokens,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--rows-per-micro", type=int, default=1)
    p.add_argument("--left-pad", type=int, default=0)
    p.add_argument("--updates", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--family", default="", help="a family of lightning_rlhf/demo/families.py, e.g. qwen2.5-0.5b")
    p.add_argument("--layers", type=int, default=None, help="the family's depth (default: its test cut)")
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16 (FSDP2's param_dtype)")
    args = p.parse_args()
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    engine = TrainEngine(micro_batch_size=args.rows_per_micro, optim=OptimConfig(lr=1e-6))
    engine.bind(AutoModelForCausalLM.from_config(_config(args), dtype=torch.float32, attn_implementation="sdpa"))
    engine.activation_checkpointing = args.checkpointing
    engine.sequence_parallel = args.sp
    engine.shard(init_device_mesh(args.device, (2,)), param_dtype=torch.bfloat16 if args.bf16 else None)
    engine.materialize(device)
    engine.configure_optimizer(10)
    g = torch.Generator().manual_seed(0)
    n_rows, prompt, response = 2 * args.rows_per_micro, 16, args.tokens - 16
    prompt_mask = torch.ones(n_rows, prompt, dtype=torch.long)
    prompt_mask[1::2, : args.left_pad] = 0
    batch = Batch(
        {
            "prompts": torch.randint(1, 4096, (n_rows, prompt), generator=g) * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": torch.randint(1, 4096, (n_rows, response), generator=g),
            "response_mask": torch.ones(n_rows, response, dtype=torch.long),
            "advantages": torch.randn(n_rows, response, generator=g),
        }
    )
    rows = batch if args.sp == 2 else batch.chunk(2)[rank]

    def loss_fn(micro: Batch, agg: MicroBatchAggregation) -> tuple[Tensor, dict[str, Tensor]]:
        assert engine.model is not None
        out = forward_response(engine.model, micro, output="logprobs")
        logp = out["logprobs"]
        advantages, mask = micro["advantages"].to(logp.device), micro["response_mask"].to(logp.device)
        value = agg.aggregate(-logp * advantages, mask.float())
        return value, {}

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    resting = torch.cuda.memory_allocated() / 2**20 if cuda else _status("VmRSS")
    seconds = []
    for _ in range(args.updates):
        started = time.perf_counter()
        with data_parallel_group(None, group if args.sp == 2 else None):
            engine.train(rows, loss_fn, aggregation="token-mean", count_mask=lambda b: b["response_mask"])
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _status("VmHWM")
    row = {"rank": rank, "sp": args.sp, "tokens": args.tokens, "checkpointing": args.checkpointing}
    row |= {"device": args.device, "family": args.family or "small", "bf16": args.bf16}
    row |= {"rows_per_micro": args.rows_per_micro, "left_pad": args.left_pad}
    print(json.dumps(row | {"peak_over_resting_mib": round(peak - resting), "update_s": round(seconds[-1], 2)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
