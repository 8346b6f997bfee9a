"""``RLHFModule``: a LightningModule with four roles whose ``training_step`` is the RL dataflow.

Subclass it and write ``training_step`` as one sequential program over role calls (it runs on the controller,
rank 0), or use a ready module (``GRPOModule``, ``PPOModule``). Run it with ``Trainer(strategy=RLHFStrategy())``."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import lightning as L
import torch

import lightning_rlhf.dataflow.advantages as dataflow_advantages
from lightning_rlhf.agents.env import environment_factory, resolve_environment, with_environment_reward
from lightning_rlhf.agents.rollout import check_environment
from lightning_rlhf.algorithms import estimator_inputs
from lightning_rlhf.batch import Batch
from lightning_rlhf.compat.lightning import attached_trainer
from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RewardConfig, RolloutConfig, ValidationConfig
from lightning_rlhf.config.models import ensure_pad_token, resolve_model_path
from lightning_rlhf.controller.dispatch import (
    RoleFuture,
    collect,
    concurrently,
    in_background,
    sequence_parallel_roles,
)
from lightning_rlhf.dataflow.metrics import (
    REPLAYED_LOG_ARGS,
    check_log_interval,
    check_rollout_probs_diff,
    rollout_metrics,
    samples_of,
    timer,
)
from lightning_rlhf.dataflow.rollouts import (
    extra_prompts,
    keep_informative_groups,
    pack_rollout,
    streamed_rollout,
    unpack_rollout,
)
from lightning_rlhf.dataflow.validation import validation_metrics, validation_rollout
from lightning_rlhf.engines.train import resolve_dtype
from lightning_rlhf.engines.train.lora import resolve_lora
from lightning_rlhf.engines.train.ulysses import check_size
from lightning_rlhf.rewards import RewardSpec, reward_components
from lightning_rlhf.roles import ActorRole, CriticRole, ReferenceRole, RewardRole, Role, RolloutRole
from lightning_rlhf.roles.base import check_pretrained

__all__ = ["RLHFModule"]


_HANDOFF_METRICS = (
    "timing_s/update_weights",
    "perf/weight_sync_bytes",
    "perf/weight_sync_gathered_bytes",
    "perf/weight_verify_s",
)
"""The hand-off's metrics a rollout generated on the rollout pool carries in its ``meta`` (as the actor's do)."""


class RLHFModule(L.LightningModule):
    """Four roles (actor, critic, reference, reward) and the helpers an RL dataflow needs. Runs on: every process.
    ``training_step`` runs on the controller only; role methods called from it run on every rank.

    Args:
        actor: local folder or hub id of the policy (a transformers causal LM).
        reward: a function ``fn(prompts, completions, **dataset_columns) -> list[float]``, the path of a
            sequence-classification reward model, or ``{name: function or model path}`` (any number of
            functions, at most one model) combined with ``reward_config.weights``; see docs/rewards.md.
        critic: path of the value model's initial weights (usually the actor's); None: no critic.
        reference: path of the frozen reference policy; ``True`` uses the actor's path; ``False``: none;
            ``None`` (default): the actor's path when ``algorithm.kl.coef > 0``, else none.
        tokenizer: tokenizer path; defaults to the actor's.
        rollout: sampling settings.
        algorithm: RL math and batch splitting.
        reward_config: how reward functions are called (in reward worker processes, with a timeout, fallback
            score, batches) and the weights of named rewards.
        validation: how the validation loop generates (samples per prompt, greedy or a temperature) and its
            pass@k settings; it runs when the datamodule has validation prompts.
        frozen_dtype: the dtype the frozen models (reference, reward model) are held and computed in:
            ``"float32"`` or ``"bfloat16"`` (half their memory; the trainable roles keep float32 master weights
            and compute in ``RLHFStrategy(param_dtype=...)``).
        attn_implementation: transformers' ``attn_implementation`` of every role's training forwards and of the
            transformers rollout engine: None keeps the models' default (``"sdpa"``); ``"flash_attention_2"`` on
            GPUs with flash-attn; ``"eager"`` is faster on CPUs for short sequences (docs/performance.md).
        environment: multi-turn episodes instead of one response per prompt (docs/agents.md): an
            :class:`~lightning_rlhf.agents.Environment` class, a factory, a ``ToolEnvironment(tools=[...])``, a
            TRL-style ``environment_factory`` class, or its import path; or several of those by name, each dataset
            row's ``environment`` column choosing its own. Its score (``reward(episode)``) is the reward component
            ``environment``, beside ``reward`` if given (which may then be None).
        lora: train LoRA adapters instead of every weight (docs/lora.md): a ``peft.LoraConfig`` or its fields as a
            dict (``{"r": 16, "lora_alpha": 32}``; ``target_modules`` defaults to ``"all-linear"``). It applies to
            the actor and the critic (whose value head is trained whole); with ``reference=True`` the reference is
            the actor's base model with its adapters disabled, not a second copy.
        activation_checkpointing: each transformer block keeps only its input in the forward and recomputes the
            rest in the backward (less activation memory, one more forward per update): True for the trained roles
            (actor and critic), or the names of the roles. The gradients are the same.
        sequence_parallel: ranks that share each sequence in the forwards of the actor, critic and reference
            (DeepSpeed-Ulysses: each holds ``1/N`` of the columns, attention exchanges heads; docs/performance.md).
            It must divide each of their pools and the models' attention heads; the data-parallel size is pool / N.
        train_vision_tower: a vision-language actor (Qwen2-VL family) trains its vision tower too; by default it is
            frozen and the language model alone learns (docs/vision.md).
    """

    def __init__(
        self,
        actor: str,
        *,
        reward: RewardSpec | None = None,
        critic: str | None = None,
        reference: str | bool | None = None,
        tokenizer: str | None = None,
        rollout: RolloutConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        actor_optim: OptimConfig | None = None,
        critic_optim: OptimConfig | None = None,
        reward_config: RewardConfig | None = None,
        validation: ValidationConfig | None = None,
        frozen_dtype: str | torch.dtype = "float32",
        attn_implementation: str | None = None,
        environment: Any = None,
        lora: Any = None,
        activation_checkpointing: bool | Sequence[str] = False,
        sequence_parallel: int = 1,
        train_vision_tower: bool = False,
    ) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        self.automatic_optimization = False  # the roles step their own optimizers, several times per step
        self.rollout_config = rollout or RolloutConfig()
        self.algorithm = algo = algorithm or AlgorithmConfig()
        self.validation_config = validation or ValidationConfig()
        self.reward_config = reward_config or RewardConfig()
        self.environment = resolve_environment(environment)
        reward = with_environment_reward(reward, self.environment)
        actor, critic, ref_path = _checked_paths(actor, reward, critic, reference, algo, self.reward_config)
        _check_settings(algo, self.rollout_config, critic=critic, attn_implementation=attn_implementation)
        if tokenizer is not None:
            tokenizer = resolve_model_path(tokenizer, setting="RLHFModule(tokenizer=...)", tokenizer_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or actor)
        ensure_pad_token(self.tokenizer, source=tokenizer or actor)
        self.tokenizer.padding_side = "left"
        self.attn_implementation = attn_implementation
        self.activation_checkpointing = activation_checkpointing
        self.sequence_parallel = check_size(sequence_parallel, setting="RLHFModule(sequence_parallel)")
        frozen = resolve_dtype(frozen_dtype, setting="RLHFModule.frozen_dtype")
        assert frozen is not None
        self.frozen_dtype, self.lora, micro = frozen, lora, algo.batching.micro_batch_size
        lora_of = functools.partial(resolve_lora, lora, setting="RLHFModule(lora=...)")
        self.actor = ActorRole(
            actor,
            tokenizer=self.tokenizer,
            rollout=self.rollout_config,
            algorithm=algo,
            optim=actor_optim or OptimConfig(),
            lora=lora_of(task_type="CAUSAL_LM", model=actor),
            train_vision_tower=train_vision_tower,
        )
        self.actor.environment = environment_factory(self.environment) if self.environment is not None else None
        if self.actor.environment is not None:  # the tools' schemas and the chat template, before any process starts
            episode = self.rollout_config.episode
            check_environment(self.actor.environment, self.tokenizer, episode.tool_parser, episode.agent_loop)
        self.critic: CriticRole | None = None
        if critic is not None:
            critic_lora = lora_of(task_type="TOKEN_CLS", modules_to_save=["score"], model=critic)
            critic_optim = critic_optim or OptimConfig(lr=1e-5)
            self.critic = CriticRole(critic, algorithm=algo, optim=critic_optim, lora=critic_lora)
        self.reference: ReferenceRole | None = None
        if ref_path:
            self.reference = ReferenceRole(
                ref_path,
                temperature=self.rollout_config.temperature,
                micro_batch_size=micro,
                dtype=frozen,
                shared_prefix=algo.batching.shared_prefix,
                # LoRA: the initial policy is the actor's base, adapters off: no second copy of the model.
                adapters_of=self.actor if self.actor.lora is not None and ref_path == actor else None,
            )
        self.reward = RewardRole(
            reward, tokenizer=self.tokenizer, micro_batch_size=micro, config=self.reward_config, dtype=frozen
        )
        self.kl_controller = dataflow_advantages.kl_controller(algo)

    def roles(self) -> dict[str, Role]:
        """The roles present, by attribute name (a subclass may add more, e.g. a cost model beside the reward); each
        role's ``name`` is set to its attribute name: the controller's messages address roles by it."""
        found = {name: child for name, child in self.named_children() if isinstance(child, Role)}
        for name, role in found.items():
            role.name = name
        return found

    ASYNC_ROLLOUTS = False
    """Whether ``training_step`` runs :meth:`rollouts`, so that ``max_staleness >= 1`` makes it asynchronous (as in
    ``GRPOModule``, ``PPOModule``). Read from the class that defines ``training_step``: a new step sets it again."""

    @property
    def rollout_role(self) -> RolloutRole | None:
        """The generation-only role, when the placement gave generation a pool of its own. Runs on: any process."""
        role = self._modules.get("rollout")
        return role if isinstance(role, RolloutRole) else None

    @property
    def asynchronous(self) -> bool:
        """Whether steps generate the next batch while training on the previous one (``max_staleness >= 1`` and a
        rollout pool). Runs on: any process, after the strategy's set-up."""
        return self.algorithm.asynchronous.max_staleness > 0 and self.rollout_role is not None

    def setup(self, stage: str) -> None:
        """Check the batch arithmetic against the world size before any model loads, and give every role's engine
        ``AlgorithmConfig.batching.micro_batch_tokens`` and ``attn_implementation`` (roles a subclass added included).
        Runs on: every process."""
        checkpointed = _checkpointed_roles(getattr(self, "activation_checkpointing", False), self.roles())
        pools = getattr(self.trainer.strategy, "pools", None) or {}
        split_sequences = sequence_parallel_roles(
            getattr(self, "sequence_parallel", 1), self.roles(), pools, world_size=self.trainer.world_size
        )
        for name, role in self.roles().items():
            role.train_engine.micro_batch_tokens = self.algorithm.batching.micro_batch_tokens
            role.train_engine.attn_implementation = getattr(self, "attn_implementation", None)
            role.train_engine.activation_checkpointing = name in checkpointed
            role.train_engine.sequence_parallel = split_sequences.get(name, 1)
        if stage == "fit":
            check_log_interval(self.trainer)
        batch_size = getattr(getattr(self.trainer, "datamodule", None), "batch_size", None)
        if stage == "fit" and batch_size:
            # With rank pools (RLHFStrategy(placement=...)) each pool splits the batch by its own size.
            split = math.lcm(*{len(ranks) for ranks in pools.values()}) if pools else self.trainer.world_size
            self.algorithm.check_batch(prompts=batch_size, n=self.rollout_config.n, world_size=split)

    def holds_role(self, name: str) -> bool:
        """Whether this rank holds role ``name`` (the strategy's placement; every role when it has none). Runs on: any
        process, once attached to a trainer."""
        holds = getattr(getattr(attached_trainer(self), "strategy", None), "holds", None)
        return True if holds is None else bool(holds(name))

    def configure_model(self) -> None:
        """Load the model of every role this rank holds (every role, without a placement); the strategy shards
        them right after. Runs on: every process."""
        for name, role in self.roles().items():
            if self.holds_role(name):
                role.load()

    def configure_optimizers(self) -> Any:
        """One AdamW + schedule per trainable role, in role order (actor, then critic)."""
        total = _run_length(self.trainer.estimated_stepping_batches, self.roles())
        # A role placed on other ranks gets a stand-in over no weights here, so every rank lists the same optimizers
        # in the same order (checkpoints address them by index).
        pairs = [
            role.configure_optimizer(total) if self.holds_role(name) else role.placeholder_optimizer(total)
            for name, role in self.roles().items()
            if role.trainable
        ]
        return [opt for opt, _ in pairs], [{"scheduler": sched, "interval": "step"} for _, sched in pairs]

    concurrently = staticmethod(concurrently)
    in_background = staticmethod(in_background)
    collect = staticmethod(collect)

    def sync_rollout_weights(self, *, lag: int = 0, max_staleness: int = 0) -> dict[str, float]:
        """Hand the actor's weights to the rollout pool (when there is one and the staleness bound asks for it):
        ``actor.send_weights`` and ``rollout.receive_weights`` in one exchange. Samples generated next are trained on
        ``lag`` updates later and may then be ``max_staleness`` updates old at most. Runs on: the controller. Returns
        the hand-off's timings and bytes (nothing without a rollout pool)."""
        rollout = self.rollout_role
        if rollout is None:
            return {}
        with self.concurrently():
            sent = cast(RoleFuture, self.actor.send_weights(lag=lag, max_staleness=max_staleness))
            received = cast(RoleFuture, rollout.receive_weights())
        return sent.result() | received.result()

    def generate_rollout(self, batch: Batch, **kwargs: Any) -> Batch:
        """Sample ``batch`` with the current weights: on the actor's colocated engine, or on the rollout pool after a
        weight hand-off. Takes :meth:`ActorRole.generate`'s arguments. Runs on: the controller."""
        rollout = self.rollout_role
        if rollout is None:
            return self.actor.generate(batch, **kwargs)
        handoff = self.sync_rollout_weights()
        out = rollout.generate(batch, **kwargs)
        out.meta |= {key: handoff[key] for key in _HANDOFF_METRICS if key in handoff}
        return out

    _streamed_steps = 0
    """Streamed rollouts: the steps that admitted prompts to the stream (the first takes none)."""

    _pending_rollout: Batch | None = None
    """Asynchronous mode: the rollout generated during the last step, trained on in the next (in checkpoints)."""

    @contextlib.contextmanager
    def rollouts(self, batch: Batch, metrics: dict[str, float]) -> Iterator[Batch | None]:
        """The rollout this step trains on, as the block's value; the generation's time goes to ``timing_s/gen``.
        Runs on: the controller, around the training part of ``training_step`` (docs/custom-dataflow.md). Synchronous
        (the default): ``batch`` generated now, with the current weights. Asynchronous
        (``AlgorithmConfig.asynchronous.max_staleness >= 1`` and a rollout pool): the block trains on the rollout
        generated during the previous step (None at the first step) while the rollout pool generates ``batch``, kept for
        the next step (the wait for it in ``timing_s/wait_rollout``; docs/placement.md)."""
        if not self.asynchronous:
            with self.timer("gen", metrics):
                rollout = self.generate_rollout(batch)
            yield rollout
            return
        rollout_role = self.rollout_role
        assert rollout_role is not None
        settings = self.algorithm.asynchronous
        if settings.streams:
            self._streamed_steps += 1
            yield streamed_rollout(self, batch, metrics, take=self._streamed_steps > 1)
            return
        metrics |= self.sync_rollout_weights(lag=1, max_staleness=self.algorithm.asynchronous.max_staleness)
        with in_background():
            future = rollout_role.generate(batch)
        yield self._pending_rollout  # kept until trained on: a step that fails here leaves it for a checkpoint
        with self.timer("wait_rollout", metrics):
            self._pending_rollout = cast(RoleFuture, future).result()
        metrics["timing_s/gen"] = cast(RoleFuture, future).seconds

    def training_step(self, batch: Batch) -> None:  # type: ignore[override]
        """The RL dataflow of one step. Runs on: the controller (rank 0). Override it (see ``GRPOModule``)."""
        raise NotImplementedError(
            f"{type(self).__name__}.training_step is not defined. HINT: subclass RLHFModule and write the "
            "dataflow, or use GRPOModule / PPOModule."
        )

    timer = staticmethod(timer)

    def keep_informative_groups(self, batch: Batch, rollout: Batch, metrics: dict[str, float]) -> Batch:
        """DAPO's dynamic sampling: keep the prompts whose samples got different scores; while fewer than the batch's
        prompts are kept, generate and score more prompts (drawn at random from the training set), for at most
        ``AlgorithmConfig.filtering.max_sampling_rounds`` rounds in all. A batch still short after them is filled with
        dropped groups (their advantage is zero) so every later split and mini-batch fits. Runs on: controller.
        ``rollout`` is ``batch`` generated and scored; the result has as many rows. Logs ``dynamic_sampling/rounds``,
        ``/dropped_groups`` (all rounds), ``/filled_groups`` and ``/raw_score/mean`` (the mean score of the step's own
        prompts, before selection: the learning curve)."""
        return keep_informative_groups(
            batch,
            rollout,
            metrics,
            n=self.rollout_config.n,
            max_rounds=self.algorithm.filtering.max_sampling_rounds,
            draw=lambda count, key: extra_prompts(self.trainer.train_dataloader, count, key=key),
            generate=lambda more: self.reward.score(self.generate_rollout(more)),
        )

    def compute_advantages(self, rollout: Batch, metrics: dict[str, float] | None = None) -> Batch:
        """Token rewards (score at the last token, minus the KL penalty if it is in the reward), then the configured
        advantage estimator. Adds ``token_rewards``, ``advantages`` and ``returns``. Optional inputs the estimator may
        use: ``values`` (critic), ``baselines`` (per-sample baseline scores, ReMax). Runs on: controller (pure tensor
        math on the whole batch)."""
        metrics = {} if metrics is None else metrics
        token_rewards, mask = dataflow_advantages.token_rewards(
            rollout,
            metrics,
            algo=self.algorithm,
            max_new_tokens=self.rollout_config.max_new_tokens,
            kl_controller=self.kl_controller,
        )
        advantages, returns = self.estimate_advantages(rollout, token_rewards, mask=mask)
        return rollout.update(Batch({"token_rewards": token_rewards, "advantages": advantages, "returns": returns}))

    def estimate_advantages(
        self,
        rollout: Batch,
        token_rewards: torch.Tensor,
        *,
        values: str = "values",
        baselines: str = "baselines",
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantages, returns)`` ``[B, R]`` of ``token_rewards`` with the configured estimator, reading the critic's
        values and the baselines from the named columns if present. ``mask``: the tokens the estimator runs over
        (default: the sampled ones, :func:`~lightning_rlhf.batch.sampled_mask`); GAE passes over the others (an
        episode's observations) as if they were not there. Runs on: controller."""
        return dataflow_advantages.estimate(
            self.algorithm, rollout, token_rewards, values=values, baselines=baselines, mask=mask
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the controller-side state (the KL coefficient; in asynchronous mode the rollout generated for the next
        step). Runs on: every process."""
        state: dict[str, Any] = {"kl_controller": self.kl_controller.state_dict()}
        pending = self._pending_rollout
        if pending is not None:  # asynchronous mode: the next step trains on it (only the controller holds it)
            state["pending_rollout"] = pack_rollout(pending)
        checkpoint["lightning_rlhf"] = state

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the KL coefficient and the pending asynchronous rollout; and since the restored actor weights
        differ from what the rollout engine holds, hand them over before the next generation. Runs on: every
        process."""
        state = checkpoint.get("lightning_rlhf", {})
        if "kl_controller" in state:
            self.kl_controller.load_state_dict(state["kl_controller"])
        self._pending_rollout = unpack_rollout(state.get("pending_rollout"), asynchronous=self.asynchronous)
        self.actor.mark_weights_changed()
        self.actor.forget_handoffs()

    # The step's metrics and validation (:mod:`lightning_rlhf.dataflow`), as methods a subclass may override.
    rollout_metrics = rollout_metrics
    check_rollout_probs_diff = check_rollout_probs_diff
    validation_rollout = validation_rollout
    validation_metrics = validation_metrics
    _probs_diff_warned = False  # check_rollout_probs_diff warns once per run
    _step_logs: list[tuple[str, float, dict[str, Any]]] | None = None  # the controller's logs of this step

    PROGRESS_BAR_METRICS: tuple[str, ...] = ("critic/score/mean", "response_length/mean", "timing_s/step")
    """What :meth:`log_step` also puts on the progress bar (Lightning's default bar shows them)."""
    last_rollout: Batch | None = None
    """The last logged step's samples (:func:`~.dataflow.metrics.samples_of`; on the controller; None before)."""

    def log_step(self, rollout: Batch | None, metrics: dict[str, float], *, started: float) -> None:
        """Log a step: ``metrics`` plus ``timing_s/step`` (since ``started``, a ``time.perf_counter()``) and
        :func:`~.dataflow.metrics.rollout_metrics` (with the step's timings); :data:`PROGRESS_BAR_METRICS` also go on
        the progress bar. Keeps the step's samples in ``last_rollout`` (for
        :class:`~lightning_rlhf.callbacks.RolloutSamples`). Runs on: controller."""
        metrics["timing_s/step"] = time.perf_counter() - started
        if rollout is not None:  # None: the first asynchronous step, which only generated: its timings alone
            metrics |= self.rollout_metrics(rollout, metrics["timing_s/step"], timings=metrics)
            self.check_rollout_probs_diff(metrics, step=int(rollout.meta.get("step", self.trainer.global_step)))
        self.log_dict({k: metrics.pop(k) for k in self.PROGRESS_BAR_METRICS if k in metrics}, prog_bar=True)
        self.log_dict(metrics)
        if rollout is not None:
            self.last_rollout = samples_of(rollout, step=rollout.meta.get("step", self.trainer.global_step))

    def validation_step(self, batch: Batch, batch_idx: int = 0) -> None:  # type: ignore[override]
        """Generate for a batch of validation prompts with ``validation_config``'s settings, score the samples and
        log :func:`~.dataflow.validation.validation_metrics` (averaged over the validation set, weighted by prompts;
        ``.../failed`` summed), at ``global_step``. Runs on: controller (routed like ``training_step``); its role
        calls run on every rank. It counts no step, draws its own seeds, leaves the weights and the loader alone."""
        metrics = self.validation_metrics(self.validation_rollout(batch, batch_idx))
        for name, value in metrics.items():
            bar = name == "val/score/mean"
            reduce = "sum" if name.endswith("/failed") else "mean"
            self.log(name, value, batch_size=len(batch), on_step=False, on_epoch=True, prog_bar=bar, reduce_fx=reduce)

    @contextlib.contextmanager
    def recording_logs(self) -> Iterator[list[tuple[str, float, dict[str, Any]]]]:
        """Record every ``log`` call made inside the block (the controller's step), for the workers to replay.
        Runs on: controller (the strategy wraps each step it runs in it)."""
        self._step_logs = []
        try:
            yield self._step_logs
        finally:
            self._step_logs = None

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """``LightningModule.log``; on the controller the value is also recorded for the workers. Runs on: every
        process. The strategy replays the controller's logs on the workers at the end of the step, so callbacks
        that monitor a metric see it on every rank."""
        if kwargs.get("batch_size") is None:
            kwargs["batch_size"] = 1
        if self._step_logs is not None:
            value = float(value.detach().float()) if isinstance(value, torch.Tensor) else float(value)
            self._step_logs.append((name, value, {k: v for k, v in kwargs.items() if k in REPLAYED_LOG_ARGS}))
        super().log(name, value, *args, **kwargs)


def _checked_paths(
    actor: str,
    reward: RewardSpec,
    critic: str | None,
    reference: str | bool | None,
    algorithm: AlgorithmConfig,
    reward_config: RewardConfig,
) -> tuple[str, str | None, str | None]:
    """``(actor, critic, reference)`` paths of ``RLHFModule``'s arguments, each checked to be a model folder or hub
    id (the reference: None when there is none). Runs on: every process (the module's constructor)."""
    actor = check_pretrained(actor, setting="RLHFModule(actor=...)")  # a folder or hub id from here on
    for part in reward_components(reward, weights=reward_config.weights, setting="RLHFModule(reward=...)"):
        if isinstance(part.source, str):
            check_pretrained(part.source, setting="RLHFModule(reward=...)")
    if critic is not None:
        critic = check_pretrained(critic, setting="RLHFModule(critic=...)")
    if reference is None:
        reference = algorithm.kl.coef > 0
    ref_path = actor if reference is True else (reference or None)
    if algorithm.kl.coef > 0 and ref_path is None:
        raise ValueError(
            f"AlgorithmConfig.kl.coef={algorithm.kl.coef} needs a reference policy, but "
            "RLHFModule(reference=False). HINT: pass reference=True (the actor's initial weights) or kl.coef=0."
        )
    if ref_path is not None and isinstance(ref_path, str) and ref_path != actor:
        ref_path = check_pretrained(ref_path, setting="RLHFModule(reference=...)")
    return actor, critic, ref_path if isinstance(ref_path, str) else None


def _check_settings(
    algo: AlgorithmConfig, rollout: RolloutConfig, *, critic: str | None, attn_implementation: str | None
) -> None:
    """Refuse settings of ``RLHFModule`` that do not go together. Runs on: every process (the constructor)."""
    if "values" in estimator_inputs(algo.advantage) and critic is None:
        raise ValueError(
            f"AlgorithmConfig.advantage={algo.advantage!r} needs a critic, but RLHFModule(critic=None). "
            "HINT: pass critic=<path> (often the actor's path) or use advantage='grpo'."
        )
    if attn_implementation is not None and (not isinstance(attn_implementation, str) or not attn_implementation):
        raise ValueError(
            f"RLHFModule(attn_implementation={attn_implementation!r}) is invalid: expected None or a transformers "
            "attention name. HINT: 'sdpa' (the default), 'eager' or 'flash_attention_2'."
        )
    if algo.filtering.dynamic_sampling and rollout.n < 2:
        raise ValueError(
            "AlgorithmConfig.filtering.dynamic_sampling=True compares the scores of each prompt's samples, but "
            f"RolloutConfig.n={rollout.n}. HINT: n >= 2 (DAPO uses 16), or dynamic_sampling=False."
        )
    if algo.filtering.overlong_buffer > rollout.max_new_tokens:
        raise ValueError(
            f"AlgorithmConfig.filtering.overlong_buffer={algo.filtering.overlong_buffer} exceeds "
            f"RolloutConfig.max_new_tokens={rollout.max_new_tokens}. HINT: a buffer of about a quarter of "
            "max_new_tokens is usual."
        )


def _run_length(steps: float, roles: Mapping[str, Role]) -> int:
    """The run's RL steps (``Trainer.estimated_stepping_batches``: one batch is one step) for the learning-rate
    schedules; 1 when unknown, which only a constant schedule accepts. Runs on: every process."""
    if math.isfinite(steps):
        return int(steps)
    decaying = [r.name for r in roles.values() if r.optim is not None and r.optim.schedule != "constant"]
    if decaying:
        raise ValueError(
            f"OptimConfig.schedule decays over the run, but the run length is unknown (roles: {decaying}). "
            "HINT: set Trainer(max_steps=...) or max_epochs, or schedule='constant'."
        )
    return 1


def _checkpointed_roles(setting: bool | Sequence[str], roles: Mapping[str, Any]) -> set[str]:
    """The roles whose blocks ``RLHFModule(activation_checkpointing=...)`` checkpoints: True, the trained ones (actor
    and critic); a list, those named. Runs on: every process. Raises ValueError naming an unknown role."""
    if setting is True:
        return {name for name in ("actor", "critic") if name in roles}
    if setting is False or setting is None:
        return set()
    names = [setting] if isinstance(setting, str) else list(setting)
    unknown = sorted(set(names) - set(roles))
    if unknown:
        raise ValueError(
            f"RLHFModule(activation_checkpointing={setting!r}) names {unknown}, not roles of this module "
            f"({sorted(roles)}). HINT: True (the actor and the critic), False, or a list of role names."
        )
    return set(names)
