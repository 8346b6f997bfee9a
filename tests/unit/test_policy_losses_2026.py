"""The 2026 policy losses (CISPO, SAPO, GPG, DPPO) and GPG's advantages against hand-computed cases: each loss's
value and gradient on a 1 x 3 or 2 x 2 batch whose numbers are worked out in the comments, and the settings'
refusals."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlhf.algorithms import compute_advantages, compute_policy_loss
from lightning_rlhf.config import AlgorithmConfig, LossConfig


def leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_cispo_keeps_the_gradient_of_a_clipped_token_and_weighs_it_by_the_clipped_ratio() -> None:
    # ratios e^0.5 = 1.649 (above 1 + 0.28: weight 1.28), 1, e^-0.5 = 0.607 (above 1 - 1 = 0: kept, as the paper's
    # upper-only clip); advantages 1, 1, -2
    old = torch.zeros(1, 3, dtype=torch.float64)
    logprobs = leaf([[0.5, 0.0, -0.5]])
    adv = torch.tensor([[1.0, 1.0, -2.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("cispo", logprobs, old, adv, torch.ones(1, 3), clip_low=1.0, clip_high=0.28)
    weights = [1.28, 1.0, math.exp(-0.5)]
    expected = -sum(w * a * lp for w, a, lp in zip(weights, [1.0, 1.0, -2.0], [0.5, 0.0, -0.5], strict=True)) / 3
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([[-1.28 / 3, -1 / 3, 2 * math.exp(-0.5) / 3]], dtype=torch.float64)
    )
    assert float(metrics["pg_clipfrac"]) == pytest.approx(1 / 3)  # PPO's clip would zero the first token's gradient
    vanilla, _ = compute_policy_loss("vanilla", leaf([[0.5, 0.0, -0.5]]), old, adv, torch.ones(1, 3), clip_high=0.28)
    assert vanilla.item() != pytest.approx(loss.item())


def test_sapo_gates_smoothly_with_a_temperature_per_sign_of_the_advantage() -> None:
    # r = e^0.2 = 1.2214 (A = +1, tau 1) and e^-0.2 = 0.8187 (A = -1, tau 1.05): f(r) = 4/tau * sigmoid(tau (r - 1))
    old = torch.zeros(1, 2, dtype=torch.float64)
    logprobs = leaf([[0.2, -0.2]])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, _ = compute_policy_loss("sapo", logprobs, old, adv, torch.ones(1, 2), tau_pos=1.0, tau_neg=1.05)
    r1, r2 = math.exp(0.2), math.exp(-0.2)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    f1, f2 = 4 * sig(r1 - 1), 4 / 1.05 * sig(1.05 * (r2 - 1))
    assert loss.item() == pytest.approx((-f1 + f2) / 2)
    loss.backward()
    # d/dlogp of -A f(r) = -A * 4 s (1 - s) * r
    g1 = -4 * sig(r1 - 1) * (1 - sig(r1 - 1)) * r1 / 2
    g2 = 4 * sig(1.05 * (r2 - 1)) * (1 - sig(1.05 * (r2 - 1))) * r2 / 2
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[g1, g2]], dtype=torch.float64))


def test_sapo_on_policy_is_the_policy_gradient() -> None:
    logprobs = leaf([[-1.0, -2.0]])
    adv = torch.tensor([[0.5, -1.5]], dtype=torch.float64)
    loss, _ = compute_policy_loss("sapo", logprobs, logprobs.detach(), adv, torch.ones(1, 2))
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, -adv / 2)  # f'(1) = 1 whatever tau


def test_gpg_is_the_plain_policy_gradient_and_gpg_advantages_undo_the_groups_without_signal() -> None:
    logprobs = leaf([[-1.0, -3.0]])
    adv = torch.tensor([[2.0, 2.0]], dtype=torch.float64)
    loss, metrics = compute_policy_loss("gpg", logprobs, logprobs.detach() + 1.0, adv, torch.ones(1, 2))
    assert loss.item() == pytest.approx(-(2 * -1 + 2 * -3) / 2)  # no ratio: the old log-probs do not enter
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0]], dtype=torch.float64))
    assert float(metrics["pg_clipfrac"]) == 0.0
    # two groups of two: scores (1, 0) differ, (1, 1) agree; B = 4, B_valid = 2: alpha = 2
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rewards = torch.zeros(4, 2)
    rewards[:, -1] = scores
    common = {"token_rewards": rewards, "response_mask": torch.ones(4, 2), "group_ids": torch.tensor([0, 0, 1, 1])}
    gpg, _ = compute_advantages("gpg", **common, norm_by_std=False)
    assert gpg[:, 0].tolist() == [1.0, -1.0, 0.0, 0.0]  # 2 * (s - mean): (1 - 0.5) * 2, (0 - 0.5) * 2
    grpo, _ = compute_advantages("grpo", **common)
    torch.testing.assert_close(compute_advantages("gpg", **common)[0], grpo * 2)  # with the std: GRPO's, times alpha
    agree, _ = compute_advantages("gpg", **{**common, "group_ids": torch.tensor([1, 1, 1, 1])}, norm_by_std=False)
    assert agree[:, 0].tolist() == [0.25, -0.75, 0.25, 0.25]  # one group whose scores differ: alpha 1


def test_dppo_masks_the_tokens_that_moved_too_far_in_their_advantages_direction() -> None:
    # old probabilities 0.5, 0.5, 0.5, 0.01; new 0.8 (A > 0, up: TV 0.3 > 0.2, masked), 0.8 (A < 0, up: the
    # advantage pushes it down, kept), 0.6 (A > 0, TV 0.1: kept), 0.02 (A > 0: the ratio doubles, TV 0.01: kept)
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.01]], dtype=torch.float64))
    new = [[math.log(0.8), math.log(0.8)], [math.log(0.6), math.log(0.02)]]
    adv = torch.tensor([[1.0, -1.0], [1.0, 1.0]], dtype=torch.float64)
    logprobs = leaf(new)
    loss, metrics = compute_policy_loss("dppo_tv", logprobs, old, adv, torch.ones(2, 2))
    ratios = [[1.6, 1.6], [1.2, 2.0]]
    kept = [[0.0, 1.0], [1.0, 1.0]]
    expected = -sum(k * a * r for rk, ak, rr in zip(kept, adv.tolist(), ratios, strict=True)
                    for k, a, r in zip(rk, ak, rr, strict=True)) / 4  # fmt: skip
    assert loss.item() == pytest.approx(expected)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(0.25)
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 1.6 / 4], [-1.2 / 4, -2.0 / 4]], dtype=torch.float64))
    # binary KL: 0.5 -> 0.8 is 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.2231 > 0.05 (masked); 0.5 -> 0.6 is 0.0204
    # (kept); 0.01 -> 0.02 is 0.01 ln 0.5 + 0.99 ln(0.99/0.98) = 0.0032 (kept, though its ratio is 2)
    logprobs = leaf(new)
    loss, metrics = compute_policy_loss("dppo_kl", logprobs, old, adv, torch.ones(2, 2))
    assert loss.item() == pytest.approx(expected)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(0.25)
    _, tight = compute_policy_loss("dppo_kl", leaf(new), old, adv, torch.ones(2, 2), dppo_kl_threshold=0.01)
    assert float(tight["pg_clipfrac"]) == pytest.approx(0.5)  # 0.0204 > 0.01 now; 0.0032 still kept


def test_the_new_settings_refuse_what_the_losses_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"LossConfig.sapo_tau_neg=0 is invalid: expected a value > 0"):
        LossConfig(policy_loss="sapo", sapo_tau_neg=0)
    with pytest.raises(ValueError, match=r"LossConfig.dppo_tv_threshold=1.5 is invalid: expected a value in \(0, 1\)"):
        LossConfig(policy_loss="dppo_tv", dppo_tv_threshold=1.5)
    with pytest.raises(ValueError, match=r"LossConfig.policy_loss='cipso' is invalid: expected one of .*'cispo'"):
        AlgorithmConfig(loss=LossConfig(policy_loss="cipso"))
