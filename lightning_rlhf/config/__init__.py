"""Settings, as frozen keyword-only dataclasses validated when they are made (:mod:`.settings`), and model settings
resolved to what ``from_pretrained`` loads (:mod:`.models`, standard library only, imported on its own)."""

from lightning_rlhf.config.settings import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    AlgorithmConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    SafetyConfig,
    ValidationConfig,
    VLLMConfig,
    check_sampling,
    check_sequence_length,
    config_from_dict,
)

__all__ = [
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "AlgorithmConfig",
    "OptimConfig",
    "RewardConfig",
    "RolloutConfig",
    "SafetyConfig",
    "VLLMConfig",
    "ValidationConfig",
    "check_sampling",
    "check_sequence_length",
    "config_from_dict",
]
