"""lightning_rlhf: single-controller RLHF (HybridFlow) as a PyTorch Lightning plugin.

The public names below load on first use (PEP 562): ``from lightning_rlhf import GRPOModule`` imports what it needs,
while a reward or tool worker that imports a plain function from the package (``lightning_rlhf.demo.calculator``)
does not pay for Lightning, torch and transformers (about 7 s of CPU per process on these machines)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_rlhf.compat.torchvision import install_import_hook
from lightning_rlhf.lazy import lazy_exports

install_import_hook()  # torchvision (the vision path) imports beside PyTorch's CPU build

if TYPE_CHECKING:
    from lightning_rlhf.batch import Batch
    from lightning_rlhf.callbacks import ExportActor, MetricPlots, RLHFProgressBar, RolloutSamples, RunSummary
    from lightning_rlhf.config import (
        AlgorithmConfig,
        AsyncConfig,
        BatchingConfig,
        EpisodeConfig,
        FilteringConfig,
        KLConfig,
        LossConfig,
        OptimConfig,
        RewardConfig,
        RolloutConfig,
        SafetyConfig,
        ValidationConfig,
        VLLMConfig,
    )
    from lightning_rlhf.data import PromptDataModule, SFTDataModule
    from lightning_rlhf.module import RLHFModule
    from lightning_rlhf.modules import (
        DAPOModule,
        DrGRPOModule,
        GRPOModule,
        OnPolicyDistillationModule,
        PPOModule,
        REINFORCEPPModule,
        ReMaxModule,
        RLOOModule,
        SafeRLHFModule,
        SFTModule,
    )
    from lightning_rlhf.roles import RewardFunctionError
    from lightning_rlhf.strategy import ControllerError, Dispatch, RLHFStrategy, WorkerError, role_method

__version__ = "0.1.0"

__all__ = [
    "AlgorithmConfig",
    "AsyncConfig",
    "Batch",
    "BatchingConfig",
    "ControllerError",
    "DAPOModule",
    "Dispatch",
    "DrGRPOModule",
    "EpisodeConfig",
    "ExportActor",
    "FilteringConfig",
    "GRPOModule",
    "KLConfig",
    "LossConfig",
    "MetricPlots",
    "OnPolicyDistillationModule",
    "OptimConfig",
    "PPOModule",
    "PromptDataModule",
    "REINFORCEPPModule",
    "RLHFModule",
    "RLHFProgressBar",
    "RLHFStrategy",
    "RLOOModule",
    "ReMaxModule",
    "RewardConfig",
    "RewardFunctionError",
    "RolloutConfig",
    "RolloutSamples",
    "RunSummary",
    "SFTDataModule",
    "SFTModule",
    "SafeRLHFModule",
    "SafetyConfig",
    "VLLMConfig",
    "ValidationConfig",
    "WorkerError",
    "role_method",
]

__getattr__, __dir__ = lazy_exports(__name__, __file__)
