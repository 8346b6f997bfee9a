"""Step time of the demo workload: lightning_rlhf (1 and 2 CPU processes) vs a plain transformers loop.

    python benchmarks/bench_step.py [--steps 40]

Same model (the demo's warm-started tiny Qwen2), same batch (32 prompts x 8 samples, up to 6 new tokens),
same math (GRPO, one update per step). The plain loop is the floor: one process, no sharding, no controller.
Prints one table; the figures go into docs/performance.md.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from lightning_rlhf.algorithms import (
    AdvantageInputs,
    grpo_advantages,
    logprobs_from_logits,
    policy_loss_clipped,
    scores_to_token_rewards,
)
from lightning_rlhf.demo import addition_dataset, addition_reward, prepare_demo_model


def plain_loop(model_path: str, steps: int, prompts_per_step: int = 32, n: int = 8) -> dict[str, float]:
    """GRPO with transformers + torch only, one process: generate, score, one on-policy AdamW step."""
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = addition_dataset()
    gen_cfg = GenerationConfig(
        do_sample=True,
        top_k=0,
        max_new_tokens=6,
        num_return_sequences=n,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    times, gen_times = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        rows = [data[(step * prompts_per_step + i) % len(data)] for i in range(prompts_per_step)]
        enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, generation_config=gen_cfg)
        t_gen = time.perf_counter() - t0
        prompt_len = enc["input_ids"].shape[1]
        responses = out[:, prompt_len:]
        is_eos = (responses == tok.eos_token_id).int()
        after = (is_eos.cumsum(-1) - is_eos) > 0
        mask = (~after).long()
        texts = tok.batch_decode(responses * mask, skip_special_tokens=True)
        scores = torch.tensor(addition_reward([], texts, [r["answer"] for r in rows for _ in range(n)]))
        attn = torch.cat([enc["attention_mask"].repeat_interleave(n, 0), mask], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        group_ids = torch.arange(prompts_per_step).repeat_interleave(n)
        adv, _ = grpo_advantages(AdvantageInputs(scores_to_token_rewards(scores, mask), mask, group_ids=group_ids))
        lp = logprobs_from_logits(
            model(out, attention_mask=attn, position_ids=pos).logits[:, prompt_len - 1 : -1], responses
        )
        loss, _ = policy_loss_clipped(lp, lp.detach(), adv, mask)  # on-policy, as GRPOModule
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        gen_times.append(t_gen)
    warm = max(1, steps // 5)
    return {"step": statistics.mean(times[warm:]), "gen": statistics.mean(gen_times[warm:])}


def framework(devices: int, steps: int) -> dict[str, float]:
    """The demo job through Lightning + RLHFStrategy; means of its logged timings (first 20% skipped)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "lightning_rlhf.demo",
            "--devices",
            str(devices),
            "--steps",
            str(steps),
            "--out",
            out,
        ]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        (path,) = [os.path.join(r, f) for r, _, fs in os.walk(out) for f in fs if f == "metrics.csv"]
        with open(path) as f:
            rows = list(csv.DictReader(f))
    warm = max(1, steps // 5)
    keys = {
        "step": "timing_s/step",
        "gen": "timing_s/gen",
        "old_log_prob": "timing_s/old_log_prob",
        "update": "timing_s/update_actor",
        "sync": "timing_s/update_weights",
        "tok/s/dev": "perf/throughput",
    }
    return {k: statistics.mean(float(r.get(v) or 0.0) for r in rows[warm:]) for k, v in keys.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    model = prepare_demo_model(os.path.join(os.path.expanduser("~"), ".cache", "lightning_rlhf"))
    torch.set_num_threads(os.cpu_count() or 1)
    plain = plain_loop(model, args.steps)
    one, two = framework(1, args.steps), framework(2, args.steps)
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; {args.steps} steps, first 20% skipped")
    print(f"{'path':<34}{'step s':>8}{'gen s':>8}{'logp s':>8}{'upd s':>8}{'sync s':>8}{'steps/s':>9}")
    print(
        f"{'plain transformers, 1 process':<34}{plain['step']:>8.3f}{plain['gen']:>8.3f}"
        f"{'':>24}{1 / plain['step']:>9.2f}"
    )
    for name, r in (("lightning_rlhf, 1 process", one), ("lightning_rlhf, 2 processes (gloo)", two)):
        print(
            f"{name:<34}{r['step']:>8.3f}{r['gen']:>8.3f}{r['old_log_prob']:>8.3f}{r['update']:>8.3f}"
            f"{r['sync']:>8.3f}{1 / r['step']:>9.2f}"
        )


if __name__ == "__main__":
    main()
