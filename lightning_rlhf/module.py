"""``RLHFModule``: a LightningModule with four roles whose ``training_step`` is the RL dataflow.

Subclass it and write ``training_step`` as one sequential program over role calls (it runs on the controller,
rank 0), or use a ready module (``GRPOModule``, ``PPOModule``). Run it with ``Trainer(strategy=RLHFStrategy())``.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import time
from collections.abc import Iterator, Mapping
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

import lightning_rlhf.perf as perf
from lightning_rlhf.agents.env import environment_factory, resolve_environment, with_environment_reward
from lightning_rlhf.agents.rollout import check_environment, episode_metrics
from lightning_rlhf.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    compute_advantages,
    estimator_inputs,
    informative_groups,
    kl_penalty,
    masked_mean,
    mean_at_n,
    overlong_reward_penalty,
    pass_at_k,
    scores_to_token_rewards,
)
from lightning_rlhf.batch import Batch, sampled_mask
from lightning_rlhf.compat.lightning import attached_trainer, batches_that_stepped, set_batches_that_stepped
from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RewardConfig, RolloutConfig, ValidationConfig
from lightning_rlhf.config.models import ensure_pad_token, resolve_model_path
from lightning_rlhf.controller.dispatch import RoleFuture, concurrently, in_background
from lightning_rlhf.engines.train import resolve_dtype
from lightning_rlhf.engines.train.lora import resolve_lora
from lightning_rlhf.rewards import RewardSpec, reward_components
from lightning_rlhf.roles import ActorRole, CriticRole, ReferenceRole, RewardRole, Role, RolloutRole
from lightning_rlhf.roles.actor import rollout_probs_diff
from lightning_rlhf.roles.base import check_pretrained

__all__ = ["RLHFModule"]


class RLHFModule(L.LightningModule):
    """Four roles (actor, critic, reference, reward) and the helpers an RL dataflow needs.

    Runs on: every process. ``training_step`` runs on the controller only; role methods called from it run on
    every rank.

    Args:
        actor: local folder or hub id of the policy (a transformers causal LM).
        reward: a function ``fn(prompts, completions, **dataset_columns) -> list[float]``, the path of a
            sequence-classification reward model, or ``{name: function or model path}`` (any number of
            functions, at most one model) combined with ``reward_config.weights``; see docs/rewards.md.
        critic: path of the value model's initial weights (usually the actor's); None: no critic.
        reference: path of the frozen reference policy; ``True`` uses the actor's path; ``False``: none;
            ``None`` (default): the actor's path when ``algorithm.kl_coef > 0``, else none.
        tokenizer: tokenizer path; defaults to the actor's.
        rollout: sampling settings.
        algorithm: RL math and batch splitting.
        actor_optim: optimizer of the actor.
        critic_optim: optimizer of the critic.
        reward_config: how reward functions are called (in reward worker processes, with a timeout, fallback
            score, batches) and the weights of named rewards.
        validation: how the validation loop generates (samples per prompt, greedy or a temperature) and its
            pass@k settings; it runs when the datamodule has validation prompts.
        frozen_dtype: the dtype the frozen models (reference, reward model) are held and computed in:
            ``"float32"`` or ``"bfloat16"`` (half their memory; the trainable roles keep float32 master weights
            and compute in ``RLHFStrategy(param_dtype=...)``).
        attn_implementation: the attention kernel of every role's training forwards and of the transformers
            rollout engine (transformers' ``attn_implementation``): None keeps the models' default (``"sdpa"``);
            ``"flash_attention_2"`` on GPUs with flash-attn; ``"eager"`` is faster on CPUs for short sequences
            (see docs/performance.md).
        environment: multi-turn episodes instead of one response per prompt (docs/agents.md): an
            :class:`~lightning_rlhf.agents.Environment` class (one instance per episode), a factory, a
            ``ToolEnvironment(tools=[...])``, a TRL-style ``environment_factory`` class, or its import path
            (``"my_module.MyEnv"``, for recipes); or several of those by name (``{"name": ..., ...}``), each
            dataset row's ``environment`` column choosing its own. When it scores episodes (``reward(episode)``),
            its score is the reward component ``environment``, beside ``reward`` if given (``reward`` may then be
            None).
        lora: train LoRA adapters instead of every weight (docs/lora.md): a ``peft.LoraConfig`` or its fields as a
            dict (``{"r": 16, "lora_alpha": 32}``; ``target_modules`` defaults to ``"all-linear"``). It applies to
            the actor and the critic (whose value head is trained whole); with ``reference=True`` the reference is
            the actor's base model with its adapters disabled, not a second copy.
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
    ) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        self.automatic_optimization = False  # the roles step their own optimizers, several times per step
        self.rollout_config = rollout or RolloutConfig()
        self.algorithm = algorithm or AlgorithmConfig()
        self.validation_config = validation or ValidationConfig()
        actor = check_pretrained(actor, setting="RLHFModule(actor=...)")  # a folder or hub id from here on
        self.reward_config = reward_config or RewardConfig()
        self.environment = resolve_environment(environment)
        reward = with_environment_reward(reward, self.environment)
        for part in reward_components(reward, weights=self.reward_config.weights, setting="RLHFModule(reward=...)"):
            if isinstance(part.source, str):
                check_pretrained(part.source, setting="RLHFModule(reward=...)")
        if critic is not None:
            critic = check_pretrained(critic, setting="RLHFModule(critic=...)")
        if reference is None:
            reference = self.algorithm.kl_coef > 0
        ref_path = actor if reference is True else (reference or None)
        if self.algorithm.kl_coef > 0 and ref_path is None:
            raise ValueError(
                f"AlgorithmConfig.kl_coef={self.algorithm.kl_coef} needs a reference policy, but "
                "RLHFModule(reference=False). HINT: pass reference=True (the actor's initial weights) or kl_coef=0."
            )
        if "values" in estimator_inputs(self.algorithm.advantage) and critic is None:
            raise ValueError(
                f"AlgorithmConfig.advantage={self.algorithm.advantage!r} needs a critic, but RLHFModule(critic=None). "
                "HINT: pass critic=<path> (often the actor's path) or use advantage='grpo'."
            )
        if ref_path is not None and isinstance(ref_path, str) and ref_path != actor:
            ref_path = check_pretrained(ref_path, setting="RLHFModule(reference=...)")
        if tokenizer is not None:
            tokenizer = resolve_model_path(tokenizer, setting="RLHFModule(tokenizer=...)", tokenizer_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or actor)
        ensure_pad_token(self.tokenizer, source=tokenizer or actor)
        self.tokenizer.padding_side = "left"

        if attn_implementation is not None and (not isinstance(attn_implementation, str) or not attn_implementation):
            raise ValueError(
                f"RLHFModule(attn_implementation={attn_implementation!r}) is invalid: expected None or a transformers "
                "attention name. HINT: 'sdpa' (the default), 'eager' or 'flash_attention_2'."
            )
        self.attn_implementation = attn_implementation
        micro = self.algorithm.micro_batch_size
        frozen = resolve_dtype(frozen_dtype, setting="RLHFModule.frozen_dtype")
        assert frozen is not None
        self.frozen_dtype = frozen
        self.lora = lora
        self.actor = ActorRole(
            actor,
            tokenizer=self.tokenizer,
            rollout=self.rollout_config,
            algorithm=self.algorithm,
            optim=actor_optim or OptimConfig(),
            lora=resolve_lora(lora, setting="RLHFModule(lora=...)", task_type="CAUSAL_LM", model=actor),
        )
        self.actor.environment = environment_factory(self.environment) if self.environment is not None else None
        if self.actor.environment is not None:  # the tools' schemas and the chat template, before any process starts
            check_environment(self.actor.environment, self.tokenizer, self.rollout_config.tool_parser)
        self.critic: CriticRole | None = (
            CriticRole(
                critic,
                algorithm=self.algorithm,
                optim=critic_optim or OptimConfig(lr=1e-5),
                lora=resolve_lora(
                    lora,
                    setting="RLHFModule(lora=...)",
                    task_type="TOKEN_CLS",
                    modules_to_save=["score"],
                    model=critic,
                ),
            )
            if critic is not None
            else None
        )
        self.reference: ReferenceRole | None = (
            ReferenceRole(
                ref_path,
                temperature=self.rollout_config.temperature,
                micro_batch_size=micro,
                dtype=frozen,
                shared_prefix=self.algorithm.shared_prefix,
                # LoRA: the initial policy is the actor's base, adapters off: no second copy of the model.
                adapters_of=self.actor if self.actor.lora is not None and ref_path == actor else None,
            )
            if ref_path
            else None
        )
        self.reward = RewardRole(
            reward, tokenizer=self.tokenizer, micro_batch_size=micro, config=self.reward_config, dtype=frozen
        )
        self._step_logs: list[tuple[str, float, dict[str, Any]]] | None = None
        algo = self.algorithm
        self.kl_controller: AdaptiveKLController | FixedKLController = (
            AdaptiveKLController(init_kl_coef=algo.kl_coef, target_kl=algo.kl_target, horizon=algo.kl_horizon)
            if algo.kl_target is not None
            else FixedKLController(kl_coef=algo.kl_coef)
        )
        if algo.dynamic_sampling and self.rollout_config.n < 2:
            raise ValueError(
                "AlgorithmConfig.dynamic_sampling=True compares the scores of each prompt's samples, but "
                f"RolloutConfig.n={self.rollout_config.n}. HINT: n >= 2 (DAPO uses 16), or dynamic_sampling=False."
            )
        if algo.overlong_buffer > self.rollout_config.max_new_tokens:
            raise ValueError(
                f"AlgorithmConfig.overlong_buffer={algo.overlong_buffer} exceeds RolloutConfig.max_new_tokens="
                f"{self.rollout_config.max_new_tokens}. HINT: a buffer of about a quarter of max_new_tokens is usual."
            )

    # ------------------------------------------------------------------------------------ the roles
    def roles(self) -> dict[str, Role]:
        """The roles present, by attribute name (a subclass may add more, e.g. a cost model beside the reward).

        Each role's ``name`` is set to its attribute name: the controller's messages address roles by it.
        """
        found = {name: child for name, child in self.named_children() if isinstance(child, Role)}
        for name, role in found.items():
            role.name = name
        return found

    def get_role(self, name: str) -> Role:
        """The role called ``name`` (the controller's messages name roles)."""
        return self.roles()[name]

    ASYNC_ROLLOUTS = False
    """Whether ``training_step`` runs :meth:`rollouts`, so that ``AlgorithmConfig.max_staleness >= 1`` makes it
    asynchronous (``GRPOModule`` and ``PPOModule`` do). Read from the class that defines ``training_step``: a
    subclass that writes its own step sets it again."""

    def prepare_roles(self, placed: list[str]) -> None:
        """Add the roles a placement asks for by name: ``rollout`` gets a generation-only
        :class:`~lightning_rlhf.roles.RolloutRole` (the actor then builds no engine of its own).

        Runs on: every process, in the strategy's set-up, before the placement is resolved.
        """
        change = self._rollout_pool_change(placed)
        if change == "add":
            self.rollout = RolloutRole(self.actor.path, tokenizer=self.tokenizer, rollout=self.rollout_config)
            self.rollout.environment = self.actor.environment
            self.actor.needs_rollout_engine = False
        elif change == "remove":  # a later fit() without the pool
            del self._modules["rollout"]
            self.actor.needs_rollout_engine = True

    def placed_role_names(self, placed: list[str]) -> list[str]:
        """The role names :meth:`prepare_roles` leaves for a placement naming ``placed``, without changing the module
        (the launcher checks a placement with them before it starts any process). Runs on: the launching process."""
        names = list(self.roles())
        change = self._rollout_pool_change(placed)
        if change == "add":
            names.append("rollout")
        elif change == "remove":
            names.remove("rollout")
        return names

    def weight_sources(self, names: list[str]) -> dict[str, str]:
        """Which of the roles ``names`` (:meth:`placed_role_names`) take their weights from another role over
        collectives: receiver -> source (a generation-only pool's ``weights_from``). Runs on: any process."""
        roles = self.roles()
        found = ((name, getattr(roles.get(name, RolloutRole), "weights_from", None)) for name in names)
        return {name: source for name, source in found if source is not None}

    def engine_roles(self, names: list[str]) -> list[str]:
        """Which of the roles ``names`` (:meth:`placed_role_names`) build a colocated rollout engine: the
        generation-only pool when the placement has one, else the roles that need an engine (the actor; also when
        the placement drops a pool the module had, as generation then goes back to it). Runs on: any process."""
        if "rollout" in names:
            return ["rollout"]
        roles = self.roles()
        return [
            n for n in names if n in roles and (roles[n].needs_rollout_engine or (n == "actor" and "rollout" in roles))
        ]

    def _rollout_pool_change(self, placed: list[str]) -> str | None:
        """``"add"`` when a placement naming ``placed`` gives generation a pool the module has no role for yet,
        ``"remove"`` when the module has that role and the placement no longer names it, else None."""
        if "rollout" in placed and self.rollout_role is None and self.actor.needs_rollout_engine:
            return "add"
        if "rollout" not in placed and self.rollout_role is not None:
            return "remove"
        return None

    @property
    def rollout_role(self) -> RolloutRole | None:
        """The generation-only role, when the placement gave generation a pool of its own. Runs on: any process."""
        role = self._modules.get("rollout")
        return role if isinstance(role, RolloutRole) else None

    @property
    def asynchronous(self) -> bool:
        """Whether steps generate the next batch while training on the previous one (``max_staleness >= 1`` and a
        rollout pool). Runs on: any process, after the strategy's set-up."""
        return self.algorithm.max_staleness > 0 and self.rollout_role is not None

    def setup(self, stage: str) -> None:
        """Check the batch arithmetic against the world size before any model loads, and give every role's engine
        ``AlgorithmConfig.micro_batch_tokens`` and ``attn_implementation`` (roles a subclass added included).
        Runs on: every process."""
        for role in self.roles().values():
            role.train_engine.micro_batch_tokens = self.algorithm.micro_batch_tokens
            role.train_engine.attn_implementation = getattr(self, "attn_implementation", None)
        if stage == "fit":
            self.check_asynchronous(rollout_pool=self.rollout_role is not None)
            every, steps = getattr(self.trainer, "log_every_n_steps", 1), self.trainer.max_steps  # set by Lightning
            if 0 < steps < every:
                rank_zero_warn(
                    f"Trainer(max_steps={steps}, log_every_n_steps={every}): the loggers record every {every}th step, "
                    "so no step of this run reaches them (an RL step takes seconds to minutes; Lightning's default "
                    "suits steps of milliseconds). HINT: Trainer(log_every_n_steps=1), as the CLI and recipes set it.",
                    category=UserWarning,
                )
        batch_size = getattr(getattr(self.trainer, "datamodule", None), "batch_size", None)
        if stage == "fit" and batch_size:
            # With rank pools (RLHFStrategy(placement=...)) each pool splits the batch by its own size.
            pools = getattr(self.trainer.strategy, "pools", None) or {}
            split = math.lcm(*{len(ranks) for ranks in pools.values()}) if pools else self.trainer.world_size
            self.algorithm.check_batch(prompts=batch_size, n=self.rollout_config.n, world_size=split)

    def check_asynchronous(self, *, rollout_pool: bool) -> None:
        """Refuse ``AlgorithmConfig.max_staleness >= 1`` without a rollout pool (``rollout_pool``: whether the
        placement gives generation ranks of its own) or with a ``training_step`` that does not run :meth:`rollouts`.

        Runs on: the launching process (before any rank starts) and every process at set-up, for a fit.
        """
        if not self.algorithm.max_staleness:
            return
        if not rollout_pool:
            raise ValueError(
                f"AlgorithmConfig.max_staleness={self.algorithm.max_staleness} generates on a rollout pool while "
                "the actor trains, but the placement gives generation no pool of its own. HINT: "
                "RLHFStrategy(placement={'actor': [0], ..., 'rollout': [1]}), or max_staleness=0."
            )
        owner = next(k for k in type(self).__mro__ if "training_step" in vars(k))
        if not vars(owner).get("ASYNC_ROLLOUTS", False):
            raise ValueError(
                f"AlgorithmConfig.max_staleness={self.algorithm.max_staleness}: "
                f"{type(self).__name__}.training_step does not run `self.rollouts(batch, metrics)`, so it cannot "
                "overlap generation with training. "
                "HINT: max_staleness=0, GRPOModule or PPOModule, or write the step with `rollouts` and set "
                "ASYNC_ROLLOUTS = True."
            )

    def holds_role(self, name: str) -> bool:
        """Whether this rank holds role ``name`` (the strategy's placement; every role when it has none).

        Runs on: any process, once attached to a trainer."""
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
        total = self.trainer.estimated_stepping_batches  # = RL steps (one batch is one step)
        if not math.isfinite(total):
            decaying = [r.name for r in self.roles().values() if r.optim is not None and r.optim.schedule != "constant"]
            if decaying:
                raise ValueError(
                    f"OptimConfig.schedule decays over the run, but the run length is unknown (roles: {decaying}). "
                    "HINT: set Trainer(max_steps=...) or max_epochs, or schedule='constant'."
                )
            total = 1
        # A role placed on other ranks gets a stand-in over no weights here, so every rank lists the same optimizers
        # in the same order (checkpoints address them by index).
        pairs = [
            role.configure_optimizer(int(total)) if self.holds_role(name) else role.placeholder_optimizer(int(total))
            for name, role in self.roles().items()
            if role.trainable
        ]
        return [opt for opt, _ in pairs], [{"scheduler": sched, "interval": "step"} for _, sched in pairs]

    @staticmethod
    def concurrently() -> contextlib.AbstractContextManager[None]:
        """Make the role calls inside the block together (:func:`controller.dispatch.concurrently`): each call
        returns a :class:`~controller.dispatch.RoleFuture`, and calls to roles on disjoint rank pools run at the
        same time. Runs on: the controller, inside ``training_step``."""
        return concurrently()

    @staticmethod
    def in_background() -> contextlib.AbstractContextManager[None]:
        """Start the role calls inside the block and go on (:func:`controller.dispatch.in_background`): each
        returns a :class:`~controller.dispatch.RoleFuture` whose ``result()`` waits for it, later in the same
        step. Runs on: the controller, inside ``training_step``."""
        return in_background()

    @staticmethod
    def collect(
        rollout: Batch, futures: Mapping[str, Any], metrics: dict[str, float]
    ) -> tuple[Batch, dict[str, float]]:
        """The results of a ``concurrently()`` block: batches merged into ``rollout`` (their new columns), dicts of
        metrics merged into one, and each call's time on its slowest rank logged as ``timing_s/<name>``.

        Runs on: the controller, after the block. ``None`` entries (a call not made) are skipped. (Role methods are
        typed by what they return outside a block; inside one they return :class:`RoleFuture`.)
        """
        merged: dict[str, float] = {}
        for name, future in futures.items():
            if future is None:
                continue
            if not isinstance(future, RoleFuture):
                raise TypeError(
                    f"RLHFModule.collect: {name!r} is a `{type(future).__name__}`, not the future of a call made "
                    "inside `with self.concurrently():`. HINT: make the call inside the block, or merge its result "
                    "yourself."
                )
            value = future.result()
            if isinstance(value, Batch):
                rollout = rollout.update(value)
            elif isinstance(value, Mapping):
                merged |= value
            metrics[f"timing_s/{name}"] = future.seconds
        return rollout, merged

    # ------------------------------------------------------------------------------ generation
    def sync_rollout_weights(self, *, lag: int = 0, max_staleness: int = 0) -> dict[str, float]:
        """Hand the actor's weights to the rollout pool (when there is one and the staleness bound asks for it):
        ``actor.send_weights`` and ``rollout.receive_weights`` in one exchange. Samples generated next are trained
        on ``lag`` updates later and may then be ``max_staleness`` updates old at most.

        Runs on: the controller. Returns the hand-off's timings and bytes (nothing without a rollout pool).
        """
        rollout = self.rollout_role
        if rollout is None:
            return {}
        with self.concurrently():
            sent = cast(RoleFuture, self.actor.send_weights(lag=lag, max_staleness=max_staleness))
            received = cast(RoleFuture, rollout.receive_weights())
        return sent.result() | received.result()

    def generate_rollout(self, batch: Batch, **kwargs: Any) -> Batch:
        """Sample ``batch`` with the current weights: on the actor's colocated engine, or on the rollout pool after
        a weight hand-off. Takes :meth:`ActorRole.generate`'s arguments.

        Runs on: the controller.
        """
        rollout = self.rollout_role
        if rollout is None:
            return self.actor.generate(batch, **kwargs)
        handoff = self.sync_rollout_weights()
        out = rollout.generate(batch, **kwargs)
        out.meta["timing_s/update_weights"] = handoff["timing_s/update_weights"]
        out.meta["perf/weight_sync_bytes"] = handoff["perf/weight_sync_bytes"]
        out.meta["perf/weight_sync_gathered_bytes"] = handoff["perf/weight_sync_gathered_bytes"]
        return out

    _pending_rollout: Batch | None = None
    """Asynchronous mode: the rollout generated during the last step, trained on in the next (in checkpoints)."""

    @contextlib.contextmanager
    def rollouts(self, batch: Batch, metrics: dict[str, float]) -> Iterator[Batch | None]:
        """The rollout this step trains on, as the block's value; the generation's time goes to ``timing_s/gen``.

        Runs on: the controller, around the training part of ``training_step``::

            with self.rollouts(batch, metrics) as rollout:
                if rollout is not None:  # None: the first asynchronous step has nothing to train on yet
                    ...  # score, advantages, updates
            self.log_step(rollout, metrics, started=t0)

        Synchronous (the default): ``batch`` generated now, with the current weights. Asynchronous
        (``AlgorithmConfig.max_staleness >= 1`` and a rollout pool): the weights go to the rollout pool, which
        starts generating ``batch`` in the background; the block trains on the rollout generated during the previous
        step (None at the first step); at the block's end the controller waits for ``batch``'s rollout (its time in
        ``timing_s/wait_rollout``) and keeps it for the next step. Samples are thus trained on one update after the
        weights that generated them (``training/staleness_max``), and the loss corrects for it
        (``AlgorithmConfig.rollout_is``). The last step's rollout is generated and not trained on.
        """
        if not self.asynchronous:
            with self.timer("gen", metrics):
                rollout = self.generate_rollout(batch)
            yield rollout
            return
        rollout_role = self.rollout_role
        assert rollout_role is not None
        metrics |= self.sync_rollout_weights(lag=1, max_staleness=self.algorithm.max_staleness)
        with in_background():
            future = rollout_role.generate(batch)
        yield self._pending_rollout  # kept until trained on: a step that fails here leaves it for a checkpoint
        with self.timer("wait_rollout", metrics):
            self._pending_rollout = cast(RoleFuture, future).result()
        metrics["timing_s/gen"] = cast(RoleFuture, future).seconds

    # ------------------------------------------------------------------------------ step helpers
    def training_step(self, batch: Batch) -> None:  # type: ignore[override]
        """The RL dataflow of one step. Runs on: the controller (rank 0). Override it (see ``GRPOModule``)."""
        raise NotImplementedError(
            f"{type(self).__name__}.training_step is not defined. HINT: subclass RLHFModule and write the "
            "dataflow, or use GRPOModule / PPOModule."
        )

    @contextlib.contextmanager
    def timer(self, name: str, metrics: dict[str, float]) -> Iterator[None]:
        """Time a block into ``metrics["timing_s/<name>"]``. Runs on: controller."""
        t0 = time.perf_counter()
        yield
        metrics[f"timing_s/{name}"] = time.perf_counter() - t0

    def keep_informative_groups(self, batch: Batch, rollout: Batch, metrics: dict[str, float]) -> Batch:
        """DAPO's dynamic sampling: keep the prompts whose samples got different scores; while fewer than the
        batch's prompts are kept, generate and score more prompts (drawn at random from the training set), for
        at most ``AlgorithmConfig.max_sampling_rounds`` rounds in all. A batch still short after them is
        filled with dropped groups (their advantage is zero) so every later split and mini-batch fits.

        Runs on: controller. ``rollout`` is ``batch`` generated and scored; the result has as many rows.
        Logs ``dynamic_sampling/rounds``, ``/dropped_groups`` (all rounds), ``/filled_groups`` and
        ``/raw_score/mean`` (the mean score of the step's own prompts, before selection: the learning curve).
        """
        want, n = len(batch), self.rollout_config.n
        kept: list[Batch] = []  # per round: the rows of its informative groups (n consecutive rows a group)
        dropped: list[Batch] = []
        num_kept = num_dropped = rounds = 0
        first_meta = rollout.meta
        metrics["dynamic_sampling/raw_score/mean"] = float(rollout["scores"].float().mean())  # before selection
        while True:
            groups, informative = informative_groups(rollout["scores"], rollout["uid"])
            keep_rows = torch.isin(rollout["uid"], groups[informative])
            kept.append(rollout.select(torch.nonzero(keep_rows)[:, 0]))
            dropped.append(rollout.select(torch.nonzero(~keep_rows)[:, 0]))
            num_kept += int(informative.sum())
            num_dropped += len(groups) - int(informative.sum())
            rounds += 1
            if num_kept >= want or rounds >= self.algorithm.max_sampling_rounds:
                break
            more = self._extra_prompts(want, key=int(batch.meta.get("step", 0)) * 1_000 + rounds)
            more.meta = {**batch.meta, "sampling_round": rounds}
            rollout = self.reward.score(self.generate_rollout(more))
        filled = max(0, want - num_kept)
        out = Batch.cat(kept).select(slice(0, (want - filled) * n))  # the first `want` informative groups
        if filled:  # still short: the first dropped groups make up the batch
            out = Batch.cat([out, Batch.cat(dropped).select(slice(0, filled * n))])
        out.meta = dict(first_meta)  # the weight hand-off happened in the first round
        out["uid"] = torch.arange(want).repeat_interleave(n)  # groups of different rounds share uids
        metrics["dynamic_sampling/rounds"] = rounds
        metrics["dynamic_sampling/dropped_groups"] = num_dropped
        metrics["dynamic_sampling/filled_groups"] = filled
        return out

    def _extra_prompts(self, count: int, *, key: int) -> Batch:
        loader = self.trainer.train_dataloader
        sample = getattr(loader, "sample", None)
        if sample is None:
            raise TypeError(
                f"AlgorithmConfig.dynamic_sampling=True draws extra prompts from the training loader, but it is a "
                f"{type(loader).__name__} without `sample(count, key=...)`. HINT: use lightning_rlhf's "
                "PromptDataModule, or set dynamic_sampling=False."
            )
        return cast(Batch, sample(count, key=key))

    def compute_advantages(self, rollout: Batch, metrics: dict[str, float] | None = None) -> Batch:
        """Token rewards (score at the last token, minus the KL penalty if it is in the reward), then the
        configured advantage estimator. Adds ``token_rewards``, ``advantages`` and ``returns``. Optional inputs
        the estimator may use: ``values`` (critic), ``baselines`` (per-sample baseline scores, ReMax).

        Runs on: controller (pure tensor math on the whole batch).
        """
        algo = self.algorithm
        metrics = {} if metrics is None else metrics
        mask = sampled_mask(rollout)
        scores = rollout["scores"].float()
        if algo.overlong_buffer:
            penalty = overlong_reward_penalty(
                mask.sum(-1),
                max_len=self.rollout_config.max_new_tokens,
                buffer=algo.overlong_buffer,
                penalty=algo.overlong_penalty,
            )
            scores = scores + penalty
            metrics["critic/overlong_penalty/mean"] = float(penalty.mean())
        token_rewards = scores_to_token_rewards(scores, mask)
        if algo.kl_in_reward and algo.kl_coef > 0:
            kl = kl_penalty(rollout["old_logprobs"], rollout["ref_logprobs"], estimator=algo.kl_estimator)
            coef = self.kl_controller.value
            token_rewards = token_rewards - coef * kl * mask
            metrics["actor/reward_kl_penalty"] = current_kl = float(masked_mean(kl, mask))
            metrics["actor/reward_kl_coef"] = coef
            self.kl_controller.update(current_kl, n_steps=len(rollout))
        if algo.mask_truncated:
            rollout["loss_mask"] = mask * (~rollout["response_truncated"]).to(mask.dtype)[:, None]
        advantages, returns = self.estimate_advantages(rollout, token_rewards, mask=mask)
        rollout["token_rewards"] = token_rewards
        rollout["advantages"] = advantages
        rollout["returns"] = returns
        return rollout

    def estimate_advantages(
        self,
        rollout: Batch,
        token_rewards: torch.Tensor,
        *,
        values: str = "values",
        baselines: str = "baselines",
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantages, returns)`` ``[B, R]`` of ``token_rewards`` with the configured estimator, reading the
        critic's values and the baselines from the named columns if present. ``mask``: the tokens the estimator
        runs over (default: the sampled ones, :func:`~lightning_rlhf.batch.sampled_mask`); GAE passes over the
        others (an episode's observations) as if they were not there.

        Runs on: controller.
        """
        algo = self.algorithm
        if mask is None:
            mask = sampled_mask(rollout)
        return compute_advantages(
            algo.advantage,
            token_rewards=token_rewards,
            response_mask=mask,
            values=rollout.tensors.get(values),
            group_ids=rollout["uid"],
            baselines=rollout.tensors.get(baselines),
            gamma=algo.gamma,
            lam=algo.lam,
            norm_by_std=algo.norm_adv_by_std,
            eps=algo.adv_eps,
        )

    def rollout_metrics(
        self, rollout: Batch, step_seconds: float | None = None, *, timings: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """The standard per-step metrics of a scored rollout (names as in verl). With ``timings`` (the step's
        ``timing_s/*``, as :meth:`log_step` passes them) also the performance metrics of
        :func:`lightning_rlhf.perf.step_perf_metrics`: ``timing_per_token_ms/*``, ``perf/mfu/actor`` (and
        ``perf/mfu/critic``), every rank's memory peaks (``perf/cpu_memory_peak_gb``, CUDA:
        ``perf/max_memory_allocated_gb``) and ``perf/cpu_memory_used_gb``.

        Runs on: controller.
        """
        mask = rollout["response_mask"].float()
        lengths = mask.sum(-1)
        scores = rollout["scores"].float()
        out = {
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float(rollout["response_truncated"].float().mean()),
        }
        if "advantages" in rollout:
            out["critic/advantages/mean"] = float(masked_mean(rollout["advantages"], rollout["response_mask"]))
        if "returns" in rollout:
            out["critic/returns/mean"] = float(masked_mean(rollout["returns"], rollout["response_mask"]))
        if "values" in rollout:
            out["critic/values/mean"] = float(masked_mean(rollout["values"], rollout["response_mask"]))
        for role in self.roles().values():  # each reward's components: reward/<name>/mean, reward/<name>/failed
            if isinstance(role, RewardRole):
                out |= role.metrics(rollout)
        if step_seconds:
            tokens = float(rollout["prompt_mask"].sum() + mask.sum())
            out["perf/throughput"] = tokens / step_seconds / max(1, self.trainer.world_size)
        handoff = ("timing_s/update_weights", "timing_s/update_weights_wait", "perf/weight_sync_bytes")
        for key in (*handoff, "perf/weight_sync_gathered_bytes", "perf/weight_verify_s"):
            if key in rollout.meta:
                out[key] = float(rollout.meta[key])
        if "rollout_logprobs" in rollout and "old_logprobs" in rollout:  # the on-policy update reports its own
            diff = rollout_probs_diff(rollout["old_logprobs"], rollout["rollout_logprobs"], sampled_mask(rollout))
            out |= {f"training/{k}": float(v) for k, v in diff.items()}
        out |= episode_metrics(rollout)
        if timings is not None:  # parameter counts: DTensor numel is the full tensor's, so no collective
            trainer = attached_trainer(self)
            strategy = getattr(trainer, "strategy", None)
            critics = [r.model for r in self.roles().values() if isinstance(r, CriticRole) and r.trainable]
            out |= perf.step_perf_metrics(
                prompt_tokens=float(rollout["prompt_mask"].sum()),
                response_tokens=float(mask.sum()),
                timings=timings,
                params={
                    "actor": perf.trainable_parameters(self.actor.model) if "timing_s/update_actor" in timings else 0,
                    "critic": sum(perf.trainable_parameters(m) for m in critics)
                    if "timing_s/update_critic" in timings
                    else 0,
                },
                epochs=self.algorithm.ppo_epochs,
                device=getattr(strategy, "root_device", None) or torch.device("cpu"),
                dtype=getattr(strategy, "param_dtype", None) or torch.float32,
                world_size=trainer.world_size if trainer is not None else 1,
                rank_peaks=getattr(strategy, "memory_peaks", None),
            )
        return out

    _probs_diff_warned = False

    def check_rollout_probs_diff(self, metrics: dict[str, float], *, step: int) -> None:
        """Warn, once per run, the first time ``training/rollout_probs_diff_max`` exceeds
        ``RolloutConfig.max_probs_diff``: the engine then sampled from another distribution than the one the
        trainer scores, and the warning names the likely causes, this run's own settings first.

        Runs on: controller (from :meth:`log_step`; a custom dataflow logging by hand may call it).
        """
        bound = self.rollout_config.max_probs_diff
        value = metrics.get("training/rollout_probs_diff_max")
        if bound is None or value is None or self._probs_diff_warned or not value > bound:
            return
        if metrics.get("training/staleness_max", 0.0) > 0:  # asynchronous: older weights sampled, by design
            return
        self._probs_diff_warned = True
        cfg = self.rollout_config
        causes = []
        if cfg.temperature > 0 and (cfg.top_p < 1 or cfg.top_k > 0):
            causes.append(
                f"top-k/top-p truncation: the engine samples from a truncated distribution (RolloutConfig.top_p="
                f"{cfg.top_p}, top_k={cfg.top_k}) while the loss scores the full one; set top_p=1.0, top_k=0"
            )
        dtype = getattr(getattr(attached_trainer(self), "strategy", None), "param_dtype", None)
        if dtype is not None and dtype != torch.float32:
            causes.append(
                f"low precision: the engine and the trainer compute in {dtype} with different kernels (in float32 "
                "the gap stays below 1e-5); raise RolloutConfig.max_probs_diff if this level is expected"
            )
        causes += [
            "stale engine weights: a weight hand-off that failed or was skipped, so the engine sampled with older "
            "weights than the trainer's (a custom role or engine that does not call actor.mark_weights_changed() "
            "after changing the weights)",
            "another temperature: the rollout was generated at a temperature other than RolloutConfig.temperature="
            f"{cfg.temperature} (actor.generate(temperature=...) in a custom dataflow)",
        ]
        listed = "; ".join(f"({i}) {c}" for i, c in enumerate(causes, 1))
        logs = [
            f", {k}={metrics[k]:.3g}"
            for k in ("training/rollout_logprob_diff_max", "training/rollout_kl")
            if k in metrics
        ]
        rank_zero_warn(
            f"Step {step}: training/rollout_probs_diff_max={value:.3g}{''.join(logs)} exceeds "
            f"RolloutConfig.max_probs_diff={bound}: "
            "the rollout engine sampled from another distribution than the one the trainer scores, so the update "
            f"is off-policy by that much. Likely causes: {listed}. HINT: fix the cause, or raise max_probs_diff "
            "(None: no warning). This warning is shown once per run; the metric is logged every step.",
            category=UserWarning,
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the controller-side state (the KL coefficient; in asynchronous mode the rollout generated for the next
        step). Runs on: every process."""
        state: dict[str, Any] = {"kl_controller": self.kl_controller.state_dict()}
        pending = self._pending_rollout
        if pending is not None:  # asynchronous mode: the next step trains on it (only the controller holds it)
            # Dataset columns may hold any picklable value; checkpoints are read with weights_only=True, which
            # takes tensors: the columns and meta travel pickled in a byte tensor.
            rest = bytearray(pickle.dumps((pending.columns, pending.meta)))
            state["pending_rollout"] = {"tensors": pending.tensors, "rest": torch.frombuffer(rest, dtype=torch.uint8)}
        checkpoint["lightning_rlhf"] = state

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the KL coefficient and the pending asynchronous rollout; and since the restored actor weights
        differ from what the rollout engine holds, hand them over before the next generation. Runs on: every
        process."""
        state = checkpoint.get("lightning_rlhf", {})
        if "kl_controller" in state:
            self.kl_controller.load_state_dict(state["kl_controller"])
        pending = state.get("pending_rollout")
        self._pending_rollout = None
        if pending is not None and self.asynchronous:
            columns, meta = pickle.loads(pending["rest"].numpy().tobytes())
            self._pending_rollout = Batch(pending["tensors"], columns, meta)
        elif pending is not None:
            rank_zero_warn(
                "The checkpoint holds a rollout generated for its next step (an asynchronous run), and this run is "
                "synchronous: that rollout is dropped and each step generates its own batch."
            )
        self.actor.mark_weights_changed()
        self.actor.forget_handoffs()

    @property
    def needs_rollout_engine(self) -> bool:
        """Whether any role needs a rollout engine (``SFTModule``'s actor, which never generates, does not)."""
        return any(role.needs_rollout_engine for role in self.roles().values())

    PROGRESS_BAR_METRICS: tuple[str, ...] = ("critic/score/mean", "response_length/mean", "timing_s/step")
    """What :meth:`log_step` also puts on the progress bar (Lightning's default bar shows them)."""
    last_rollout: Batch | None = None
    """The last logged step's ``prompt``, ``completion`` and ``scores``, and for episodes ``episode`` (the
    messages), ``turns`` and ``tool_calls`` (set on the controller; None before)."""

    def log_step(self, rollout: Batch | None, metrics: dict[str, float], *, started: float) -> None:
        """Log a step: ``metrics`` plus ``timing_s/step`` (since ``started``, a ``time.perf_counter()``) and
        :meth:`rollout_metrics` (given the step's timings, so with ``perf/mfu/*``, ``timing_per_token_ms/*`` and
        the memory figures); the mean reward, mean response length and seconds per step also go on the
        progress bar. Keeps the step's prompts, completions and scores in ``last_rollout`` (for
        :class:`~lightning_rlhf.callbacks.RolloutSamples`). ``rollout=None`` (an asynchronous run's first step,
        which trains on nothing) logs the timings only. Runs on: controller."""
        metrics["timing_s/step"] = time.perf_counter() - started
        if rollout is not None:  # None: the first asynchronous step, which only generated
            metrics |= self.rollout_metrics(rollout, metrics["timing_s/step"], timings=metrics)
            self.check_rollout_probs_diff(metrics, step=int(rollout.meta.get("step", self.trainer.global_step)))
        self.log_dict({k: metrics.pop(k) for k in self.PROGRESS_BAR_METRICS if k in metrics}, prog_bar=True)
        self.log_dict(metrics)
        if rollout is None:
            return
        episodes = ("turns", "tool_calls") if "episode" in rollout else ()  # multi-turn: the whole conversations
        self.last_rollout = Batch(
            {"scores": rollout["scores"].detach().float().cpu()} | {k: rollout[k].cpu() for k in episodes},
            {k: rollout[k] for k in ("prompt", "completion", "episode") if k in rollout},
            {"step": rollout.meta.get("step", self.trainer.global_step)},
        )

    # -------------------------------------------------------------------------------- validation
    _logger_step: int | None = None
    """The loggers' step counter while a validation runs (:meth:`on_validation_start` moves it)."""

    def on_validation_start(self) -> None:
        """Make the loggers place this validation's metrics at ``global_step``, the step of the weights it
        measures (0 before training, N after N RL steps); :meth:`on_validation_end` puts the counter back.

        Lightning logs an epoch's metrics at its batch counter, which between two steps is one behind
        ``global_step``. Logging a metric named ``step`` would move them too, but it would also reach
        ``trainer.callback_metrics``, where ``ModelCheckpoint`` takes it for the step in its file names (a
        checkpoint saved after step 150 named ``step=100`` after the validation at 100). A subclass that
        overrides this hook calls ``super().on_validation_start()``.

        Runs on: every process.
        """
        trainer = self.trainer
        self._logger_step = batches_that_stepped(trainer)
        set_batches_that_stepped(trainer, trainer.global_step)

    def on_validation_end(self) -> None:
        """Give the loggers back the step counter :meth:`on_validation_start` moved. Runs on: every process."""
        if self._logger_step is not None:
            set_batches_that_stepped(self.trainer, self._logger_step)
            self._logger_step = None

    def validation_step(self, batch: Batch, batch_idx: int = 0) -> None:  # type: ignore[override]
        """Generate for a batch of validation prompts with ``validation_config``'s settings, score the samples and
        log :meth:`validation_metrics`: Lightning averages them over the validation set, weighted by prompts, and
        sums the ``.../failed`` counts; loggers place them at ``global_step`` (see :meth:`on_validation_start`).

        Runs on: controller (the strategy routes it like ``training_step``); its role calls run on every rank.
        It counts no step, draws its own sampling seeds and leaves the weights and the training loader alone.
        """
        metrics = self.validation_metrics(self.validation_rollout(batch, batch_idx))
        for name, value in metrics.items():
            bar = name == "val/score/mean"
            reduce = "sum" if name.endswith("/failed") else "mean"
            self.log(name, value, batch_size=len(batch), on_step=False, on_epoch=True, prog_bar=bar, reduce_fx=reduce)

    def validation_rollout(self, batch: Batch, batch_idx: int = 0) -> Batch:
        """The validation prompts generated (``ValidationConfig.n`` samples each, or one greedy answer) and
        scored: ``len(batch) * n`` rows, prompt-major.

        Runs on: controller. A batch whose prompts do not split evenly over the ranks (the last one) is padded
        with copies of its first prompt for the role calls; their samples are dropped before returning.
        """
        cfg, size = self.validation_config, len(batch)
        pad = -size % self.trainer.world_size
        if pad:
            batch = batch.select(torch.cat([torch.arange(size), torch.zeros(pad, dtype=torch.long)]))
        rollout = self.generate_rollout(  # temperature 0: greedy, the same path as RolloutConfig.temperature=0
            batch,
            n=cfg.n,
            temperature=cfg.temperature,
            seed_offset=(batch_idx + 1) * 15_485_863,  # not the training stream's seeds at this step
        )
        rollout = self.reward.score(rollout)
        return rollout.select(torch.arange(size * cfg.n)) if pad else rollout

    def validation_metrics(self, rollout: Batch) -> dict[str, float]:
        """``val/score/mean`` (over samples), ``val/mean@N`` (mean over prompts of each prompt's mean score over
        its N samples), ``val/pass@k`` for each k (unbiased estimator; a sample passes when its score is above
        ``ValidationConfig.pass_threshold``) and ``val/response_length/mean``, of one validation rollout; and,
        as training logs them, each reward component's ``val/reward/<name>/mean`` (before its weight, so a
        weight-0 component is measured too) and ``val/reward/<name>/failed``.

        Runs on: controller. ``rollout`` holds N = ``ValidationConfig.n`` consecutive samples per prompt.
        """
        cfg = self.validation_config
        scores = rollout["scores"].float().view(-1, cfg.n)  # [P, N]
        out = {"val/score/mean": float(scores.mean()), f"val/mean@{cfg.n}": float(mean_at_n(scores).mean())}
        passed = scores > cfg.pass_threshold
        out |= {f"val/pass@{k}": float(pass_at_k(passed, k=k).mean()) for k in cfg.ks}
        out["val/response_length/mean"] = float(rollout["response_mask"].float().sum(-1).mean())
        for role in self.roles().values():  # the components of the roles that scored it (the columns present)
            if isinstance(role, RewardRole):
                out |= {f"val/{k}": v for k, v in role.metrics(rollout).items()}
        return out

    # ----------------------------------------------------------------------------------- logging
    @contextlib.contextmanager
    def recording_logs(self) -> Iterator[list[tuple[str, float, dict[str, Any]]]]:
        """Record every ``log`` call made inside the block (the controller's step), for the workers to replay.

        Runs on: controller (the strategy wraps each step it runs in it).
        """
        self._step_logs = []
        try:
            yield self._step_logs
        finally:
            self._step_logs = None

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """``LightningModule.log``; on the controller the value is also recorded for the workers.

        Runs on: every process. The strategy replays the controller's logs on the workers at the end of the
        step, so callbacks that monitor a metric see it on every rank.
        """
        if kwargs.get("batch_size") is None:
            kwargs["batch_size"] = 1
        if self._step_logs is not None:
            value = float(value.detach().float()) if isinstance(value, torch.Tensor) else float(value)
            keep = {
                k: v
                for k, v in kwargs.items()
                if k in ("prog_bar", "logger", "on_step", "on_epoch", "batch_size", "reduce_fx")
            }
            self._step_logs.append((name, value, keep))
        super().log(name, value, *args, **kwargs)
