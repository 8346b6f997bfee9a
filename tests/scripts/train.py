"""Training script the distributed tests launch as a subprocess (Lightning starts the other ranks from it).

Usage: python tests/scripts/train.py --model DIR --out DIR [--algo grpo|ppo] [--devices N] [--steps N] ...
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_rlhf import (
    AlgorithmConfig,
    DAPOModule,
    EpisodeConfig,
    FilteringConfig,
    GRPOModule,
    KLConfig,
    LossConfig,
    OnPolicyDistillationModule,
    OptimConfig,
    PPOModule,
    PromptDataModule,
    RewardConfig,
    RLHFStrategy,
    RolloutConfig,
    SafeRLHFModule,
    SafetyConfig,
    ValidationConfig,
)
from lightning_rlhf.batch import Batch
from lightning_rlhf.callbacks import MetricPlots, RLHFProgressBar, RolloutSamples, RunSummary
from lightning_rlhf.controller.dispatch import Dispatch, role_method
from lightning_rlhf.demo import addition_cost, addition_dataset, addition_reward
from lightning_rlhf.demo.tool_task import CalculatorEnvironment, tool_splits
from lightning_rlhf.demo.vision_task import CountTwiceEnvironment, count_reward, vision_dataset
from lightning_rlhf.roles import ActorRole


def _rank() -> int:
    """This rank, read where reward functions run: in a reward worker process, which has no process group (the
    launcher's LOCAL_RANK is in its environment; rank 0 is the launching process, which has none)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def chars_reward(prompts, completions, **kw):
    """The number of distinct characters of a completion, over 10: differs between a random model's samples."""
    return [len(set(c)) / 10 for c in completions]


def failing_reward(prompts, completions, answer, **kw):
    """Raises on rank 1 only: the clean error path (every rank reaches the gather)."""
    if _rank() == 1:
        raise ValueError("reward exploded on purpose")
    return addition_reward(prompts, completions, answer)


def hanging_reward(out: str):
    """The addition reward, except that rank 1's second call (step 1) hangs: the timeout must end it.

    A closure (cloudpickle sends it to the reward worker process by value); calls are counted in files under
    ``out``, since the calls run in that process."""

    def hanging_reward(prompts, completions, answer, **kw):
        rank = _rank()
        with open(os.path.join(out, f"reward_calls_rank{rank}"), "a") as f:
            f.write(".")
        if rank == 1 and os.path.getsize(os.path.join(out, f"reward_calls_rank{rank}")) == 2:
            time.sleep(1000)
        return addition_reward(prompts, completions, answer)

    return hanging_reward


class FailingActor(ActorRole):
    """Raises in update on rank 1 only, while rank 0 waits in FSDP collectives: the stuck error path."""

    @role_method(Dispatch.DP_SPLIT)
    def update(self, batch: Batch) -> dict[str, float]:
        if torch.distributed.get_rank() == 1:
            raise RuntimeError("actor update exploded on purpose")
        return super().update(batch)


class SignalActor(ActorRole):
    """Rank ``rank`` sends itself ``signum`` during its ``nth`` ``actor.update`` (1-based): a kill mid-step."""

    signal_at: tuple[int, int, int] = (-1, 0, 0)

    @role_method(Dispatch.DP_SPLIT)
    def update(self, batch: Batch) -> dict[str, float]:
        rank, signum, nth = self.signal_at
        self._updates = getattr(self, "_updates", 0) + 1
        if torch.distributed.get_rank() == rank and self._updates == nth:
            print(f"[train.py] rank {rank} sends itself signal {signum} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signum)
        return super().update(batch)


HANDOFF_DROPPED = "model.layers.0.mlp.down_proj.weight"


def lose_one_tensor_in_hand_offs() -> None:
    """From the second weight hand-off on, :data:`HANDOFF_DROPPED` reaches the rollout engine under its own name but
    as zeros: only its data is lost, which the hand-off's fingerprint check must report at that step."""
    import lightning_rlhf.engines.hybrid as hybrid

    real, calls = hybrid.weights_for, [0]

    def weights_for(*args, **kwargs):
        calls[0] += 1
        for name, tensor in real(*args, **kwargs):
            yield name, torch.zeros_like(tensor) if calls[0] >= 2 and name == HANDOFF_DROPPED else tensor

    hybrid.weights_for = weights_for


def kill_during_save(rank: int) -> None:
    """Rank ``rank`` SIGKILLs itself right after writing its checkpoint shards, before the save completes."""
    import signal as signal_module

    from lightning.pytorch.strategies import model_parallel

    original = model_parallel._distributed_checkpoint_save

    def save_then_die(state, path):
        original(state, path)
        if torch.distributed.get_rank() == rank:
            print(f"[train.py] rank {rank} sends itself SIGKILL while saving at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal_module.SIGKILL)

    model_parallel._distributed_checkpoint_save = save_then_die


class ProfileStep(L.Callback):
    """torch.profiler around one training step; each rank writes ``profile_rank<r>.txt`` (ops by self host time,
    then on a GPU by self device time) into the run folder. Runs on: every rank."""

    def __init__(self, step: int, out: str) -> None:
        self.step, self.out, self.prof = step, out, None

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            from torch.profiler import ProfilerActivity, profile

            cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self.prof = profile(activities=[ProfilerActivity.CPU, *cuda])
            self.prof.__enter__()

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            events = self.prof.key_averages()
            keys = ["self_cpu_time_total"] + (["self_device_time_total"] if torch.cuda.is_available() else [])
            with open(os.path.join(self.out, f"profile_rank{trainer.global_rank}.txt"), "w") as f:
                for key in keys:  # by host time first: a step can be slow on the host with an idle GPU
                    f.write(f"sorted by {key}\n{events.table(sort_by=key, row_limit=40)}\n")
            self.prof = None


ULYSSES_CALLS = [0]


def count_ulysses_calls() -> None:
    """Count the sequence-parallel attention's calls in this process (``result.json``'s ``ulysses_calls``)."""
    from transformers import AttentionInterface

    from lightning_rlhf.engines.train import ulysses

    def counted(*args, **kwargs):
        ULYSSES_CALLS[0] += 1
        return ulysses._attention(*args, **kwargs)

    AttentionInterface.register(ulysses.ATTENTION_NAME, counted)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--algo", default="grpo")
    p.add_argument("--teacher", help="--algo distill: the teacher's model folder")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16 (GPU runs)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--rollout", default="hf", choices=["hf", "vllm"])
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="vLLM weight hand-off bucket size")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--mini-batch-size", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="AlgorithmConfig.batching.micro_batch_tokens")
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument(
        "--max-staleness", type=int, default=0, help="AlgorithmConfig.asynchronous.max_staleness (async rollouts)"
    )
    p.add_argument("--stream", action="store_true", help="AsyncConfig.stream (streamed rollouts)")
    p.add_argument("--min-new-tokens", type=int, default=0, help="RolloutConfig.min_new_tokens (long responses)")
    p.add_argument("--partial-rollouts", action="store_true", help="AsyncConfig.partial_rollouts")
    p.add_argument("--save-ckpt", default=None, help="save a checkpoint here at the end")
    p.add_argument("--resume", default=None, help="resume from this checkpoint")
    p.add_argument("--wandb", action="store_true")
    p.add_argument("--checkpoint-callback", action="store_true")
    p.add_argument("--ux-callbacks", action="store_true", help="progress bar, summary, plots, sample rollouts")
    p.add_argument("--samples-every", type=int, default=2, help="RolloutSamples(every_n_steps=...)")
    p.add_argument(
        "--fault",
        choices=["none", "reward", "actor_update", "handoff"],
        default="none",
        help="handoff: from the 2nd weight hand-off on, one tensor arrives as zeros (the check must fail the step)",
    )
    p.add_argument("--error-timeout", type=float, default=10.0)
    p.add_argument("--profile-step", type=int, default=-1, help="torch.profiler op table of this step, every rank")
    p.add_argument("--val-every", type=int, default=0, help="validate every N steps on a separate set (0: none)")
    p.add_argument("--val-before-train", action="store_true", help="ValidationConfig(before_train=True)")
    p.add_argument("--val-prompts", type=int, default=6, help="prompts in the validation set")
    p.add_argument("--val-batch-size", type=int, default=4)
    p.add_argument("--val-n", type=int, default=1, help="ValidationConfig.n: 1 is greedy, more sample at 1.0")
    p.add_argument(
        "--reward",
        choices=["addition", "hang", "chars"],
        default="addition",
        help="hang: rank 1's 2nd call hangs; chars: distinct characters (random models get rewards that differ)",
    )
    p.add_argument(
        "--task",
        choices=["addition", "tools", "vision", "vision-episodes"],
        default="addition",
        help="tools: episodes of the demo's tool task (CalculatorEnvironment scores them; --model needs its template); "
        "vision: the demo's visual task, prompts with images (--model a tiny VLM, lightning_rlhf.demo.tiny_vlm); "
        "vision-episodes: two-turn episodes with an image in each (CountTwiceEnvironment)",
    )
    p.add_argument("--reward-timeout", type=float, default=60.0, help="RewardConfig.timeout_s")
    p.add_argument("--signal-at", default=None, help="RANK:SIGNAL:N: rank sends itself SIGNAL in its N-th actor.update")
    p.add_argument("--kill-during-save", type=int, default=None, help="this rank SIGKILLs itself while saving")
    p.add_argument("--preemption-path", default=None, help="RLHFStrategy(preemption_path=...)")
    p.add_argument("--no-preemption-checkpoint", action="store_true", help="RLHFStrategy(preemption_checkpoint=False)")
    p.add_argument("--placement", default=None, help="RLHFStrategy(placement=...): JSON role -> ranks, or 'auto'")
    p.add_argument("--lora-rank", type=int, default=None, help="RLHFModule(lora={'r': R, 'lora_alpha': 2R})")
    p.add_argument("--activation-checkpointing", action="store_true", help="RLHFModule(activation_checkpointing=True)")
    p.add_argument("--memory-census", action="store_true", help="RLHFStrategy(memory_census=True)")
    p.add_argument("--sequence-parallel", type=int, default=1, help="RLHFModule(sequence_parallel=N)")
    p.add_argument("--lora-handoff", default="adapter", choices=["merged", "adapter"], help="VLLMConfig.lora_handoff")
    args = p.parse_args()
    if args.signal_at or args.kill_during_save is not None:
        print(f"[train.py] rank {os.environ.get('LOCAL_RANK', '0')} pid {os.getpid()}", flush=True)
    if args.kill_during_save is not None:
        kill_during_save(args.kill_during_save)
    if args.fault == "handoff":
        lose_one_tensor_in_hand_offs()

    if args.sequence_parallel > 1:
        count_ulysses_calls()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    algo_kwargs = dict(
        micro_batch_size=args.micro_batch_size,
        micro_batch_tokens=args.micro_batch_tokens,
        mini_batch_size=args.mini_batch_size,
        ppo_epochs=args.ppo_epochs,
        kl_coef=args.kl_coef,
        max_staleness=args.max_staleness,
        stream=args.stream,
        partial_rollouts=args.partial_rollouts,
    )
    reward = failing_reward if args.fault == "reward" else chars_reward if args.reward == "chars" else addition_reward
    reward = count_reward if args.task == "vision" else reward
    tools = args.task == "tools"
    looks = args.task == "vision-episodes"  # two turns, an image in each
    episode = EpisodeConfig(max_turns=2, tool_workers=1, max_episode_tokens=48) if looks else None
    common = dict(
        reward=None if tools or looks else hanging_reward(args.out) if args.reward == "hang" else reward,
        reward_config=RewardConfig(timeout_s=args.reward_timeout),
        rollout=RolloutConfig(n=args.n, max_new_tokens=96, seed=0, episode=EpisodeConfig(max_turns=3, tool_workers=1))
        if tools
        else RolloutConfig(n=args.n, max_new_tokens=5, seed=0, episode=episode)
        if looks
        else RolloutConfig(
            n=args.n, max_new_tokens=max(5, args.min_new_tokens), min_new_tokens=args.min_new_tokens, seed=0
        ),
        validation=ValidationConfig(
            n=args.val_n, temperature=1.0 if args.val_n > 1 else 0.0, before_train=args.val_before_train
        ),
        actor_optim=OptimConfig(lr=1e-3, warmup_steps=2),
        lora={"r": args.lora_rank, "lora_alpha": 2 * args.lora_rank} if args.lora_rank else None,
        activation_checkpointing=args.activation_checkpointing,
        sequence_parallel=args.sequence_parallel,
    )
    if tools or looks:
        common["environment"] = CountTwiceEnvironment if looks else CalculatorEnvironment
    if args.algo == "ppo":
        module = PPOModule(
            args.model,
            critic=args.model,
            reference=True,
            algorithm=AlgorithmConfig(advantage="gae", **algo_kwargs, kl=KLConfig(in_reward=True, estimator="k1")),
            critic_optim=OptimConfig(lr=1e-3),
            **common,
        )
    elif args.algo == "safe":  # PPO-Lagrangian with a reward critic and a cost critic
        module = SafeRLHFModule(
            args.model,
            cost=addition_cost,
            critic=args.model,
            algorithm=AlgorithmConfig(advantage="gae", **algo_kwargs),
            safety=SafetyConfig(cost_limit=0.0, lambda_init=1.0, lambda_lr=1.0),
            critic_optim=OptimConfig(lr=1e-3),
            **common,
        )
    elif args.algo == "distill":  # on-policy distillation toward --teacher
        module = OnPolicyDistillationModule(
            args.model, teacher=args.teacher, algorithm=AlgorithmConfig(**algo_kwargs), **common
        )
    elif args.algo == "dapo":  # dynamic sampling with a single extra round at most
        module = DAPOModule(
            args.model,
            algorithm=AlgorithmConfig(
                **algo_kwargs,
                loss=LossConfig(clip_ratio_high=0.28),
                filtering=FilteringConfig(dynamic_sampling=True, max_sampling_rounds=2),
            ),
            **common,
        )
    else:
        module = GRPOModule(
            args.model,
            reference=True if args.kl_coef > 0 else None,
            algorithm=AlgorithmConfig(advantage="grpo", **algo_kwargs),
            **common,
        )
    if args.fault == "actor_update":
        old = module.actor
        module.actor = FailingActor(
            old.path, tokenizer=old.tokenizer, rollout=old.rollout, algorithm=old.algorithm, optim=old.optim
        )
    if args.signal_at:
        import signal as signal_module

        rank, name, nth = args.signal_at.split(":")
        old = module.actor
        module.actor = SignalActor(
            old.path, tokenizer=old.tokenizer, rollout=old.rollout, algorithm=old.algorithm, optim=old.optim
        )
        module.actor.signal_at = (int(rank), int(signal_module.Signals[name]), int(nth))
    loggers: list = [CSVLogger(args.out, name="", version="")]
    if args.wandb:
        loggers.append(WandbLogger(project="lightning_rlhf-test", save_dir=args.out, offline=True))
    callbacks: list = [ProfileStep(args.profile_step, args.out)] if args.profile_step >= 0 else []
    if args.checkpoint_callback:
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(args.out, "ckpt"),
                monitor="critic/score/mean",
                mode="max",
                every_n_train_steps=1,
            )
        )
    if args.ux_callbacks:
        callbacks += [
            RLHFProgressBar(),
            MetricPlots(),
            RolloutSamples(every_n_steps=args.samples_every, num_samples=3),
            RunSummary(),
        ]
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=RLHFStrategy(
            args.rollout,
            vllm={
                "tensor_parallel_size": args.tp,
                "weight_bucket_mb": args.bucket_mb,
                "lora_handoff": args.lora_handoff,
            },
            worker_error_timeout_s=args.error_timeout,
            param_dtype=torch.bfloat16 if args.bf16 else None,
            preemption_checkpoint=not args.no_preemption_checkpoint,
            memory_census=args.memory_census,
            preemption_path=args.preemption_path,
            placement=None
            if args.placement is None
            else ("auto" if args.placement == "auto" else json.loads(args.placement)),
        ),
        max_steps=args.steps,
        logger=loggers,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_checkpointing=args.checkpoint_callback,
        enable_progress_bar=args.ux_callbacks,
        enable_model_summary=False,
        val_check_interval=args.val_every or None,
        check_val_every_n_epoch=None if args.val_every else 1,
    )
    vision = args.task == "vision"
    data = PromptDataModule(
        tool_splits()["train"] if tools else vision_dataset(32) if vision or looks else addition_dataset(),
        val=addition_dataset(num_prompts=args.val_prompts, seed=1) if args.val_every else None,
        val_batch_size=args.val_batch_size,
        batch_size=args.prompts,
        max_prompt_length=64
        if tools
        else 128
        if vision or looks
        else 16,  # tools: the rendered episode prompt (53 tokens)
        image_column="image" if vision else None,
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    if args.save_ckpt:
        trainer.save_checkpoint(args.save_ckpt)
    if args.sequence_parallel > 1:  # every rank's count: a pool without rank 0 splits its sequences too
        with open(os.path.join(args.out, f"ulysses_calls.{trainer.global_rank}"), "w") as f:
            f.write(str(ULYSSES_CALLS[0]))
    if trainer.global_rank == 0:
        first = next(p for p in module.actor.model.parameters() if p.requires_grad)  # LoRA: an adapter
        info = {
            "global_step": trainer.global_step,
            "param_checksum": float(first.detach().full_tensor().double().sum()),
            "ulysses_calls": ULYSSES_CALLS[0],  # sequence-parallel attention calls on rank 0
            "checkpointed_blocks": {  # transformer blocks that recompute their forward in the backward, per role
                name: sum(getattr(m, "gradient_checkpointing", False) is True for m in role.model.modules())
                for name, role in module.roles().items()
                if getattr(role, "model", None) is not None
            },
        }
        if args.ux_callbacks:
            info["progress_bar_metrics"] = sorted(trainer.progress_bar_metrics)
            info["progress_bar_items"] = sorted(trainer.progress_bar_callback.get_metrics(trainer, module))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(info, f)
    elif getattr(trainer.strategy, "holds", lambda role: True)("actor"):
        next(p for p in module.actor.model.parameters() if p.requires_grad).full_tensor()  # the checksum's gather


if __name__ == "__main__":
    main()
