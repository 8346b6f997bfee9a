"""What every role has: a name, a transformers model run by a training engine, and what it needs from the strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_rlhf.agents.rollout import EpisodeRunner, episode_prompt_ids
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import OptimConfig, RolloutConfig
from lightning_rlhf.config.models import resolve_model_path
from lightning_rlhf.controller.dispatch import Dispatch, role_method
from lightning_rlhf.data.vision import ChatImages
from lightning_rlhf.engines.hybrid import HybridEngine
from lightning_rlhf.engines.train import TrainEngine, make_optimizer

__all__ = ["Role", "RolloutEngineRequest", "check_pretrained", "disable_dropout", "load_model", "make_optimizer"]


@dataclass(frozen=True)
class RolloutEngineRequest:
    """What a role that generates declares, for the strategy to build its rollout engine from."""

    path: str
    """The model's folder or hub id (vLLM loads its configuration and, unless told otherwise, its weights)."""
    tokenizer: Any
    """Its tokenizer (pad and EOS ids)."""
    rollout: RolloutConfig
    """The sampling settings."""


class EpisodesMixin:
    """A generating role: ``generate`` runs on its :class:`~lightning_rlhf.engines.hybrid.HybridEngine`, with an
    ``environment`` (set by the module) as multi-turn episodes (:mod:`lightning_rlhf.agents`)."""

    hybrid: HybridEngine
    environment: Any = None
    """A zero-argument callable making one environment per episode (None: single-turn rollouts)."""
    _episodes: EpisodeRunner | None = None
    path: str
    tokenizer: Any
    rollout: RolloutConfig

    @property
    def episode_runner(self) -> EpisodeRunner | None:
        """The runner of the environment's episodes, made on first use and kept with its tool workers; None without
        an environment. Runs on: the worker ranks that generate."""
        if self.environment is None:
            return None
        if self._episodes is None:
            self._episodes = EpisodeRunner(self.environment, self.tokenizer, self.rollout, model_name=self.path)
        return self._episodes

    @role_method(Dispatch.DP_SPLIT)
    def generate(
        self,
        batch: Batch,
        *,
        n: int | None = None,
        greedy: bool = False,
        temperature: float | None = None,
        seed_offset: int = 0,
    ) -> Batch:
        """Sample ``n`` (default ``rollout.n``) responses per prompt; ``greedy``: one deterministic response per
        prompt (e.g. ReMax's baseline). ``temperature`` overrides the rollout's (validation; 0 decodes greedily);
        ``seed_offset`` moves the sampling seeds off the training stream's. ``log_prob`` and ``update`` score at
        ``RolloutConfig.temperature`` (1 when it is 0), whatever was sampled here.

        Runs on: every worker rank, on its share of the prompts (``prompts``/``prompt_mask``, left-padded, and
        ``uid``); one row per sample out, with ``responses``, ``response_mask``, ``response_truncated`` (no stop token
        within ``max_new_tokens``) and the input columns repeated. A generation-only pool samples with the weights it
        last received, each sample's ``weight_version`` recording them.
        """
        return self.hybrid.generate(
            batch,
            episodes=self.episode_runner,
            n=n,
            greedy=greedy,
            temperature=temperature,
            seed_offset=seed_offset,
        )

    def episode_prompt_ids(
        self, tokenizer: Any, rows: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[tuple[list[int], str]]:
        """Each row's first episode prompt as the rollout renders it, and its prompt text (see
        :func:`lightning_rlhf.agents.rollout.episode_prompt_ids`): what ``PromptDataModule`` bounds by
        ``max_prompt_length``. Runs on: every process, in the data module's ``setup``, before any model loads."""
        images = ChatImages(tokenizer, getattr(self, "path", None))  # its processor loads at the first image, if any
        return episode_prompt_ids(
            self.environment, tokenizer, rows, chat_template_kwargs=chat_template_kwargs, images=images
        )

    def close(self) -> None:
        """End the environment's tool workers (idempotent; a later fit starts them again). Runs on: every rank, at
        teardown."""
        if self._episodes is not None:
            self._episodes.close()
            self._episodes = None


class Role(nn.Module):
    """Base of the roles. A role is an ``nn.Module`` so its model's weights live in the LightningModule's state
    (checkpoints); its methods are declared with :func:`~controller.dispatch.role_method`; its model runs in
    a :class:`~lightning_rlhf.engines.train.TrainEngine` (sharding, loading, micro-batches, optimizer).

    A role declares what it needs and the strategy provides it, without knowing the role by name:
    ``needs_rollout_engine`` (the strategy attaches one), ``trainable`` (``optim`` given: an optimizer, from
    ``configure_optimizers``) and ``dtype`` (float32 master weights for trainable roles; a frozen role may be held
    in bfloat16). ``setting`` names the role's model in errors (``"ActorRole(path=...)"``); ``lora`` (a
    ``peft.LoraConfig``) trains LoRA adapters on its frozen model.

    Runs on: every process (each holds its shards of the role's model).
    """

    name: str = "role"
    model: nn.Module | None
    needs_rollout_engine: bool = False
    """Whether the strategy must attach a rollout engine at set-up (built from :meth:`rollout_engine_request`)."""

    def __init__(
        self,
        *,
        micro_batch_size: int = 1,
        optim: OptimConfig | None = None,
        dtype: torch.dtype = torch.float32,
        setting: str = "role",
        lora: Any = None,
    ) -> None:
        super().__init__()
        if lora is not None and optim is None:
            raise ValueError(
                f"{setting}: lora={lora!r} on a role that is not trained (optim=None): its adapters would never move. "
                "HINT: LoRA applies to the trained roles (RLHFModule(lora=...) adapts the actor and the critic); "
                "give this role an optimizer, or no lora."
            )
        self.model = None
        self.dtype = dtype
        self.lora = lora
        """The role's ``peft.LoraConfig`` (trained roles: adapters instead of every weight), or None."""
        self.train_engine = TrainEngine(micro_batch_size=micro_batch_size, optim=optim, setting=setting)

    # ------------------------------------------------------------------------------------------ model
    def load(self) -> None:
        """Load the model (none: nothing); inside the strategy's set-up on the meta device until :meth:`materialize`.
        Runs on: every process."""

    def set_model(self, model: nn.Module | None) -> None:
        """Install ``model`` as the role's model (a submodule, for checkpoints) and its engine's."""
        self.model = model
        self.train_engine.bind(model)

    def shard(self, mesh: DeviceMesh, *, param_dtype: torch.dtype | None) -> None:
        """Shard the role's model with FSDP2 over ``mesh``. Runs on: every worker rank, at set-up."""
        self.train_engine.shard(mesh, param_dtype=param_dtype)

    def materialize(self, device: torch.device) -> None:
        """Give the (sharded) model its weights on ``device``. Runs on: every worker rank, after :meth:`shard`."""
        self.train_engine.materialize(device)

    @property
    def balances_ranks(self) -> bool:
        """Whether the controller splits this role's ``DP_SPLIT`` rollout batches over ranks by tokens instead of in
        contiguous chunks (read by :func:`~controller.dispatch.role_method`): when its engine has a token budget
        (``AlgorithmConfig.batching.micro_batch_tokens``)."""
        return self.train_engine.balances_ranks

    @property
    def sequence_parallel(self) -> int:
        """Ranks that share each sequence in this role's forwards (read by the controller for the methods declared
        ``sequence_parallel=True``)."""
        return self.train_engine.sequence_parallel

    @property
    def sequence_group(self) -> Any:
        """This rank's sequence-parallel group (None: none). Runs on: worker."""
        return self.train_engine.sequence_group

    @property
    def sharded(self) -> bool:
        """Whether the model is already sharded (a second ``fit`` on the same module reuses the shards)."""
        return self.train_engine.sharded

    def borrows_model(self) -> Role | None:
        """The role whose model this one computes with instead of a model of its own (LoRA's reference: the actor's,
        adapters off), or None."""
        return None

    def hold_own_model(self) -> None:
        """Load a model of its own instead of borrowing one: the placement put the role on ranks other than the
        lender's, where the lender's shards are not. Runs on: every process, at set-up, before any model loads."""
        raise TypeError(f"{type(self).__name__} borrows no model.")

    def rollout_engine_request(self) -> RolloutEngineRequest | None:
        """What the strategy builds this role's rollout engine from (None: it needs none). Runs on: every process,
        at set-up (before the models load, to check the settings, and after)."""
        return None

    def attach_engine(self, engine: Any) -> None:
        """Receive the rollout engine built from :meth:`rollout_engine_request`. Runs on: every worker rank."""
        raise TypeError(f"{type(self).__name__} has no use for a rollout engine.")

    def close(self) -> None:
        """Release what the role started (worker processes, engines). Runs on: every process, at teardown."""

    # -------------------------------------------------------------------------------------- optimizer
    @property
    def optim(self) -> OptimConfig | None:
        """The optimizer settings (None: frozen role)."""
        return self.train_engine.optim

    @property
    def trainable(self) -> bool:
        """Whether the role owns an optimizer."""
        return self.train_engine.optim is not None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The role's optimizer over its shards (after ``configure_optimizers``)."""
        return self.train_engine.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The role's learning-rate schedule (after ``configure_optimizers``)."""
        return self.train_engine.scheduler

    def configure_optimizer(
        self, total_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """Create AdamW and its schedule over this rank's shards (trainable roles).
        Runs on: every process, in ``configure_optimizers``, after sharding."""
        if not self.trainable or self.model is None:
            raise TypeError(f"{type(self).__name__} is not trainable: it has no optimizer to configure.")
        return self.train_engine.configure_optimizer(total_steps)

    def placeholder_optimizer(
        self, total_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The stand-in a rank outside this role's pool lists in the role's place (the role's optimizer over one
        empty tensor), so every rank has the same optimizers in the same order; never stepped, checkpoints skip it.

        Runs on: every process that does not hold the role, in ``configure_optimizers``.
        """
        if self.optim is None:
            raise TypeError(f"{type(self).__name__} is not trainable: it has no optimizer to stand in for.")
        optimizer, scheduler = make_optimizer([nn.Parameter(torch.empty(0))], self.optim, total_steps)
        optimizer.lightning_rlhf_placeholder = True  # type: ignore[attr-defined]
        return optimizer, scheduler


def load_model(
    auto_class: type, path: str, *, setting: str, dtype: torch.dtype, lora: Any = None, **kwargs: Any
) -> nn.Module:
    """Load a transformers model for a role, with dropout off (on the meta device inside the strategy's deferred
    loading) and, with ``lora``, wrapped with its adapters.

    Runs on: every process. Fails before building when the checkpoint misses a tensor the model needs.
    """
    from lightning_rlhf.engines.train.loading import load_pretrained
    from lightning_rlhf.engines.train.lora import apply_lora

    model = load_pretrained(
        auto_class, resolve_model_path(path, setting=setting), setting=setting, dtype=dtype, **kwargs
    )
    disable_dropout(model)
    if lora is not None:
        model = apply_lora(model, lora, setting="RLHFModule(lora=...)")
    return model


check_pretrained = resolve_model_path
"""Fail fast, naming ``setting``, when ``path`` is no model folder, embedded name or hub id; else what
``from_pretrained`` should load (:func:`lightning_rlhf.config.models.resolve_model_path`, under its older name)."""


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0: log-probs for the PPO ratio must not depend on dropout noise."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    config: Any = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
        if config is not None and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
