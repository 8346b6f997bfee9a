"""What a scoring call costs on the control plane: the whole rollout batch out and back, against only the columns
the method reads out and the one it writes back (``@role_method(..., reads=..., writes=...)``).

    python benchmarks/bench_control_plane.py                  # 16 and 256 prompts x 8 samples x 64 tokens
    python benchmarks/bench_control_plane.py --prompts 16,64  # other sizes

Two processes (spawned, gloo on this host), as the strategy runs them: rank 0 scatters each rank's part of a
``reference.log_prob``-shaped call with ``scatter_object_list`` and gathers the results with ``gather_object``,
exactly the controller's exchange; the payloads are built by the controller's own functions (``split_args``,
``only_written``, ``with_written``, ``merge_results``). The batch has the columns of a GRPO rollout of the vs-TRL
workload at the time ``reference.log_prob`` runs: token ids and masks of 13 prompt and 64 response tokens, rollout
log-probs, scores, advantages, uid, and the prompt text, answer and completion text. No model runs: the figures
are the exchange alone (median of ``--repeats`` after 3 warm-ups), in milliseconds, with the pickled bytes.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_rlhf.batch import Batch
from lightning_rlhf.controller.dispatch import Dispatch, merge_results, only_written, split_args, with_written
from lightning_rlhf.engines.train import RESPONSE_INPUTS

SAMPLES, PROMPT, RESPONSE = 8, 13, 64


def rollout(prompts: int) -> Batch:
    """A GRPO rollout batch of ``prompts`` x 8 samples at the time the reference scores it. Runs on: rank 0."""
    rows = prompts * SAMPLES
    g = torch.Generator().manual_seed(0)
    return Batch(
        {
            "prompts": torch.randint(0, 4096, (rows, PROMPT), generator=g),
            "prompt_mask": torch.ones(rows, PROMPT, dtype=torch.long),
            "responses": torch.randint(0, 4096, (rows, RESPONSE), generator=g),
            "response_mask": torch.ones(rows, RESPONSE, dtype=torch.long),
            "response_truncated": torch.ones(rows, dtype=torch.bool),
            "rollout_logprobs": torch.randn(rows, RESPONSE, generator=g),
            "scores": torch.rand(rows, generator=g),
            "advantages": torch.randn(rows, RESPONSE, generator=g),
            "uid": torch.arange(prompts).repeat_interleave(SAMPLES),
        },
        {
            "prompt": [f"Add {i % 100} and {(7 * i) % 100}. Answer:" for i in range(rows)],
            "answer": [str(i % 100 + (7 * i) % 100) for i in range(rows)],
            "completion": ["x" * 180 for _ in range(rows)],  # byte-level BPE: ~64 tokens of text
        },
        {"step": 0, "group_size": SAMPLES},
    )


def exchange(parts: list[object], world: int) -> list[object]:
    """The controller's exchange: scatter the parts, gather the replies (each rank replies what ``reply`` makes).
    Runs on: every rank."""
    out: list[object] = [None]
    dist.scatter_object_list(out, parts if dist.get_rank() == 0 else None, src=0)
    got = out[0]
    assert isinstance(got, tuple)
    part, writes = got
    reply = part
    if isinstance(part, Batch):
        inputs = {**part.tensors, **part.columns}
        part["ref_logprobs"] = torch.randn(len(part), RESPONSE)
        reply = only_written("reference.log_prob", inputs, part, writes) if writes else part
    gathered: list[object] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(reply, gathered, dst=0)
    return gathered or []


def worker(rank: int, world: int, sizes: list[int], repeats: int, port: int) -> None:
    """One rank of the measurement. Runs on: a spawned process."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for prompts in sizes:
        batch = rollout(prompts)
        for mode, reads, writes in (("whole batch", None, None), ("declared", RESPONSE_INPUTS, ("ref_logprobs",))):
            times, sent, back = [], 0, 0
            for i in range(3 + repeats):
                dist.barrier()
                t0 = time.perf_counter()
                parts = None
                if rank == 0:
                    per_rank = split_args(Dispatch.DP_SPLIT, (batch,), {}, world, where="x", reads=reads)
                    parts = [(p[0][0], writes) for p in per_rank if p is not None]
                replies = exchange(parts or [], world)
                if rank == 0:
                    merged = merge_results(Dispatch.DP_SPLIT, replies)
                    result = with_written(batch, merged, writes) if writes else merged
                    assert len(result) == len(batch) and "ref_logprobs" in result and "completion" in result
                    if i >= 3:
                        times.append(time.perf_counter() - t0)
                    sent = sum(len(pickle.dumps(p)) for p in parts or [])
                    back = sum(len(pickle.dumps(r)) for r in replies)
            if rank == 0:
                print(
                    f"{prompts:>4} prompts x {SAMPLES} | {mode:<11} | out {sent / 1e6:7.2f} MB | back "
                    f"{back / 1e6:7.2f} MB | {statistics.median(times) * 1e3:7.1f} ms "
                    f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})",
                    flush=True,
                )
    dist.destroy_process_group()


def main() -> None:
    """Spawn the two ranks. Runs on: the launching process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="16,256", help="comma-separated prompts per step")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    sizes = [int(x) for x in args.prompts.split(",")]
    port = 29500 + os.getpid() % 1000
    mp.spawn(worker, args=(2, sizes, args.repeats, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
