"""Controller-side reward shaping: DAPO's overlong penalty and filtering, adaptive KL penalty in the reward."""

from __future__ import annotations

import pytest
import torch

from lightning_rlhf import AlgorithmConfig, FilteringConfig, GRPOModule, KLConfig, PPOModule, RolloutConfig
from lightning_rlhf.algorithms import overlong_reward_penalty
from lightning_rlhf.batch import Batch
from lightning_rlhf.demo import addition_reward


def test_overlong_penalty_by_hand() -> None:
    # max_len 8, buffer 4: free up to 4 tokens, then -1/4 per token, -1 at 8.
    got = overlong_reward_penalty(torch.tensor([2, 4, 5, 7, 8]), max_len=8, buffer=4, penalty=1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0]
    with pytest.raises(ValueError, match="overlong buffer must be in"):
        overlong_reward_penalty(torch.tensor([1]), max_len=8, buffer=9)


def rollout() -> Batch:
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    return Batch(
        {
            "response_mask": mask,
            "response_truncated": torch.tensor([True, False, False, False]),
            "scores": torch.tensor([1.0, 0.0, 1.0, 0.0]),
            "uid": torch.tensor([0, 0, 1, 1]),
            "old_logprobs": torch.full((4, 4), -1.0),
            "ref_logprobs": torch.full((4, 4), -1.5),
        }
    )


def test_overlong_shaping_and_filtering(tiny_model: str) -> None:
    algo = AlgorithmConfig(
        advantage="grpo", filtering=FilteringConfig(overlong_buffer=2, overlong_penalty=0.5, mask_truncated=True)
    )
    module = GRPOModule(tiny_model, reward=addition_reward, rollout=RolloutConfig(max_new_tokens=4), algorithm=algo)
    metrics: dict[str, float] = {}
    out = module.compute_advantages(rollout(), metrics)
    # Lengths 4, 2, 3, 1 with max 4 and buffer 2: penalties -0.5, 0, -0.25, 0 on the last token's reward.
    assert out["token_rewards"].sum(-1).tolist() == [0.5, 0.0, 0.75, 0.0]
    assert metrics["critic/overlong_penalty/mean"] == pytest.approx(-0.1875)
    assert out["loss_mask"].tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"overlong_buffer=8 exceeds RolloutConfig\.max_new_tokens=4"):
        GRPOModule(
            tiny_model,
            reward=addition_reward,
            rollout=RolloutConfig(max_new_tokens=4),
            algorithm=AlgorithmConfig(filtering=FilteringConfig(overlong_buffer=8)),
        )


def test_adaptive_kl_penalty_moves_and_is_checkpointed(tiny_model: str) -> None:
    algo = AlgorithmConfig(
        advantage="gae", kl=KLConfig(coef=0.1, in_reward=True, estimator="k1", target=0.1, horizon=40)
    )
    module = PPOModule(tiny_model, reward=addition_reward, critic=tiny_model, algorithm=algo)
    batch = rollout()
    batch["values"] = torch.zeros(4, 4)
    metrics: dict[str, float] = {}
    out = module.compute_advantages(batch, metrics)
    # k1 = old - ref = 0.5 per token, coefficient 0.1: each token's reward drops by 0.05.
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert metrics["actor/reward_kl_coef"] == pytest.approx(0.1)
    assert out["token_rewards"][1].tolist() == pytest.approx([-0.05, -0.05, 0.0, 0.0])
    # KL 0.5 is 5x the target: error clipped to 0.2; coef *= 1 + 0.2 * 4 / 40.
    assert module.kl_controller.value == pytest.approx(0.1 * 1.02)
    ckpt: dict = {}
    module.on_save_checkpoint(ckpt)
    fresh = PPOModule(tiny_model, reward=addition_reward, critic=tiny_model, algorithm=algo)
    fresh.on_load_checkpoint(ckpt)
    assert fresh.kl_controller.value == pytest.approx(0.102)


def test_adaptive_kl_needs_a_reward_penalty() -> None:
    with pytest.raises(ValueError, match=r"KLConfig.target=0\.1 is invalid: expected a KL > 0, with in_reward=True"):
        AlgorithmConfig(kl=KLConfig(coef=0.1, target=0.1))  # KL as a loss: nothing to adapt
