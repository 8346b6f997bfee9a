"""Rollout engines: generate responses from prompts, and take new weights after each actor update."""

from lightning_rlhf.engines.rollout.base import (
    EngineAbilities,
    HandoffCheck,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    WeightSyncError,
    tied_aliases,
)
from lightning_rlhf.engines.rollout.factory import RolloutEngineFactory, make_rollout_engine
from lightning_rlhf.engines.rollout.hf import HFRolloutEngine

__all__ = [
    "EngineAbilities",
    "HFRolloutEngine",
    "HandoffCheck",
    "RolloutEngine",
    "RolloutEngineFactory",
    "RolloutOutput",
    "SamplingParams",
    "WeightSyncError",
    "make_rollout_engine",
    "tied_aliases",
]
