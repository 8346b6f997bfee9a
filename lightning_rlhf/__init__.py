"""lightning_rlhf: single-controller RLHF (HybridFlow) as a PyTorch Lightning plugin."""

from lightning_rlhf.batch import Batch
from lightning_rlhf.callbacks import ExportActor, MetricPlots, RLHFProgressBar, RolloutSamples, RunSummary
from lightning_rlhf.config import (
    AlgorithmConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    SafetyConfig,
    ValidationConfig,
    VLLMConfig,
)
from lightning_rlhf.data import PromptDataModule, SFTDataModule
from lightning_rlhf.demo.warmstart import DEMO_MODELS
from lightning_rlhf.models import register_embedded_model
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
    SFTModule,
)
from lightning_rlhf.roles import RewardFunctionError
from lightning_rlhf.strategy import ControllerError, Dispatch, RLHFStrategy, WorkerError, role_method

__version__ = "0.1.0"

# The embedded models are the demo's (the top layer builds them); `models` (a leaf) serves them by name. Every
# process that imports any part of the package runs this first, so `resolve_model_path` always knows them.
for _name, (_build, _description) in DEMO_MODELS.items():
    register_embedded_model(_name, _build, _description)
del _name, _build, _description

__all__ = [
    "AlgorithmConfig",
    "Batch",
    "ControllerError",
    "DAPOModule",
    "Dispatch",
    "DrGRPOModule",
    "ExportActor",
    "GRPOModule",
    "MetricPlots",
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
