"""Pure tensor functions for RLHF algorithms: advantages, KL estimators, losses, helpers.

Runs on: controller or worker (pure functions, no config objects, no host syncs).
"""

from lightning_rlhf.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
    gae_advantages,
    grpo_advantages,
)
from lightning_rlhf.algorithms.functional import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    scores_to_token_rewards,
)
from lightning_rlhf.algorithms.kl import KL_ESTIMATORS, KLEstimator, kl_k1, kl_k2, kl_k3, kl_penalty
from lightning_rlhf.algorithms.losses import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregate_loss,
    policy_loss_clipped,
    seq_mean_token_mean,
    seq_mean_token_sum,
    token_mean,
    value_loss_clipped,
)
from lightning_rlhf.algorithms.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "AdvantageEstimator",
    "KLEstimator",
    "LossAggregation",
    "Registry",
    "aggregate_loss",
    "compute_advantages",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss_clipped",
    "scores_to_token_rewards",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "token_mean",
    "value_loss_clipped",
]
