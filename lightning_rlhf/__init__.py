"""lightning_rlhf: single-controller RLHF (HybridFlow) as a PyTorch Lightning plugin."""

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig, SafetyConfig, VLLMConfig
from lightning_rlhf.data import PromptDataModule
from lightning_rlhf.module import RLHFModule
from lightning_rlhf.modules import (
    DAPOModule,
    DrGRPOModule,
    GRPOModule,
    PPOModule,
    REINFORCEPPModule,
    ReMaxModule,
    RLOOModule,
    SafeRLHFModule,
)
from lightning_rlhf.roles import RewardFunctionError
from lightning_rlhf.strategy import ControllerError, Dispatch, RLHFStrategy, WorkerError, role_method

__version__ = "0.1.0"

__all__ = [
    "AlgorithmConfig",
    "Batch",
    "ControllerError",
    "DAPOModule",
    "Dispatch",
    "DrGRPOModule",
    "GRPOModule",
    "OptimConfig",
    "PPOModule",
    "PromptDataModule",
    "REINFORCEPPModule",
    "RLHFModule",
    "RLHFStrategy",
    "RLOOModule",
    "ReMaxModule",
    "RewardFunctionError",
    "RolloutConfig",
    "SafeRLHFModule",
    "SafetyConfig",
    "VLLMConfig",
    "WorkerError",
    "role_method",
]
