"""The embedded default job: ``python -m lightning_rlhf.demo`` (what ``make demo`` runs).

A tiny Qwen2-style model (built locally, warm-started with ``SFTModule`` on 80 of the 100 single-digit additions,
and cached) learns single-digit addition ("3+4=" -> "7") by GRPO on those 80 prompts, on CPU, over 2 processes by
default. The 20 other prompts are held out: neither the warm start nor RL trains on them, and ``val/score/mean``
(greedy answers) is measured on them before the first RL step and after the last. The run folder gets
``metrics.csv``, the curves (``reward.png`` & co) and ``samples.jsonl``; the run summary is printed at the end, and
the last printed line names the folder.

``--task tools`` runs the agentic task instead (:mod:`lightning_rlhf.demo.tool_task`): three-digit additions that
the same tiny model (warm-started on tool-use transcripts) solves by calling a ``calculator`` tool, in multi-turn
episodes. The end of the run prints the held-out success before and after RL, with and without the tool."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from lightning_rlhf.config.models import embedded_cache_dir

__all__ = [
    "ALGORITHMS_NAMES",
    "build_job",
    "build_parser",
    "demo_placement",
    "main",
    "parse_args",
    "plot_reward",
    "print_tool_table",
]


def _algorithms() -> dict[str, tuple[Any, str]]:
    from lightning_rlhf import modules as m

    return {
        "grpo": (m.GRPOModule, "grpo"),
        "distill": (m.OnPolicyDistillationModule, "grpo"),
        "dapo": (m.DAPOModule, "grpo"),
        "safe": (m.SafeRLHFModule, "grpo"),
        "rloo": (m.RLOOModule, "rloo"),
        "reinforce_pp": (m.REINFORCEPPModule, "reinforce_plus_plus"),
        "remax": (m.ReMaxModule, "remax"),
        "ppo": (m.PPOModule, "gae"),
    }


ALGORITHMS_NAMES = ("grpo", "rloo", "reinforce_pp", "remax", "ppo", "dapo", "safe", "distill")


_VERSION_ENV = "LIGHTNING_RLHF_RUN_VERSION"

_CPU_LAYER: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
"""``--cpu-layer`` -> ``RLHFStrategy(cpu_kernels=...)``."""


def claim_run_version(out: str, name: str) -> int:
    """The run folder's version number, claimed with an atomic ``mkdir`` so two demos started at once in the same folder
    never share ``version_N`` (CSVLogger's own choice lists the folder, which races). The number travels to the ranks
    Lightning launches through the environment. Runs on: every process (rank 0 claims; the ranks it launches inherit the
    number)."""
    inherited = os.environ.get(_VERSION_ENV)
    if inherited is not None:
        return int(inherited)
    root = os.path.join(out, name)
    os.makedirs(root, exist_ok=True)
    version = 0
    while True:
        try:
            os.mkdir(os.path.join(root, f"version_{version}"))
            break
        except FileExistsError:
            version += 1
    os.environ[_VERSION_ENV] = str(version)
    return version


def demo_placement(choice: str, roles: list[str], devices: int) -> Any:
    """``RLHFStrategy(placement=...)`` for the demo's ``--placement``: ``colocate`` (None: every role on every rank),
    ``split`` (the actor and the reward on the first half of the ranks, the other roles on the second half; calls of one
    stage then run at the same time), ``rollout`` (generation on the last half of the ranks, a pool of its own fed the
    actor's weights over collectives; every other role on the first half), ``auto`` (the planner chooses), or a JSON
    mapping role -> ranks. Runs on: every process."""
    if choice == "colocate":
        return None
    if choice == "auto":
        return "auto"
    if choice in ("rollout", "split"):
        if devices < 2:
            raise SystemExit(f"--placement {choice} needs --devices >= 2 (got {devices}).")
        first, second = list(range(devices // 2)), list(range(devices // 2, devices))
        if choice == "rollout":
            return {role: first for role in roles} | {"rollout": second}
        return {role: first if role in ("actor", "reward") else second for role in roles}
    try:
        return json.loads(choice)
    except json.JSONDecodeError as err:
        raise SystemExit(
            f"--placement {choice!r}: expected colocate, split, auto or a JSON mapping role -> ranks ({err})."
        ) from None


def build_job(args: argparse.Namespace, model_path: str) -> tuple[Any, Any, Any]:
    """Module, datamodule and trainer of the demo. Runs on: every process."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_rlhf import config as C
    from lightning_rlhf.callbacks import ExportActor, MetricPlots, RLHFProgressBar, RolloutSamples, RunSummary
    from lightning_rlhf.data import PromptDataModule
    from lightning_rlhf.demo.task import addition_reward
    from lightning_rlhf.demo.vision_task import count_reward
    from lightning_rlhf.strategy import RLHFStrategy

    module_cls, advantage = _algorithms()[args.algo]
    tools, vision = args.task == "tools", args.task == "vision"
    extra, settings, rollout, splits = _choices(args, model_path)
    module = module_cls(
        model_path,
        reward=None if tools else count_reward if vision else addition_reward,
        reference=False,
        rollout=rollout,
        algorithm=C.AlgorithmConfig(
            advantage=args.advantage or advantage,
            kl=C.KLConfig(coef=0.0),
            batching=C.BatchingConfig(
                micro_batch_size=args.micro_batch_size,
                micro_batch_tokens=args.micro_batch_tokens,
                mini_batch_size=args.mini_batch_size,
            ),
            asynchronous=C.AsyncConfig(
                max_staleness=args.max_staleness, stream=args.stream, partial_rollouts=args.partial_rollouts
            ),
            **settings,
        ),
        actor_optim=C.OptimConfig(lr=args.lr, warmup_steps=args.warmup, schedule="linear", min_lr_ratio=0.1),
        validation=C.ValidationConfig(before_train=True),  # greedy answers to the held-out prompts, before RL
        attn_implementation=args.attn_implementation,
        lora={"r": args.lora_rank, "lora_alpha": 2 * args.lora_rank} if args.lora_rank else None,
        activation_checkpointing=args.activation_checkpointing,
        sequence_parallel=args.sequence_parallel,
        train_vision_tower=args.train_vision_tower,
        **extra,
    )
    data = PromptDataModule(
        splits["train"],
        val=splits["test"],
        batch_size=args.prompts,
        max_prompt_length=128 if vision else 64,
        seed=args.seed,
        image_column="image" if vision else None,
    )
    placement = demo_placement(args.placement, list(module.roles()), args.devices)
    run_name = {"tools": "demo-tools", "vision": "demo-vision"}.get(args.task, "demo")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=RLHFStrategy(
            args.rollout,  # auto: vLLM when installed, on every placement
            param_dtype=None if args.precision == "fp32" else args.precision,
            placement=placement,
            cpu_kernels=_CPU_LAYER[args.cpu_layer],
        ),
        max_steps=args.steps,
        logger=CSVLogger(args.out, name=run_name, version=claim_run_version(args.out, run_name)),
        callbacks=[RLHFProgressBar(), MetricPlots(), RolloutSamples(every_n_steps=25), ExportActor(), RunSummary()],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=args.val_every or args.steps,  # validate again after the last step (and every val_every)
        check_val_every_n_epoch=None,
    )
    return module, data, trainer


def _choices(args: argparse.Namespace, model_path: str) -> tuple[dict[str, Any], dict[str, Any], Any, Any]:
    """What ``--algo`` and ``--task`` choose: the module's extra arguments, the algorithm's setting groups, the
    rollout settings and the data splits. Runs on: every process."""
    from lightning_rlhf import config as C
    from lightning_rlhf.demo.task import addition_cost, addition_splits

    tools = args.task == "tools"
    if tools and args.algo == "safe":
        raise SystemExit("--task tools --algo safe: the tool task has no cost function. HINT: another --algo.")
    extra: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    sampling = {"n": args.n, "temperature": 1.0, "seed": args.seed, "decode": args.decode}
    if args.algo == "ppo":  # the critic starts from the actor's backbone with a fresh value head
        extra = {"critic": model_path, "critic_optim": C.OptimConfig(lr=args.lr * 2, warmup_steps=args.warmup)}
    if args.algo == "dapo":  # clip-higher and dynamic sampling; no overlong shaping at 6 new tokens
        settings = {"loss": C.LossConfig(clip_ratio_high=0.28), "filtering": C.FilteringConfig(dynamic_sampling=True)}
    if args.policy_loss:  # another registered policy loss, over the module's clip settings
        settings["loss"] = C.LossConfig(
            **{**vars(settings.get("loss", C.LossConfig())), "policy_loss": args.policy_loss}
        )
    if args.algo == "distill":  # by default the task's warm start after its GRPO demo run (built once, cached)
        from lightning_rlhf.demo.warmstart import prepare_demo_teacher

        extra = {"teacher": args.teacher or prepare_demo_teacher(args.cache, task=args.task, seed=args.seed)}
    if args.algo == "safe":  # answers with a 7 are "unsafe": at most 2% of responses may write one
        extra = {"cost": addition_cost, "safety": C.SafetyConfig(cost_limit=0.02, lambda_init=0.5, lambda_lr=0.5)}
    if tools:  # multi-turn episodes: the environment runs the calculator and scores the final answer
        from lightning_rlhf.demo.tool_task import CalculatorEnvironment, tool_splits

        extra |= {"environment": CalculatorEnvironment}
        loop = "tools"
        if args.agent == "http":  # an agent written against the openai client drives each episode
            import lightning_rlhf.demo.http_agent  # noqa: F401  (registers "http-calculator" in every process)

            loop = "http-calculator"
        episode = C.EpisodeConfig(max_turns=3, tool_workers=1, agent_loop=loop)
        rollout = C.RolloutConfig(**sampling, max_new_tokens=TOOL_TURN_TOKENS, episode=episode)
        splits = tool_splits()
    elif args.task == "vision":  # how many squares a generated image holds (lightning_rlhf.demo.vision_task)
        from lightning_rlhf.demo.vision_task import vision_splits

        rollout = C.RolloutConfig(**sampling, max_new_tokens=3)
        splits = vision_splits(seed=args.seed)
    else:
        rollout = C.RolloutConfig(**sampling, max_new_tokens=6)
        splits = addition_splits()  # the same 20 held-out prompts as the warm start left out
    return extra, settings, rollout, splits


def plot_reward(
    metrics_csv: str, out_png: str, title: str = "GRPO", metric: str = "critic/score/mean"
) -> dict[str, float]:
    """Plot ``metric`` (the mean reward) per step into ``out_png``; returns first/last-10% means. Runs on: rank 0."""
    import csv

    from lightning_rlhf.callbacks.history import first_last
    from lightning_rlhf.callbacks.plots import plot_curve

    with open(metrics_csv) as f:
        rows = [(int(row["step"]), float(row[metric])) for row in csv.DictReader(f) if row.get(metric)]
    scores = [score for _, score in rows]
    first, last = first_last(scores) if scores else (0.0, 0.0)
    title = f"{title} on addition: {first:.2f} -> {last:.2f}"
    plot_curve([step for step, _ in rows], scores, out_png, metric=f"mean reward ({metric})", title=title)
    return {"first": first, "last": last, "steps": float(len(scores))}


TOOL_TURN_TOKENS = 96
"""``RolloutConfig.max_new_tokens`` of the tool task: one turn (a calculator call is about 75 tokens of the tiny
byte-level vocabulary)."""

TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "addition": {"steps": 250, "prompts": 32, "lr": 5e-4, "warmup": 20, "warm_start_steps": 40},
    "tools": {"steps": 60, "prompts": 16, "lr": 3e-4, "warmup": 5, "warm_start_steps": None},
    "vision": {"steps": 100, "prompts": 16, "lr": 1e-3, "warmup": 5, "warm_start_steps": 40},
}
"""The demo's settings per ``--task`` where the command line leaves them out (``warm_start_steps`` None: the tool
model's own default, :data:`~lightning_rlhf.demo.warmstart.TOOL_WARM_START_STEPS`)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's arguments with the task's defaults filled in. Runs on: every process."""
    args = build_parser().parse_args(argv)
    for key, value in TASK_DEFAULTS[args.task].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line (``python -m lightning_rlhf.demo --help``), its options grouped by concern. Runs on:
    every process."""
    parser = argparse.ArgumentParser(prog="python -m lightning_rlhf.demo", description=__doc__)
    _task_arguments(parser.add_argument_group("task and algorithm").add_argument)
    _placement_arguments(parser.add_argument_group("devices, engines and placement").add_argument)
    _training_arguments(parser.add_argument_group("training").add_argument)
    return parser


def _task_arguments(add: Callable[..., Any]) -> None:
    add("--algo", choices=ALGORITHMS_NAMES, default="grpo", help="ready module to train with")
    add(
        "--policy-loss",
        default=None,
        help="LossConfig.policy_loss: a registered policy loss (vanilla, dual_clip, gspo, cispo, sapo, gpg, dppo_kl, "
        "dppo_tv; default: the module's)",
    )
    add("--advantage", default=None, help="AlgorithmConfig.advantage: a registered estimator (default: the module's)")
    add(
        "--teacher",
        default=None,
        help="--algo distill: the teacher's model folder (default: the task's warm start after its GRPO demo run, "
        "built on first use and cached)",
    )
    add(
        "--task",
        choices=list(TASK_DEFAULTS),
        default="addition",
        help="addition: single-digit sums in one turn; tools: three-digit sums in multi-turn episodes with a "
        "calculator tool (lightning_rlhf.demo.tool_task); vision: how many squares a generated image holds, "
        "for a tiny Qwen2-VL (lightning_rlhf.demo.vision_task)",
    )
    add(
        "--agent",
        choices=["builtin", "http"],
        default="builtin",
        help="--task tools: builtin (the tool loop) or http (a small agent written against the openai client talks "
        "to the policy through an OpenAI-compatible endpoint on each rank)",
    )
    add(
        "--train-vision-tower",
        action="store_true",
        help="--task vision: train the vision tower too (RLHFModule(train_vision_tower=True); default: frozen)",
    )
    add(
        "--warm-start-steps",
        type=int,
        default=None,
        help="SFTModule steps of the warm start (addition 40, tools 150, vision 40)",
    )
    add("--seed", type=int, default=0)


def _placement_arguments(add: Callable[..., Any]) -> None:
    add(
        "--accelerator",
        choices=["cpu", "gpu"],
        default="cpu",
        help="where the roles train: cpu (worker processes), gpu (one process per GPU; the transformers engine "
        "where vLLM's GPU build is not installed)",
    )
    add("--devices", type=int, default=2, help="worker processes (CPU) or GPUs")
    add(
        "--rollout",
        choices=["auto", "vllm", "hf"],
        default="auto",
        help="rollout engine. auto: vLLM if installed (colocated in the training processes when generation runs on "
        "every rank; one engine server per rank for a pool of part of the ranks), else transformers generation",
    )
    add(
        "--decode",
        choices=["auto", "loop", "generate"],
        default="auto",
        help="RolloutConfig.decode, how the transformers engine samples. auto: its own decoding loop on CPU, "
        "transformers' generate on a GPU; loop or generate forces one (what a GPU user of --rollout hf runs: generate)",
    )
    add(
        "--cpu-layer",
        choices=list(_CPU_LAYER),
        default="auto",
        help="RLHFStrategy(cpu_kernels=...), the CPU speed layer (compiled kernels, oneDNN linears). auto: "
        "$LIGHTNING_RLHF_CPU_KERNELS, else on with a CPU; off: PyTorch's own ops, as on a GPU",
    )
    add(
        "--placement",
        default="colocate",
        help="where roles run: colocate (all on every rank), split (actor+reward on the first half of the ranks, "
        "the others on the second: with --algo ppo the critic's update overlaps the actor's; transformers "
        "generation), rollout (generation alone on the second half), auto (the planner "
        "chooses), or JSON role -> ranks",
    )
    add(
        "--max-staleness",
        type=int,
        default=0,
        help="AlgorithmConfig.asynchronous.max_staleness: 1 generates the next batch on the rollout pool while the "
        "actor trains (asynchronous; needs --placement rollout)",
    )
    add(
        "--stream",
        action="store_true",
        help="AsyncConfig.stream: the rollout pool generates continuously; each step trains on the oldest complete "
        "groups (needs --placement rollout and --max-staleness >= 1)",
    )
    add(
        "--partial-rollouts",
        action="store_true",
        help="AsyncConfig.partial_rollouts: streamed rollouts whose hand-offs interrupt the running requests, which go "
        "on with the new weights (needs --placement rollout and --max-staleness >= 1)",
    )
    add("--out", default="runs", help="parent folder of the run folder")
    add(
        "--cache",
        default=embedded_cache_dir(),
        help="where the warm-started model is cached ($LIGHTNING_RLHF_CACHE, else ~/.cache/lightning_rlhf)",
    )


def _training_arguments(add: Callable[..., Any]) -> None:
    add("--steps", type=int, default=None, help="RL steps (addition 250, tools 60)")
    add("--prompts", type=int, default=None, help="prompts per step (addition 32, tools 16)")
    add("--n", type=int, default=8, help="samples per prompt")
    add("--lr", type=float, default=None, help="actor learning rate (addition 5e-4, tools 3e-4)")
    add("--warmup", type=int, default=None, help="learning-rate warm-up steps (addition 20, tools 5)")
    add(
        "--mini-batch-size",
        type=int,
        default=None,
        help="BatchingConfig.mini_batch_size: samples per optimizer step (default: the whole batch, one step); "
        "smaller makes the later steps of a batch off-policy, where the policy losses' clips act",
    )
    add("--micro-batch-size", type=int, default=128)
    add("--micro-batch-tokens", type=int, default=None, help="token budget per micro-batch (packs rows, no padding)")
    add("--precision", choices=["fp32", "bf16"], default="fp32", help="compute dtype (fp32 master weights either way)")
    add("--attn-implementation", default=None, help="transformers attention kernel, e.g. eager")
    lora_help = "train LoRA adapters of this rank (alpha = 2 x rank, every linear layer) instead of every weight"
    add("--lora-rank", type=int, default=None, help=lora_help)
    add("--activation-checkpointing", action="store_true", help="RLHFModule(activation_checkpointing=True)")
    add("--sequence-parallel", type=int, default=1, help="RLHFModule(sequence_parallel=N), N dividing --devices")
    add("--val-every", type=int, default=None, help="validate every N steps as well (default: before and after)")


def main(argv: list[str] | None = None) -> None:
    """Run the demo job. Runs on: every process (Lightning relaunches this module as the other ranks)."""
    args = parse_args(argv)

    import lightning as L
    import torch

    from lightning_rlhf.demo.warmstart import prepare_demo_model, prepare_tool_model, prepare_vision_model

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    L.seed_everything(args.seed, verbose=False)
    if args.task == "tools":
        steps = {} if args.warm_start_steps is None else {"warm_start_steps": args.warm_start_steps}
        model_path = prepare_tool_model(args.cache, seed=args.seed, **steps)
    elif args.task == "vision":
        model_path = prepare_vision_model(args.cache, seed=args.seed, warm_start_steps=args.warm_start_steps)
    else:
        model_path = prepare_demo_model(args.cache, seed=args.seed, warm_start_steps=args.warm_start_steps)
    module, data, trainer = build_job(args, model_path)
    trainer.fit(module, datamodule=data)  # RunSummary prints the summary; MetricPlots draws reward.png & co
    if trainer.global_rank != 0:
        return
    teacher = getattr(module, "teacher", None)
    teacher_path = None if teacher is None else str(teacher.path)
    if args.task == "tools":
        print_tool_table(model_path, _exported(trainer), trainer.logger.log_dir, teacher=teacher_path)
    elif teacher_path is not None:
        print_distillation(model_path, _exported(trainer), teacher_path, trainer.logger.log_dir, task=args.task)
    print(f"run folder: {os.path.abspath(trainer.logger.log_dir)}")


def print_distillation(
    before: str, after: str, teacher: str, log_dir: str, *, task: str = "addition"
) -> dict[str, float]:
    """The task's held-out success (greedy) of the student before and after distillation and of its teacher (the
    addition task's 20 held-out sums, or the visual task's held-out drawings); printed, and written to
    ``log_dir/distillation.json``. Runs on: rank 0, after ``fit``."""
    from lightning_rlhf.demo.vision_task import vision_held_out_accuracy
    from lightning_rlhf.demo.warmstart import held_out_accuracy

    accuracy = vision_held_out_accuracy if task == "vision" else held_out_accuracy
    table = {"student before": accuracy(before), "student after": accuracy(after), "teacher": accuracy(teacher)}
    what = "the held-out drawings" if task == "vision" else "20 single-digit sums"
    print(f"held-out success ({what}, greedy):")
    for name, value in table.items():
        print(f"  {name:<16} {value:.3f}")
    with open(os.path.join(log_dir, "distillation.json"), "w") as f:
        json.dump(table, f, indent=1)
    return table


def _exported(trainer: Any) -> str:
    from lightning_rlhf.callbacks import ExportActor

    folder = next(cb.last_export for cb in trainer.callbacks if isinstance(cb, ExportActor))
    if folder is None:
        raise RuntimeError("the demo's ExportActor exported nothing at the end of fit")
    return str(folder)


def print_tool_table(
    before: str, after: str, log_dir: str, *, teacher: str | None = None
) -> dict[str, dict[str, float]]:
    """The tool task's held-out success (greedy episodes) of the warm-started model (``before``) and the RL-trained one
    (``after``), each with and without the tool (and of a distillation's ``teacher``, with it); printed, and written to
    ``log_dir/tool_success.json``. Runs on: rank 0, after ``fit``."""
    from lightning_rlhf.demo.tool_task import tool_splits
    from lightning_rlhf.demo.warmstart import tool_success

    test = tool_splits()["test"]
    table = {
        f"{when}, {how}": tool_success(path, test, with_tool=how == "with the tool")
        for when, path in (("before RL", before), ("after RL", after))
        for how in ("with the tool", "without the tool")
    }
    if teacher is not None:
        table["teacher, with the tool"] = tool_success(teacher, test, with_tool=True)
    print(f"held-out success ({len(test)} three-digit sums, greedy episodes):")
    for name, row in table.items():
        print(
            f"  {name:<30} {row['success']:.3f}   tool calls/episode {row['tool_calls']:.2f}   turns {row['turns']:.2f}"
        )
    with open(os.path.join(log_dir, "tool_success.json"), "w") as f:
        json.dump(table, f, indent=1)
    return table
