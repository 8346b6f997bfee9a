"""Ready algorithm modules: each is an RLHFModule whose ``training_step`` is the algorithm's dataflow."""

from lightning_rlhf.modules.grpo import GRPOModule
from lightning_rlhf.modules.ppo import PPOModule

__all__ = ["GRPOModule", "PPOModule"]
