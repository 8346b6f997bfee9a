"""A tiny GRPO job for torchrun, single- or multi-node: ``Trainer(num_nodes=N, devices=D)`` under torchrun.

Every rank is started by torchrun (Lightning detects ``TorchElasticEnvironment`` and starts nothing itself);
the controller is global rank 0, i.e. local rank 0 of node 0. Rank 0 writes ``metrics.csv`` (CSVLogger) and
``result.json``; every rank writes ``rank<R>.json`` saying where it ran and what Lightning saw.

Usage (2 nodes x 2 processes on one machine)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 \\
        tests/scripts/multinode_train.py --model DIR --out DIR --num-nodes 2 --devices 2 &
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 \\
        tests/scripts/multinode_train.py --model DIR --out DIR --num-nodes 2 --devices 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_rlhf import (
    AlgorithmConfig,
    BatchingConfig,
    GRPOModule,
    OptimConfig,
    PromptDataModule,
    RewardConfig,
    RLHFStrategy,
    RolloutConfig,
)
from lightning_rlhf.demo import addition_dataset, addition_reward


def main() -> None:
    """Build and fit the job, then record this rank's view. Runs on: every rank (started by torchrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--devices", type=int, default=4, help="processes per node (torchrun --nproc-per-node)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4, help="RolloutConfig.n")
    p.add_argument("--error-timeout", type=float, default=10.0, help="RLHFStrategy(worker_error_timeout_s=...)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"[multinode_train.py] rank {os.environ.get('RANK')} pid {os.getpid()} at {time.time():.3f}", flush=True)

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    module = GRPOModule(
        args.model,
        reward=addition_reward,
        reward_config=RewardConfig(timeout_s=None),  # in-process: no reward worker processes to start
        rollout=RolloutConfig(n=args.samples, max_new_tokens=4, seed=0),
        algorithm=AlgorithmConfig(advantage="grpo", batching=BatchingConfig(micro_batch_size=4)),
        actor_optim=OptimConfig(lr=1e-4),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        num_nodes=args.num_nodes,
        devices=args.devices,
        strategy=RLHFStrategy("hf", worker_error_timeout_s=args.error_timeout),
        max_steps=args.steps,
        logger=CSVLogger(args.out, name="", version=""),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(addition_dataset(), batch_size=args.prompts, max_prompt_length=16)
    trainer.fit(module, datamodule=data)

    strategy = trainer.strategy
    view = {
        "global_rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "env_node_rank": int(os.environ["GROUP_RANK"]),
        "cluster_environment": type(strategy.cluster_environment).__name__,
        "launcher": type(strategy.launcher).__name__,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(view, f)
    first = next(module.actor.model.parameters()).full_tensor()  # a collective: every rank takes part
    if trainer.global_rank == 0:
        info = {"global_step": trainer.global_step, "param_checksum": float(first.detach().double().sum())}
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(info, f)
    print(f"[multinode_train.py] rank {trainer.global_rank} done at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
