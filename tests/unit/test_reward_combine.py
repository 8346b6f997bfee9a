"""Several named rewards: weights, per-component columns and metrics, failures, a model beside functions."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoTokenizer

from lightning_rlhf import GRPOModule, RewardConfig
from lightning_rlhf.config import config_from_dict
from lightning_rlhf.demo import addition_reward
from lightning_rlhf.rewards import reward_components, weighted_sum
from lightning_rlhf.roles import RewardRole
from tests.unit.test_reward import rollout


def short(prompts, completions, **kw):
    return [1.0 if len(c) <= 1 else 0.0 for c in completions]


def test_weighted_sum() -> None:
    scores = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([2.0, 4.0])}
    assert weighted_sum(scores, {"a": 1.0, "b": -0.5}).tolist() == [0.0, -2.0]


def test_components_and_weights_are_combined_and_logged_each(tiny_model: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    config = RewardConfig(timeout_s=10.0, weights={"short": 0.5})
    role = RewardRole({"correct": addition_reward, "short": short}, tokenizer=tok, micro_batch_size=4, config=config)
    out = role.score(rollout(tok, ["7", "8", "77"]))
    assert out["reward/correct"].tolist() == [1.0, 0.0, 0.0]
    assert out["reward/short"].tolist() == [1.0, 1.0, 0.0]
    assert out["scores"].tolist() == [1.5, 0.5, 0.0]
    assert role.metrics(out) == pytest.approx(
        {
            "reward/correct/mean": 1 / 3,
            "reward/correct/failed": 0.0,
            "reward/short/mean": 2 / 3,
            "reward/short/failed": 0.0,
        }
    )


def test_a_hanging_component_falls_back_alone_and_is_counted(tiny_model: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)

    def stuck(prompts, completions, **kw):
        time.sleep(1000)

    config = RewardConfig(timeout_s=1.0, fallback_score=-1.0)
    role = RewardRole({"correct": addition_reward, "stuck": stuck}, tokenizer=tok, micro_batch_size=4, config=config)
    out = role.score(rollout(tok, ["7", "8"]))
    assert out["scores"].tolist() == [0.0, -1.0]  # 1 + (-1), 0 + (-1)
    assert out["reward/stuck/failed"].tolist() == [True, True]
    metrics = role.metrics(out)
    assert metrics["reward/stuck/failed"] == 2.0 and metrics["reward/correct/failed"] == 0.0


def test_a_role_writes_to_its_own_key_and_names_metrics_by_the_role(tiny_model: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    role = RewardRole(addition_reward, tokenizer=tok, micro_batch_size=4, key="costs")
    role.name = "cost"  # as RLHFModule.roles() names it from the attribute
    out = role.score(rollout(tok, ["7", "8"]))
    assert out["costs"].tolist() == [1.0, 0.0] and "scores" not in out
    assert set(role.metrics(out)) == {"cost/addition_reward/mean", "cost/addition_reward/failed"}


def test_model_beside_functions(tiny_model: str, tiny_classifier: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model_only = RewardRole(tiny_classifier, tokenizer=tok, micro_batch_size=2)
    both = RewardRole(
        {"rm": tiny_classifier, "correct": addition_reward},
        tokenizer=tok,
        micro_batch_size=2,
        config=RewardConfig(timeout_s=10.0, weights={"rm": 2.0}),
    )
    model_only.load()
    both.load()
    batch = rollout(tok, ["7", "8", "7"])
    rm = model_only.score(batch)["scores"]
    out = both.score(rollout(tok, ["7", "8", "7"]))
    torch.testing.assert_close(out["reward/rm"], rm)
    torch.testing.assert_close(out["scores"], 2.0 * rm + torch.tensor([1.0, 0.0, 1.0]))
    assert [c.name for c in model_only.components] == ["model"]


def test_bad_reward_specs_fail_clearly(tiny_model: str, tiny_classifier: str) -> None:
    with pytest.raises(ValueError, match=r"has 2 reward models \(\['a', 'b'\]\); a reward role holds at most one"):
        reward_components({"a": tiny_classifier, "b": tiny_classifier})
    with pytest.raises(ValueError, match=r"weights names `corect`.*Did you mean 'correct'\?"):
        reward_components({"correct": addition_reward}, weights={"corect": 1.0})
    with pytest.raises(ValueError, match=r"reward name 'a/b' is invalid"):
        reward_components({"a/b": addition_reward})
    with pytest.raises(ValueError, match=r"names no reward"):
        reward_components({})
    with pytest.raises(TypeError, match=r"reward\['x'\] must be a function or a model path, got int"):
        reward_components({"x": 3})  # type: ignore[dict-item]
    assert [c.name for c in reward_components(lambda p, c, **kw: [0.0] * len(c))] == ["lambda"]
    with pytest.raises(ValueError, match=r"RewardConfig.weights names `x`"):
        GRPOModule(tiny_model, reward=addition_reward, reward_config=RewardConfig(weights={"x": 1.0}))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout_s": 0}, r"RewardConfig.timeout_s=0 is invalid: expected seconds > 0, or None"),
        ({"fallback_score": float("nan")}, r"RewardConfig.fallback_score=nan is invalid"),
        ({"batch_size": 0}, r"RewardConfig.batch_size=0 is invalid"),
        ({"num_workers": 0}, r"RewardConfig.num_workers=0 is invalid"),
        ({"on_exception": "ignore"}, r"RewardConfig.on_exception='ignore' is invalid: expected 'raise' or 'fallback'"),
        ({"weights": {"a": float("inf")}}, r"RewardConfig.weights=.* \(`a` has inf\)"),
    ],
)
def test_reward_config_validation(kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RewardConfig(**kwargs)


def test_reward_config_defaults_and_unknown_keys() -> None:
    cfg = RewardConfig()
    assert (cfg.timeout_s, cfg.fallback_score, cfg.batch_size, cfg.on_exception) == (60.0, 0.0, None, "raise")
    with pytest.raises(ValueError, match=r"RewardConfig has no setting 'timeout'. Did you mean 'timeout_s'"):
        config_from_dict(RewardConfig, {"timeout": 5})


def test_module_logs_each_component(tiny_model: str) -> None:
    module = GRPOModule(
        tiny_model,
        reward={"correct": addition_reward, "short": short},
        reward_config=RewardConfig(weights={"short": 0.1}),
    )
    assert module.reward.config is module.reward_config and module.reward_config.timeout_s == 60.0
    tok = module.tokenizer
    batch = rollout(tok, ["7", "77"])
    batch["response_truncated"] = torch.tensor([False, False])
    module.roles()  # names the roles, as the strategy does at set-up
    scored = module.reward.score(batch)
    metrics = module.rollout_metrics(scored)
    assert metrics["critic/score/mean"] == pytest.approx((1.1 + 0.0) / 2)
    assert metrics["reward/correct/mean"] == 0.5 and metrics["reward/short/mean"] == 0.5
    assert metrics["reward/correct/failed"] == 0.0
