"""Ready algorithm modules: each is an RLHFModule whose ``training_step`` is the algorithm's dataflow."""

from lightning_rlhf.modules.grpo import GRPOModule
from lightning_rlhf.modules.ppo import PPOModule
from lightning_rlhf.modules.remax import ReMaxModule
from lightning_rlhf.modules.variants import DrGRPOModule, REINFORCEPPModule, RLOOModule

__all__ = ["DrGRPOModule", "GRPOModule", "PPOModule", "REINFORCEPPModule", "RLOOModule", "ReMaxModule"]
