"""Ready algorithm modules: each is an RLHFModule whose ``training_step`` is the algorithm's dataflow
(``SFTModule``: supervised fine-tuning, the warm start before RL); its own default ``algorithm`` (and ``rollout``)
applies when the argument is missing or None (the command line passes unset ones as None)."""

from lightning_rlhf.modules.distill import OnPolicyDistillationModule
from lightning_rlhf.modules.grpo import GRPOModule
from lightning_rlhf.modules.ppo import PPOModule
from lightning_rlhf.modules.remax import ReMaxModule
from lightning_rlhf.modules.safe_rlhf import SafeRLHFModule
from lightning_rlhf.modules.sft import SFTModule
from lightning_rlhf.modules.variants import DAPOModule, DrGRPOModule, REINFORCEPPModule, RLOOModule

__all__ = [
    "DAPOModule",
    "DrGRPOModule",
    "GRPOModule",
    "OnPolicyDistillationModule",
    "PPOModule",
    "REINFORCEPPModule",
    "RLOOModule",
    "ReMaxModule",
    "SFTModule",
    "SafeRLHFModule",
]
