"""SFT run the distributed tests launch as a subprocess (Lightning starts the other ranks from it).

Usage: python tests/scripts/sft_train.py --model DIR --out DIR [--devices N] [--steps N] [--save-ckpt P] [--resume P]
       [--monitor val/loss]
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_rlhf import ExportActor, OptimConfig, RLHFStrategy, SFTDataModule, SFTModule
from lightning_rlhf.demo.task import addition_splits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--save-ckpt", default=None, help="save a checkpoint here at the end")
    p.add_argument("--resume", default=None, help="resume from this checkpoint")
    p.add_argument("--monitor", default=None, help="ExportActor(monitor=..., mode='min'): export the best validation")
    args = p.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    splits = addition_splits()
    module = SFTModule(
        args.model,
        optim=OptimConfig(lr=1e-3, warmup_steps=2, schedule="linear"),
        micro_batch_size=args.micro_batch_size,
    )
    data = SFTDataModule(splits["train"], val=splits["test"], batch_size=args.batch_size, val_batch_size=7)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=RLHFStrategy("hf"),
        max_steps=args.steps,
        logger=CSVLogger(args.out, name="", version=""),
        callbacks=[ExportActor(os.path.join(args.out, "actor"), monitor=args.monitor, mode="min")],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=2,
        check_val_every_n_epoch=None,
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    if args.save_ckpt:
        trainer.save_checkpoint(args.save_ckpt)
    first = next(module.actor.model.parameters())
    checksum = float(first.full_tensor().double().sum())  # an all-gather: every rank
    if trainer.global_rank == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"global_step": trainer.global_step, "param_checksum": checksum}, f)


if __name__ == "__main__":
    main()
