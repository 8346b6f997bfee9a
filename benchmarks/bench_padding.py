"""One actor update on a batch of ragged lengths: padded fixed micro-batches against token-budget micro-batches.

    python benchmarks/bench_padding.py                      # tiny model, 64 samples, median of 5
    python benchmarks/bench_padding.py --model small --rows 128 --repeats 7

Workload (issue 11, "no padding in training forwards"): ``--rows`` samples in groups of 8 (GRPO: a prompt's 8
samples share its prompt), prompt lengths uniform in 5..40 tokens per prompt and response lengths uniform in 1..128
per sample (seed 0), left-padded prompts and right-padded responses as rollouts come; group-normalised advantages
from random scores; on-policy GRPO update (:meth:`ActorRole.update`: clipped loss, token-mean, entropy reported),
AdamW lr 1e-6, grad clip 1, float32, one process. Configurations, each its own actor from the same weights:

- ``padded``: ``micro_batch_tokens=None``, ``micro_batch_size=8``: micro-batches of 8 consecutive samples, each
  as wide as the whole batch (today's default);
- ``packed-8``: ``micro_batch_tokens`` = what one padded micro-batch holds (8 x the batch's width), still at most
  8 samples: samples sorted by length, padding trimmed;
- ``packed``: the same token budget, no row cap (``micro_batch_size`` = the batch): as many samples per forward as
  fit in the padded configuration's memory.

Times: the configurations alternate update by update (a busy moment of a shared machine hits them alike), one
untimed warm-up each, then the median (and the minimum, the steadier figure on a shared machine) of ``--repeats``.
"tokens" are the padded tokens the forwards process per update (rows x width, summed over micro-batches); "real"
the prompt + response tokens. The first update's ``actor/grad_norm`` of every configuration is printed too: the
same gradient, so it agrees to float rounding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig
from lightning_rlhf.roles import ActorRole

GROUP = 8


def build_model(root: str, name: str) -> str:
    """A randomly initialised Qwen2 causal LM and the tiny tokenizer, saved under ``root``. Runs on: this process.

    ``tiny``: hidden 128, 2 layers, 4/2 heads, MLP 256 (the demo's shape); ``small``: hidden 256, 4 layers, 4/2 heads,
    head_dim 64, MLP 704. Vocabulary 512, room for 256 positions.
    """
    from bench_models import save_qwen2  # benchmarks/bench_models.py

    shapes: dict[str, dict[str, Any]] = {
        "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "head_dim": 32},
        "small": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "head_dim": 64},
    }
    if name not in shapes:
        raise SystemExit(f"--model={name!r} is unknown. HINT: choose tiny or small.")
    return save_qwen2(os.path.join(root, name), vocab_size=512, max_positions=256, **shapes[name])


def ragged_rollout(rows: int, *, seed: int = 0) -> Batch:
    """``rows`` samples, ``rows / 8`` prompts of 5..40 tokens, responses of 1..128 tokens, padded as rollouts are."""
    g = torch.Generator().manual_seed(seed)
    prompts = rows // GROUP
    prompt_lens = torch.randint(5, 41, (prompts,), generator=g).repeat_interleave(GROUP)
    response_lens = torch.randint(1, 129, (rows,), generator=g)
    width_p, width_r = int(prompt_lens.max()), int(response_lens.max())
    prompt_mask = (torch.arange(width_p) >= width_p - prompt_lens[:, None]).long()
    response_mask = (torch.arange(width_r) < response_lens[:, None]).long()
    scores = torch.rand(rows, generator=g).view(prompts, GROUP)
    advantages = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).reshape(rows)
    return Batch(
        {
            "prompts": torch.randint(4, 512, (rows, width_p), generator=g) * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": torch.randint(4, 512, (rows, width_r), generator=g) * response_mask,
            "response_mask": response_mask,
            "advantages": advantages[:, None] * response_mask,
            "uid": torch.arange(prompts).repeat_interleave(GROUP),
        }
    )


def make_actor(path: str, *, micro_batch_size: int, micro_batch_tokens: int | None) -> ActorRole:
    """An actor as ``GRPOModule`` builds it (the module's ``setup`` hands the engine the token budget)."""
    from transformers import AutoTokenizer

    algorithm = AlgorithmConfig(micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens)
    actor = ActorRole(
        path,
        tokenizer=AutoTokenizer.from_pretrained(path),
        rollout=RolloutConfig(n=GROUP, max_new_tokens=128),
        algorithm=algorithm,
        optim=OptimConfig(lr=1e-6, grad_clip=1.0),
    )
    actor.train_engine.micro_batch_tokens = algorithm.micro_batch_tokens
    actor.load()
    actor.configure_optimizer(total_steps=100)
    return actor


def padded_tokens(actor: ActorRole, batch: Batch) -> tuple[int, int]:
    """``(padded tokens, micro-batches)`` of one pass of ``actor``'s forwards over ``batch``."""
    micros = actor.train_engine.micro_batches(batch)
    return sum(len(m) * (m["prompts"].shape[1] + m["responses"].shape[1]) for _, m in micros), len(micros)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--rows", type=int, default=64, help="samples per update (a multiple of 8)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.rows < GROUP or args.rows % GROUP:
        raise SystemExit(f"--rows={args.rows} is invalid. HINT: a multiple of {GROUP}.")
    if args.threads:
        torch.set_num_threads(args.threads)

    batch = ragged_rollout(args.rows)
    width = batch["prompts"].shape[1] + batch["responses"].shape[1]
    budget = 8 * width
    real = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    with tempfile.TemporaryDirectory(prefix="bench_padding_") as root:
        path = build_model(root, args.model)
        actors = {
            "padded": make_actor(path, micro_batch_size=8, micro_batch_tokens=None),
            "packed-8": make_actor(path, micro_batch_size=8, micro_batch_tokens=budget),
            "packed": make_actor(path, micro_batch_size=args.rows, micro_batch_tokens=budget),
        }
        times: dict[str, list[float]] = {name: [] for name in actors}
        first_norm: dict[str, float] = {}
        for round_ in range(args.repeats + 1):
            for name, actor in actors.items():
                t0 = time.perf_counter()
                metrics = actor.update(batch)
                elapsed = time.perf_counter() - t0
                first_norm.setdefault(name, metrics["actor/grad_norm"])
                if round_:
                    times[name].append(elapsed)

    print(
        f"\nmodel {args.model}, {args.rows} samples, prompts 5..40 and responses 1..128 tokens (seed 0): batch width "
        f"{width}, {real} real tokens; token budget {budget}; torch threads {torch.get_num_threads()}; median of "
        f"{args.repeats}\n"
    )
    base = statistics.median(times["padded"])
    base_min = min(times["padded"])
    print(
        "| configuration | micro-batches | tokens / update | real / tokens | update s (median) | speed-up | "
        "update s (min) | speed-up (min) | grad_norm |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, actor in actors.items():
        tokens, micros = padded_tokens(actor, batch)
        median, fastest = statistics.median(times[name]), min(times[name])
        print(
            f"| {name} | {micros} | {tokens} | {real / tokens:.2f} | {median:.3f} | {base / median:.2f}x | "
            f"{fastest:.3f} | {base_min / fastest:.2f}x | {first_norm[name]:.6f} |"
        )
    print("\nall times (s): " + "; ".join(f"{n} " + " ".join(f"{t:.2f}" for t in ts) for n, ts in times.items()))


if __name__ == "__main__":
    main()
