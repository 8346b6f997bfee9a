"""One TRL 1.16 ``GRPOTrainer`` run of the workload (``workload.py``); run by ``bench.py`` with ``.venv-trl``'s python.

    .venv-trl/bin/python benchmarks/vs_trl/run_trl.py --model-dir DIR --steps 10 --out run.json [--prompts 16] \
        [--bf16] [--beta 0.04]

Mapping of "P prompts (``--prompts``, default 16) x G samples, one generation and one optimizer step per step"
onto ``GRPOConfig``: ``num_generations=G``, ``generation_batch_size=P*G``, ``per_device_train_batch_size=M``
(``workload.MICRO_BATCH``), ``gradient_accumulation_steps=P*G/M``, ``num_iterations=1``, so the update covers all
P*G sequences whatever P is; fixed-length completions through
``generation_kwargs={"min_new_tokens": 64}``. Timing: a ``TrainerCallback`` from ``on_step_begin`` to
``on_step_end`` (the step), the trainer's ``_generate`` wrapped (generate: tokenize, sample, decode; it also
counts prompt and completion tokens) and ``_generate_and_score_completions`` wrapped (the rollout phase: generate,
reward, reference log-probs, advantages); the actor update is the step minus the rollout phase. The run fails if
TRL does not generate exactly once per optimizer step. Writes one JSON object with a record per step.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workload as W  # the workload file sits next to this script


def main() -> None:
    """Run TRL's GRPO on the workload and write the per-step records. Runs on: the TRL venv's process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=W.PROMPTS_PER_STEP, help="prompts per step (P)")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    p.add_argument("--beta", type=float, default=0.0, help="k3 KL coefficient to the frozen reference (0: none)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--attn", default=None, help="transformers attn_implementation (None: the model's default)")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args()
    prompts = W.check_prompts(args.prompts)
    samples = prompts * W.SAMPLES_PER_PROMPT
    if samples % W.MICRO_BATCH:
        raise ValueError(
            f"--prompts {prompts}: workload.MICRO_BATCH={W.MICRO_BATCH} must divide the {samples} samples per step. "
            "HINT: use a multiple of 8 prompts."
        )
    W.set_threads(args.threads)

    import datasets
    import torch
    import trl
    from transformers import TrainerCallback

    torch.manual_seed(W.SEED)
    rows = W.prompt_rows(args.steps, prompts)
    config = trl.GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_out"),
        num_generations=W.SAMPLES_PER_PROMPT,
        generation_batch_size=samples,
        per_device_train_batch_size=W.MICRO_BATCH,
        gradient_accumulation_steps=samples // W.MICRO_BATCH,
        num_iterations=1,
        max_steps=args.steps,
        max_completion_length=W.NEW_TOKENS,
        generation_kwargs={"min_new_tokens": W.NEW_TOKENS},
        temperature=W.TEMPERATURE,
        top_p=1.0,
        top_k=0,
        learning_rate=W.LR,
        lr_scheduler_type="linear",
        warmup_steps=0,
        max_grad_norm=W.GRAD_CLIP,
        epsilon=W.CLIP,
        beta=args.beta,
        loss_type="dapo",  # token-mean over the step's batch
        scale_rewards="group",
        use_cpu=args.accelerator == "cpu",
        bf16=args.bf16,
        seed=W.SEED,
        **W.TRL_PLAIN_RUN,
        model_init_kwargs={"attn_implementation": args.attn} if args.attn else None,
    )
    trainer = trl.GRPOTrainer(
        model=args.model_dir,
        reward_funcs=W.reward,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
    )

    records: list[dict[str, Any]] = []
    current: dict[str, Any] = {}

    def timed(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            current[name] = current.get(name, 0.0) + time.perf_counter() - t0
            current[f"{name}_calls"] = current.get(f"{name}_calls", 0) + 1
            if name == "gen":  # (prompt_ids, completion_ids, ...): count tokens, padding excluded
                current["prompt_tokens"] = current.get("prompt_tokens", 0) + sum(len(x) for x in out[0])
                current["completion_tokens"] = current.get("completion_tokens", 0) + sum(len(x) for x in out[1])
            return out

        return wrapper

    trainer._generate = timed("gen", trainer._generate)  # type: ignore[method-assign]
    trainer._generate_and_score_completions = timed(  # type: ignore[method-assign]
        "rollout", trainer._generate_and_score_completions
    )

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        """Times each optimizer step (on_step_begin -> on_step_end); Runs on: the TRL process."""

        last_end: float | None = None

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            current.clear()
            current["t0"] = time.perf_counter()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            now = time.perf_counter()
            if current.get("gen_calls") != 1:
                raise RuntimeError(
                    f"TRL generated {current.get('gen_calls', 0)} times in optimizer step {len(records)}; the mapping "
                    "must give exactly one generation per optimizer step. HINT: check generation_batch_size and "
                    "gradient_accumulation_steps against workload.MICRO_BATCH."
                )
            rec = {
                "step": now - current["t0"],
                "gen": current["gen"],
                "update": now - current["t0"] - current["rollout"],
                "prompt_tokens": current["prompt_tokens"],
                "completion_tokens": current["completion_tokens"],
                "wall": None if self.last_end is None else now - self.last_end,
            }
            self.last_end = now
            records.append(rec)

    trainer.add_callback(StepTimer())
    trainer.train()
    if len(records) != args.steps:
        raise RuntimeError(f"TRL ran {len(records)} optimizer steps, expected {args.steps}")
    with open(args.out, "w") as f:
        json.dump(
            {
                "side": "trl",
                "prompts": prompts,
                "versions": {"trl": trl.__version__, "torch": torch.__version__},
                "threads": torch.get_num_threads(),
                "steps": records,
            },
            f,
        )


if __name__ == "__main__":
    main()
