"""A callback the CLI tests add by import path (``--trainer.callbacks+=tests.scripts.param_dump.ParamDump``): at
the end of ``fit`` rank 0 saves the actor's full parameters, as the run holds them, with ``torch.save``."""

from __future__ import annotations

import lightning as L
import torch
from torch.distributed.tensor import DTensor


class ParamDump(L.Callback):
    """Gather the actor's parameters (a collective on every rank) and save them on rank 0 to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = {}
        for name, param in pl_module.actor.model.named_parameters():  # type: ignore[union-attr]
            full = param.full_tensor() if isinstance(param, DTensor) else param
            state[name] = full.detach().cpu().clone()
        if trainer.is_global_zero:
            torch.save(state, self.path)
