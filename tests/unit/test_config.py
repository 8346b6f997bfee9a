"""Settings validation: bad values fail with the field, the value and the fix, before anything loads."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import warnings

import pytest

from lightning_rlhf.config import (
    AlgorithmConfig,
    AsyncConfig,
    BatchingConfig,
    EpisodeConfig,
    FilteringConfig,
    KLConfig,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    config_from_dict,
)


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
            r"advantage='grpoo' is invalid: expected one of \['gae', 'gpg', 'grpo', ",
        ),
        (KLConfig, {"estimator": "k9"}, r"KLConfig.estimator='k9' is invalid: expected one of \['k1'"),
        (KLConfig, {"target": 0.1}, r"KLConfig.target=0.1 is invalid: expected a KL > 0, with in_reward=True"),
        (BatchingConfig, {"micro_batch_size": 0}, r"BatchingConfig.micro_batch_size=0"),
        (LossConfig, {"policy_loss": "ppo"}, r"LossConfig.policy_loss='ppo' is invalid"),
        (LossConfig, {"clip_ratio_c": 1.0}, r"LossConfig.clip_ratio_c=1.0"),
        (FilteringConfig, {"max_sampling_rounds": 0}, r"FilteringConfig.max_sampling_rounds=0"),
        (AsyncConfig, {"rollout_is_cap": 1.0}, r"AsyncConfig.rollout_is_cap=1.0"),
        (AsyncConfig, {"rollout_mask": "tokens"}, r"AsyncConfig.rollout_mask='tokens' is invalid: expected one of"),
        (AsyncConfig, {"rollout_mask": "token", "rollout_mask_high": 0.9}, r"AsyncConfig.rollout_mask_high=0.9"),
        (EpisodeConfig, {"max_turns": 0}, r"EpisodeConfig.max_turns=0 is invalid"),
        (EpisodeConfig, {"tool_timeout_s": 0}, r"EpisodeConfig.tool_timeout_s=0 is invalid"),
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
    algo = AlgorithmConfig(batching=BatchingConfig(mini_batch_size=16))
    assert algo.check_batch(prompts=8, n=4, world_size=2) == 16
    assert AlgorithmConfig().check_batch(prompts=8, n=4, world_size=2) == 32
    with pytest.raises(ValueError, match=r"prompts per step \(2\) must be divisible by the number of ranks \(4\)"):
        AlgorithmConfig().check_batch(prompts=2, n=8, world_size=4)
    with pytest.raises(ValueError, match=r"must be divisible by batching.mini_batch_size \(12\)"):
        AlgorithmConfig(batching=BatchingConfig(mini_batch_size=12)).check_batch(prompts=8, n=4, world_size=2)
    with pytest.raises(ValueError, match=r"mini_batch_size \(6\) must be divisible by the number of ranks \(4\)"):
        AlgorithmConfig(batching=BatchingConfig(mini_batch_size=6)).check_batch(prompts=4, n=3, world_size=4)


def test_configs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        RolloutConfig().n = 3  # type: ignore[misc]


def test_when_old_logprobs_are_needed() -> None:
    assert not AlgorithmConfig().needs_old_logprobs  # on-policy GRPO: the update's own log-probs serve
    assert AlgorithmConfig(batching=BatchingConfig(ppo_epochs=2)).needs_old_logprobs
    assert AlgorithmConfig(batching=BatchingConfig(mini_batch_size=8)).needs_old_logprobs
    assert AlgorithmConfig(kl=KLConfig(coef=0.1, in_reward=True)).needs_old_logprobs
    assert not AlgorithmConfig(kl=KLConfig(coef=0.1, in_reward=False)).needs_old_logprobs


def test_settings_are_grouped_by_concern() -> None:
    # The nested spelling is the settings' home: a group given as a config or as a dict of its settings.
    algo = AlgorithmConfig(advantage="rloo", kl=KLConfig(coef=0.1, in_reward=True), batching={"micro_batch_size": 4})
    assert (algo.kl.coef, algo.kl.in_reward, algo.batching.micro_batch_size) == (0.1, True, 4)
    assert algo.loss == LossConfig() and algo.needs_old_logprobs  # a KL penalty in the reward needs them
    rollout = RolloutConfig(n=2, episode=EpisodeConfig(max_turns=2))
    assert (rollout.n, rollout.episode.max_turns, rollout.episode.tool_workers) == (2, 2, 4)
    # Cross-group checks name both nested settings.
    with pytest.raises(ValueError, match=r"asynchronous.max_staleness=1 .* filtering.dynamic_sampling=True"):
        AlgorithmConfig(asynchronous=AsyncConfig(max_staleness=1), filtering=FilteringConfig(dynamic_sampling=True))
    with pytest.raises(TypeError, match="unexpected keyword arguments: kl_coeff"):
        AlgorithmConfig(kl_coeff=0.1)
    # Equal, hashable, picklable (the controller ships configs to workers).
    assert pickle.loads(pickle.dumps(algo)) == algo and hash(algo) == hash(copy.deepcopy(algo))
    assert dataclasses.replace(algo, advantage="grpo").kl == algo.kl


def test_flat_spelling_is_mapped_into_its_group_with_a_deprecation() -> None:
    # Scripts and YAML written before the grouping keep running: a flat name lands in its group, over a group
    # passed alongside, and says where the setting lives now.
    with pytest.warns(DeprecationWarning) as caught:
        algo = AlgorithmConfig(kl_coef=0.2, kl=KLConfig(estimator="k1"), micro_batch_size=4, max_staleness=1)
    assert str(caught[0].message) == (
        "AlgorithmConfig.kl_coef is deprecated: the setting is AlgorithmConfig.kl.coef. HINT: "
        "AlgorithmConfig(kl=KLConfig(coef=...)), in YAML kl: {coef: ...}."
    )
    assert len(caught) == 3 and all(w.filename == __file__ for w in caught)  # pointing at the caller's line
    assert algo == AlgorithmConfig(
        kl=KLConfig(coef=0.2, estimator="k1"),
        batching=BatchingConfig(micro_batch_size=4),
        asynchronous=AsyncConfig(max_staleness=1),
    )
    with pytest.warns(DeprecationWarning, match=r"RolloutConfig.max_turns is deprecated: .*RolloutConfig.episode"):
        assert RolloutConfig(max_turns=2).episode.max_turns == 2
    with pytest.warns(DeprecationWarning, match=r"AlgorithmConfig.ppo_epochs is deprecated"):
        assert algo.ppo_epochs == 1  # reads too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AlgorithmConfig(kl_coef=None).kl.coef == 0.0  # a flat None (the command line's unset) changes nothing
    with pytest.raises(AttributeError, match="no attribute 'kl_coeff'"):
        _ = algo.kl_coeff
    # config_from_dict takes both spellings and still names the closest key for a typo.
    assert config_from_dict(AlgorithmConfig, {"kl": {"coef": 0.3}}).kl.coef == 0.3
    with pytest.warns(DeprecationWarning):
        assert config_from_dict(RolloutConfig, {"tool_workers": 2}).episode.tool_workers == 2
    with pytest.raises(ValueError, match="Did you mean 'kl_coef'"):
        config_from_dict(AlgorithmConfig, {"kl_coeff": 0.3})
