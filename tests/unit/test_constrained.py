"""DAPO's informative-group test, Safe-RLHF's combined advantage and Lagrange multiplier, the extra prompt draw."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlhf.algorithms import LagrangeMultiplier, informative_groups, lagrangian_advantages
from lightning_rlhf.config import AlgorithmConfig, FilteringConfig, SafetyConfig
from lightning_rlhf.data import PromptDataModule
from lightning_rlhf.demo import addition_cost, addition_dataset


def test_informative_groups_keeps_groups_whose_scores_differ_in_first_seen_order() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.25])
    uid = torch.tensor([3, 3, 1, 1, 0, 0, 2, 2])
    groups, keep = informative_groups(scores, uid)
    assert groups.tolist() == [3, 1, 0, 2]
    assert keep.tolist() == [False, True, False, True]
    # groups need not be contiguous; a single-sample group is never informative
    groups, keep = informative_groups(torch.tensor([0.0, 2.0, 1.0, 2.0]), torch.tensor([5, 7, 5, 9]))
    assert groups.tolist() == [5, 7, 9] and keep.tolist() == [True, False, False]


def test_lagrangian_advantage_by_hand() -> None:
    a_r, a_c = torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 1.0]])
    # lambda = 3: (1 - 1.5) / 4 = -0.125; (-2 - 3) / 4 = -1.25
    torch.testing.assert_close(lagrangian_advantages(a_r, a_c, multiplier=3.0), torch.tensor([[-0.125, -1.25]]))
    torch.testing.assert_close(lagrangian_advantages(a_r, a_c, multiplier=0.0), a_r)


def test_multiplier_rises_over_the_limit_falls_below_and_is_bounded() -> None:
    lag = LagrangeMultiplier(init=1.0, lr=0.5, cost_limit=0.1)
    up = lag.update(0.3)  # log lambda = 0 + 0.5 * 1 * 0.2 = 0.1
    assert up == pytest.approx(math.exp(0.1))
    down = lag.update(0.0)  # log lambda = 0.1 + 0.5 * e^0.1 * (-0.1)
    assert down == pytest.approx(math.exp(0.1 - 0.05 * math.exp(0.1)))
    state = lag.state_dict()
    other = LagrangeMultiplier(init=2.0, lr=0.5, cost_limit=0.1)
    other.load_state_dict(state)
    assert other.value == pytest.approx(down)
    capped = LagrangeMultiplier(init=1.0, lr=10.0, cost_limit=0.0, max_value=2.0)
    assert capped.update(5.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"init=0.0\) must be > 0"):
        LagrangeMultiplier(init=0.0, lr=0.1, cost_limit=0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lambda_init": 0.0}, r"SafetyConfig.lambda_init=0.0 is invalid"),
        ({"lambda_lr": -1.0}, r"SafetyConfig.lambda_lr=-1.0 is invalid"),
        ({"lambda_init": 2.0, "lambda_max": 1.0}, r"lambda_max=1.0 is invalid: expected None or >= lambda_init"),
    ],
)
def test_safety_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SafetyConfig(**kwargs)


def test_sampling_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"max_sampling_rounds=0 is invalid"):
        AlgorithmConfig(filtering=FilteringConfig(max_sampling_rounds=0))


def test_extra_prompt_draw_is_seeded_and_leaves_the_epoch_position(tiny_model: str) -> None:
    data = PromptDataModule(addition_dataset(), batch_size=8, tokenizer=tiny_model, max_prompt_length=16)
    data.setup("fit")
    loader = data.train_dataloader()
    first = next(iter(loader))
    state = loader.state_dict()
    a, b, c = loader.sample(8, key=5), loader.sample(8, key=5), loader.sample(8, key=6)
    assert a["prompt"] == b["prompt"] and a["prompt"] != c["prompt"]
    assert len(set(a["prompt"])) == 8  # without replacement
    assert a["uid"].tolist() == list(range(8)) and a["prompts"].shape[0] == 8
    assert "data_position" not in a.meta and loader.state_dict() == state and first["prompt"] != a["prompt"]
    with pytest.raises(ValueError, match="101 rows asked, the dataset has 100"):
        loader.sample(101, key=0)


def test_demo_cost_flags_the_digit_seven() -> None:
    assert addition_cost(["3+4="] * 3, ["7", "17", "8"]) == [1.0, 1.0, 0.0]
