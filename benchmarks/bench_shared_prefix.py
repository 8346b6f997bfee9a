"""The update's forward and backward with each group's prompt computed once (a shared prefix) against one row at a
time, on one process, alternating, median of the runs after the first.

GRPO's n samples of a prompt repeat the same prompt tokens (the vs-TRL workload's 11 prompt tokens are 15% of an
update's decoder tokens). ``forward_response(group_size=n)`` packs a micro-batch's groups into one sequence and runs
each prompt once (``lightning_rlhf/engines/train/prefix.py``). The script first checks that both give the same
log-probs and gradients, then times them.

    python benchmarks/bench_shared_prefix.py --model /tmp/lightning_rlhf_bench_models/small --attn eager
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf.batch import Batch
from lightning_rlhf.engines.train.forward import forward_response


def make_batch(vocab: int, groups: int, n: int, lp: int, lr: int, seed: int = 0) -> Batch:
    """``groups`` left-padded prompts of ragged length, ``n`` right-padded ragged responses each."""
    g = torch.Generator().manual_seed(seed)
    pm = (torch.arange(lp)[None] >= (torch.arange(groups) % 3)[:, None]).long()
    prompts = torch.randint(5, vocab, (groups, lp), generator=g) * pm
    rm = (torch.arange(lr)[None] < (lr - torch.arange(groups * n) % 5)[:, None]).long()
    responses = torch.randint(5, vocab, (groups * n, lr), generator=g) * rm
    return Batch(
        {
            "prompts": prompts.repeat_interleave(n, 0),
            "prompt_mask": pm.repeat_interleave(n, 0),
            "responses": responses,
            "response_mask": rm,
        }
    )


def main() -> None:
    """Check, then time. Runs on: the caller."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--groups", type=int, default=4, help="prompts per micro-batch")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=11)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--attn", default="eager", help="the model's attention for the per-row forward: eager or sdpa")
    p.add_argument("--dtype", default="float32", help="the model's dtype: float32 or bfloat16")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, attn_implementation=args.attn, dtype=getattr(torch, args.dtype)
    )
    batch = make_batch(model.config.vocab_size, args.groups, args.n, args.prompt_len, args.response_len)
    mask = batch["response_mask"].bool()

    def step(group_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        out = forward_response(model, batch, output="logprobs", with_entropy=True, group_size=group_size)
        out["logprobs"][mask].sum().backward()
        return out["logprobs"].detach(), [q.grad.clone() for q in model.parameters() if q.grad is not None]

    (a, ga), (b, gb) = step(1), step(args.n)
    diff = (a - b).abs()[mask].max().item()
    grads = max((x - y).abs().max().item() / max(y.abs().max().item(), 1e-12) for x, y in zip(gb, ga, strict=True))
    print(f"max |log-prob difference| {diff:.2e}, max relative gradient difference {grads:.2e}")
    times: dict[int, list[float]] = {1: [], args.n: []}
    for _ in range(args.runs):
        for group_size in times:
            t0 = time.perf_counter()
            step(group_size)
            times[group_size].append(time.perf_counter() - t0)
    per_row, shared = (statistics.median(times[k][1:]) for k in (1, args.n))
    print(
        f"fwd + bwd, {len(batch)} sequences of {args.prompt_len} + {args.response_len} tokens, {args.threads} "
        f"thread(s): per row {per_row * 1e3:.1f} ms, shared prefix {shared * 1e3:.1f} ms "
        f"({(shared / per_row - 1) * 100:+.1f}%)"
    )


if __name__ == "__main__":
    main()
