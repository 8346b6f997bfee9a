"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct (a real recipe; the CPU test swaps in a tiny model and 4 local rows).

Run on a GPU node:  python recipes/grpo_gsm8k.py --accelerator gpu --devices 8
Data: a jsonl/parquet file with the GSM8K columns ``question`` and ``answer`` (the answer ends with ``#### 42``),
e.g. exported once with ``datasets.load_dataset("openai/gsm8k", "main")["train"].to_json("gsm8k_train.jsonl")``.
"""

from __future__ import annotations

import argparse
import re

import datasets
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_rlhf import AlgorithmConfig, GRPOModule, OptimConfig, PromptDataModule, RLHFStrategy, RolloutConfig

INSTRUCTION = " Let's think step by step and output the final answer after '####'."
_NUMBER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def _final_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def gsm8k_reward(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 when the number after the last '####' equals the reference's; 0.1 for a well-formed wrong answer."""
    scores = []
    for completion, reference in zip(completions, answer, strict=True):
        got, want = _final_number(completion), _final_number(reference)
        scores.append(1.0 if got is not None and got == want else (0.1 if got is not None else 0.0))
    return scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--data", default="gsm8k_train.jsonl")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--max-prompt-length", type=int, default=512, help="longer prompts are dropped")
    p.add_argument("--rollout", choices=["auto", "vllm", "hf"], default="auto", help="auto: vLLM if installed")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    p.add_argument("--out", default="runs/grpo_gsm8k")
    p.add_argument("--wandb", action="store_true")
    args = p.parse_args()

    on_gpu = args.accelerator == "gpu" or (args.accelerator == "auto" and torch.cuda.is_available())
    module = GRPOModule(
        args.model,
        reward=gsm8k_reward,
        reference=True,
        rollout=RolloutConfig(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens),
        algorithm=AlgorithmConfig(
            advantage="grpo", kl_coef=0.001, kl_estimator="k3", micro_batch_size=args.micro_batch_size
        ),
        actor_optim=OptimConfig(lr=1e-6, warmup_steps=10),
    )
    questions = datasets.load_dataset(
        "json" if args.data.endswith(("json", "jsonl")) else "parquet", data_files=args.data
    )
    questions = questions["train"].map(lambda row: {"prompt": row["question"] + INSTRUCTION})
    data = PromptDataModule(
        questions,
        batch_size=args.prompts,
        max_prompt_length=args.max_prompt_length,
        chat_template=module.tokenizer.chat_template is not None,
    )
    loggers = [CSVLogger(args.out, name="")] + (
        [WandbLogger(project="lightning_rlhf", save_dir=args.out)] if args.wandb else []
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=RLHFStrategy(
            args.rollout,
            vllm={"tensor_parallel_size": args.tp},
            param_dtype=torch.bfloat16 if on_gpu else None,
        ),
        max_steps=args.steps,
        logger=loggers,
        callbacks=[ModelCheckpoint(every_n_train_steps=50, save_top_k=-1)],
        log_every_n_steps=1,
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
