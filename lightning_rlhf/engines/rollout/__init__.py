"""Rollout engines: generate responses from prompts, and take new weights after each actor update."""

from lightning_rlhf.engines.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from lightning_rlhf.engines.rollout.hf import HFRolloutEngine

__all__ = ["HFRolloutEngine", "RolloutEngine", "RolloutOutput", "SamplingParams"]
