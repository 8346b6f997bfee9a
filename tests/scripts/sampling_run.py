"""A short GRPO run for the sampling/training agreement tests (tests/unit/test_sampling.py, tests/vllm/).

Usage: python tests/scripts/sampling_run.py --model DIR --out DIR [--rollout hf|vllm] [--devices N] [--stale]
    [--temperature T] [--max-prompt-length N] [--max-new-tokens N] [--steps N]

``--stale`` makes the actor skip every weight hand-off after the first (as a custom role that never calls
``mark_weights_changed`` would): the engine samples with the initial weights while the trainer moves on.
Writes ``metrics.csv`` (the CSV logger's rows) to ``--out``; a refused setting exits 3 with the error printed,
and ``loaded.txt`` is written by the first model load, so a test can tell the error came before it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from lightning_rlhf import (
    AlgorithmConfig,
    BatchingConfig,
    GRPOModule,
    OptimConfig,
    PromptDataModule,
    RLHFStrategy,
    RolloutConfig,
)
from lightning_rlhf.demo import addition_dataset, addition_reward
from lightning_rlhf.roles import ActorRole


class StaleActor(ActorRole):
    """An actor whose engine never receives updated weights (a failed or skipped hand-off)."""

    def mark_weights_changed(self) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rollout", default="hf", choices=["hf", "vllm"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--max-prompt-length", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--stale", action="store_true")
    args = p.parse_args()

    module = GRPOModule(
        args.model,
        reward=addition_reward,
        rollout=RolloutConfig(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0),
        algorithm=AlgorithmConfig(batching=BatchingConfig(micro_batch_size=8)),
        actor_optim=OptimConfig(lr=args.lr),
    )
    if args.stale:
        module.actor.__class__ = StaleActor
    load = module.actor.load

    def load_and_mark() -> None:
        with open(os.path.join(args.out, "loaded.txt"), "w") as f:
            f.write("loaded")
        load()

    module.actor.load = load_and_mark  # type: ignore[method-assign]
    data = PromptDataModule(
        addition_dataset(seed=0), batch_size=4 * args.devices, max_prompt_length=args.max_prompt_length, seed=0
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=RLHFStrategy(args.rollout),
        max_steps=args.steps,
        logger=CSVLogger(args.out, name="log", version=0),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(module, datamodule=data)
    except ValueError as err:
        print(f"REFUSED: {err}", file=sys.stderr, flush=True)
        sys.exit(3)
    if trainer.global_rank == 0:
        shutil.copy(os.path.join(args.out, "log", "version_0", "metrics.csv"), os.path.join(args.out, "metrics.csv"))


if __name__ == "__main__":
    main()
