"""Settings validation: bad values fail with the field, the value and the fix, before anything loads."""

from __future__ import annotations

import pytest

from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig, config_from_dict


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (RolloutConfig, {"n": 0}, r"RolloutConfig.n=0 is invalid"),
        (RolloutConfig, {"temperature": 1e-3}, r"RolloutConfig.temperature=0.001 is below 0.01"),
        (RolloutConfig, {"top_p": 1.5}, r"top_p=1.5"),
        (RolloutConfig, {"max_new_tokens": 8, "min_new_tokens": 9}, r"min_new_tokens=9 is invalid: .*\[0, max_new_"),
        (RolloutConfig, {"decode": "fast"}, r"RolloutConfig.decode='fast' is invalid: .*HINT: 'auto' uses"),
        (AlgorithmConfig, {"adv_eps": 0.0}, r"AlgorithmConfig.adv_eps=0.0 is invalid"),
        (OptimConfig, {"lr": 0}, r"OptimConfig.lr=0"),
        (OptimConfig, {"schedule": "step"}, r"schedule='step'"),
        (
            AlgorithmConfig,
            {"advantage": "grpoo"},
            r"advantage='grpoo' is invalid: expected one of \['gae', 'grpo', ",
        ),
        (AlgorithmConfig, {"kl_estimator": "k9"}, r"kl_estimator='k9'"),
        (AlgorithmConfig, {"micro_batch_size": 0}, r"micro_batch_size=0"),
        (AlgorithmConfig, {"policy_loss": "ppo"}, r"policy_loss='ppo' is invalid"),
        (AlgorithmConfig, {"clip_ratio_c": 1.0}, r"clip_ratio_c=1.0"),
    ],
)
def test_bad_values_are_rejected(cls, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_unknown_key_suggests_the_closest() -> None:
    with pytest.raises(ValueError, match=r"RolloutConfig has no setting 'temprature'. Did you mean 'temperature'"):
        config_from_dict(RolloutConfig, {"temprature": 0.7})
    assert config_from_dict(RolloutConfig, {"n": 4}).n == 4


def test_batch_arithmetic() -> None:
    algo = AlgorithmConfig(mini_batch_size=16)
    assert algo.check_batch(prompts=8, n=4, world_size=2) == 16
    assert AlgorithmConfig().check_batch(prompts=8, n=4, world_size=2) == 32
    with pytest.raises(ValueError, match=r"prompts per step \(2\) must be divisible by the number of ranks \(4\)"):
        AlgorithmConfig().check_batch(prompts=2, n=8, world_size=4)
    with pytest.raises(ValueError, match=r"must be divisible by mini_batch_size \(12\)"):
        AlgorithmConfig(mini_batch_size=12).check_batch(prompts=8, n=4, world_size=2)
    with pytest.raises(ValueError, match=r"mini_batch_size \(6\) must be divisible by the number of ranks \(4\)"):
        AlgorithmConfig(mini_batch_size=6).check_batch(prompts=4, n=3, world_size=4)


def test_configs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        RolloutConfig().n = 3  # type: ignore[misc]


def test_when_old_logprobs_are_needed() -> None:
    assert not AlgorithmConfig().needs_old_logprobs  # on-policy GRPO: the update's own log-probs serve
    assert AlgorithmConfig(ppo_epochs=2).needs_old_logprobs
    assert AlgorithmConfig(mini_batch_size=8).needs_old_logprobs
    assert AlgorithmConfig(kl_coef=0.1, kl_in_reward=True).needs_old_logprobs
    assert not AlgorithmConfig(kl_coef=0.1, kl_in_reward=False).needs_old_logprobs
