"""What every role has: a name, a transformers model to load and shard, and (if trainable) an optimizer."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_rlhf.config import OptimConfig
from lightning_rlhf.engines.train import clip_grad_norm, shard_model

__all__ = ["Role", "check_pretrained", "disable_dropout", "make_optimizer"]


class Role(nn.Module):
    """Base of the four roles. A role is an ``nn.Module`` so its model's weights live in the LightningModule's
    state (checkpoints) and its methods are declared with :func:`~lightning_rlhf.strategy.dispatch.role_method`.

    Runs on: every process (each holds its shards of the role's model).
    """

    name: str = "role"
    model: nn.Module | None

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.optim: OptimConfig | None = None  # trainable roles set it
        self.sharded = False
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    def load(self) -> None:
        """Load the model (every rank, full weights, before sharding). Roles without a model do nothing."""

    def shard(self, mesh: DeviceMesh, *, param_dtype: torch.dtype | None) -> None:
        """Shard the role's model with FSDP2 over ``mesh``. Runs on: every worker rank, at setup."""
        if self.model is not None and not self.sharded:
            shard_model(self.model, mesh, param_dtype=param_dtype)
            self.sharded = True

    @property
    def trainable(self) -> bool:
        """Whether the role owns an optimizer."""
        return False

    def configure_optimizer(
        self, total_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """Create AdamW and its schedule over this rank's shards (trainable roles, which set ``self.optim``).

        Runs on: every process, in ``configure_optimizers``, after sharding.
        """
        if not self.trainable or self.optim is None or self.model is None:
            raise TypeError(f"{type(self).__name__} is not trainable: it has no optimizer to configure.")
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(params, self.optim, total_steps)
        return self.optimizer, self.scheduler

    def step_optimizer(self) -> tuple[torch.Tensor, bool]:
        """Clip, step and zero the optimizer; skip the step when the norm is not finite.

        Runs on: every worker rank (the norm is a collective). Returns ``(grad_norm, stepped)``.
        """
        assert self.optimizer is not None and self.model is not None and self.optim is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = clip_grad_norm(params, self.optim.grad_clip)
        stepped = bool(torch.isfinite(norm))
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach(), stepped


def check_pretrained(path: str, *, setting: str) -> str:
    """Fail fast, with the setting's name, when ``path`` is neither a local model folder, an embedded model's name
    (``lightning-rlhf/...``) nor a loadable hub id; returns what ``from_pretrained`` should load.

    Same as :func:`lightning_rlhf.models.resolve_model_path` (kept under this name for existing callers).

    Runs on: any process, before models are loaded (reads ``config.json`` only; builds an embedded model once).
    """
    from lightning_rlhf.models import resolve_model_path

    return resolve_model_path(path, setting=setting)


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0: log-probs for the PPO ratio must not depend on dropout noise."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    config: Any = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
        if config is not None and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)


def make_optimizer(
    params: list[nn.Parameter], cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and a per-RL-step schedule (warm-up, then constant / linear / cosine decay).

    Runs on: every process, in ``configure_optimizers`` (after sharding, so ``params`` are the shards).
    """
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        decay = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)
