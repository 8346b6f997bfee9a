"""Unit tests for the added estimators, losses and KL controllers, checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlhf.algorithms import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    KLController,
    aggregate_loss,
    compute_advantages,
    compute_policy_loss,
    policy_loss_clipped,
    policy_loss_dual_clip,
    policy_loss_gspo,
    value_loss_clipped,
)

NAN = float("nan")


def close(actual: torch.Tensor, expected: object, atol: float = 1e-5) -> None:
    exp = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, exp, atol=atol, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- registry


def test_registries_list_new_names() -> None:
    assert ADVANTAGE_ESTIMATORS.names() == [
        "gae",
        "gpg",
        "grpo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
    ]
    assert "seq-mean-token-sum-norm" in LOSS_AGGREGATIONS
    assert POLICY_LOSSES.names() == ["cispo", "dppo_kl", "dppo_tv", "dual_clip", "gpg", "gspo", "sapo", "vanilla"]
    assert POLICY_LOSSES.get("vanilla") is policy_loss_clipped
    assert POLICY_LOSSES.get("dual_clip") is policy_loss_dual_clip
    assert POLICY_LOSSES.get("gspo") is policy_loss_gspo


def test_unknown_names_list_valid_ones() -> None:
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError) as info:
        compute_policy_loss("dual-clip", lp, lp, lp, torch.ones(1, 2))
    assert (
        str(info.value)
        == "Unknown policy loss 'dual-clip'. Valid: cispo, dppo_kl, dppo_tv, dual_clip, gpg, gspo, sapo, "
        "vanilla. Did you mean 'dual_clip'?"
    )
    with pytest.raises(ValueError, match=r"Valid: gae, gpg, grpo, reinforce_plus_plus, .*rloo\. Did you mean 'rloo'\?"):
        compute_advantages("rlo", token_rewards=lp, response_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="Valid: seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"):
        aggregate_loss(lp, torch.ones(1, 2), mode="nope")
    with pytest.raises(TypeError, match=r"PolicySettings.* 'clip_lo'"):  # a misspelt setting is not ignored
        compute_policy_loss("gspo", lp, lp, lp, torch.ones(1, 2), clip_lo=0.1)


# --------------------------------------------------------------------------------------------- advantages


def test_an_estimator_takes_one_typed_input_and_one_written_for_the_keyword_form_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rewards, mask, ids = torch.tensor([[0.0, 1.0], [0.0, 3.0]]), torch.ones(2, 2), torch.tensor([0, 0])
    inputs = AdvantageInputs(rewards, mask, group_ids=ids, gamma=0.5)
    for a, b in zip(
        compute_advantages("grpo", inputs),
        compute_advantages("grpo", token_rewards=rewards, response_mask=mask, group_ids=ids),
        strict=True,
    ):
        close(a, b)
    seen: dict[str, object] = {}

    def keyword_form(
        token_rewards: torch.Tensor, response_mask: torch.Tensor, *, group_ids: object = None, gamma: float = 1.0,
        **unused: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        seen.update(group_ids=group_ids, gamma=gamma, unused=sorted(unused))
        return token_rewards * 2, token_rewards

    monkeypatch.setitem(ADVANTAGE_ESTIMATORS._entries, "keyword_form", keyword_form)
    advantages, _ = compute_advantages("keyword_form", inputs)
    close(advantages, rewards * 2)
    assert seen.pop("group_ids") is ids
    assert seen == {"gamma": 0.5, "unused": ["baselines", "eps", "lam", "norm_by_std", "values"]}


def test_existing_estimators_accept_and_ignore_baselines() -> None:
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    mask = torch.ones(2, 2)
    ids = torch.tensor([0, 0])
    base = compute_advantages("grpo", token_rewards=rewards, response_mask=mask, group_ids=ids)
    with_b = compute_advantages("grpo", token_rewards=rewards, response_mask=mask, group_ids=ids, baselines=ids * 9.0)
    close(with_b[0], base[0])
    values = torch.zeros(2, 2)
    gae = compute_advantages("gae", token_rewards=rewards, response_mask=mask, values=values, baselines=ids * 9.0)
    close(gae[0], compute_advantages("gae", token_rewards=rewards, response_mask=mask, values=values)[0])


def test_rloo_group_of_three_pair_and_singleton() -> None:
    # group 5 (rows 0, 1, 2): scores (1, 0, 2); leave-one-out baselines (0+2)/2=1, (1+2)/2=1.5, (1+0)/2=0.5
    #   -> A = (1-1, 0-1.5, 2-0.5) = (0, -1.5, 1.5)   [= 3/2 * (s - mean 1)]
    # group 9 (row 3): singleton, no other sample -> 0
    # group -2 (rows 4, 5): scores (0.5, -0.5) -> A = (0.5-(-0.5), -0.5-0.5) = (1, -1)
    # rewards sit on the last valid token; padding holds nan/junk that must be ignored
    rewards = torch.tensor(
        [
            [0.0, 1.0, NAN],
            [0.0, NAN, NAN],
            [0.0, 0.0, 2.0],
            [3.0, 7.0, 7.0],
            [0.5, 9.0, 9.0],
            [0.0, -0.5, 9.0],
        ]
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 1, 0]])
    group_ids = torch.tensor([5, 5, 5, 9, -2, -2])
    adv, ret = compute_advantages("rloo", token_rewards=rewards, response_mask=mask, group_ids=group_ids)
    per_seq = torch.tensor([0.0, -1.5, 1.5, 0.0, 1.0, -1.0]).unsqueeze(-1)
    close(adv, per_seq * mask)
    close(ret, adv)
    # integer rewards are accepted and produce float advantages
    adv_int, _ = compute_advantages(
        "rloo", token_rewards=torch.tensor([[1], [3]]), response_mask=torch.ones(2, 1), group_ids=torch.tensor([0, 0])
    )
    close(adv_int, [[-2.0], [2.0]])
    with pytest.raises(ValueError, match=r"rloo.*group_ids"):
        compute_advantages("rloo", token_rewards=rewards, response_mask=mask)


def test_reinforce_plus_plus_discounted_returns_and_whitening() -> None:
    # gamma = 0.5, rewards (-0.1, 0, 1) (a KL penalty already folded into token 0):
    #   G2 = 1; G1 = 0 + 0.5*1 = 0.5; G0 = -0.1 + 0.5*0.5 = 0.15
    # whiten over 3 tokens: mean 1.65/3 = 0.55; deviations (-0.4, -0.05, 0.45); squares sum 0.365;
    #   unbiased var 0.1825, std 0.4272002 -> (-0.936329, -0.117041, 1.053370)
    rewards = torch.tensor([[-0.1, 0.0, 1.0]])
    adv, ret = compute_advantages(
        "reinforce_plus_plus", token_rewards=rewards, response_mask=torch.ones(1, 3), gamma=0.5
    )
    close(ret, [[0.15, 0.5, 1.0]])
    close(adv, [[-0.936329, -0.117041, 1.053370]])

    # Same response with a hole and right padding carrying junk: padding is skipped (transparent),
    # plus a second ragged row with a single token of reward 2 (G = 2). Whitening is batch-wide:
    #   valid returns (0.15, 0.5, 1.0, 2.0): mean 0.9125; deviations (-0.7625, -0.4125, 0.0875, 1.0875);
    #   squares sum 1.941875; unbiased var 0.6472917, std 0.8045444
    #   -> (-0.947741, -0.512713, 0.108757, 1.351697)
    rewards_p = torch.tensor([[-0.1, 7.0, 0.0, 1.0, 5.0], [2.0, NAN, NAN, NAN, NAN]])
    mask_p = torch.tensor([[1, 0, 1, 1, 0], [1, 0, 0, 0, 0]])
    adv_p, ret_p = compute_advantages("reinforce_plus_plus", token_rewards=rewards_p, response_mask=mask_p, gamma=0.5)
    close(ret_p, [[0.15, 0.0, 0.5, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0]])
    close(adv_p, [[-0.947741, 0.0, -0.512713, 0.108757, 0.0], [1.351697, 0.0, 0.0, 0.0, 0.0]])


def test_reinforce_plus_plus_baseline_group_mean_then_whiten() -> None:
    # group 0: scores (1, 3) -> mean 2 -> centred (-1, 1); group 1: singleton score 4 -> mean 0 -> 4
    # broadcast over ragged masks (lengths 2, 1, 1): valid tokens (-1, -1, 1, 4)
    # whiten: mean 3/4 = 0.75; deviations (-1.75, -1.75, 0.25, 3.25); squares sum 16.75;
    #   unbiased var 5.583333, std 2.3629078 -> (-0.740613, -0.740613, 0.105802, 1.375424)
    rewards = torch.tensor([[0.0, 1.0, NAN], [3.0, 0.0, 0.0], [4.0, NAN, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0]])
    adv, ret = compute_advantages(
        "reinforce_plus_plus_baseline", token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0, 1])
    )
    close(ret, [[-1.0, -1.0, 0.0], [1.0, 0.0, 0.0], [4.0, 0.0, 0.0]])
    close(adv, [[-0.740613, -0.740613, 0.0], [0.105802, 0.0, 0.0], [1.375424, 0.0, 0.0]])
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("reinforce_plus_plus_baseline", token_rewards=rewards, response_mask=mask)


def test_remax_subtracts_greedy_baseline() -> None:
    # scores (1, 0.5) on ragged rows, greedy baselines (0.25, 1) -> A = (0.75, -0.5)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv, ret = compute_advantages(
        "remax", token_rewards=rewards, response_mask=mask, baselines=torch.tensor([0.25, 1.0])
    )
    close(adv, [[0.75, 0.75, 0.75], [-0.5, 0.0, 0.0]])
    close(ret, adv)
    with pytest.raises(ValueError, match=r"remax.*baselines"):
        compute_advantages("remax", token_rewards=rewards, response_mask=mask)


# ------------------------------------------------------------------------------------------------ losses


def test_seq_mean_token_sum_norm() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # per-seq sums (6, 4, 0); default max_len = T = 3: (6 + 4 + 0) / 3 / 3 = 10/9
    close(aggregate_loss(loss, mask, mode="seq-mean-token-sum-norm"), 10.0 / 9.0)
    # max_len = 5: 10 / 5 / 3 = 2/3; other modes ignore max_len
    close(aggregate_loss(loss, mask, mode="seq-mean-token-sum-norm", max_len=5), 2.0 / 3.0)
    close(aggregate_loss(loss, mask, max_len=5), 2.5)
    close(aggregate_loss(loss, mask, mode="seq-mean-token-sum", max_len=5), 10.0 / 3.0)
    with pytest.raises(ValueError, match="max_len"):
        aggregate_loss(loss, mask, mode="seq-mean-token-sum-norm", max_len=0)
    # the policy and value losses forward max_len: one token, A = 1, r = 1 -> loss -1 / 4
    lp = torch.zeros(1, 2)
    pg, _ = policy_loss_clipped(
        lp, lp, torch.ones(1, 2), torch.tensor([[1, 0]]), agg="seq-mean-token-sum-norm", max_len=4
    )
    close(pg, -0.25)
    # value: 0.5 * (1 - 0)^2 = 0.5 on one token, / 4 -> 0.125
    vf, _ = value_loss_clipped(
        torch.ones(1, 2),
        torch.ones(1, 2),
        torch.zeros(1, 2),
        torch.tensor([[1, 0]]),
        agg="seq-mean-token-sum-norm",
        max_len=4,
    )
    close(vf, 0.125)


def test_vanilla_registered_and_direct_call_unchanged() -> None:
    lp = torch.tensor([[-1.0, -0.5]])
    old = torch.tensor([[-1.2, -0.5]])
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    direct = policy_loss_clipped(lp, old, adv, mask, clip_low=0.1, clip_high=0.3)
    by_name = compute_policy_loss("vanilla", lp, old, adv, mask, clip_low=0.1, clip_high=0.3, clip_ratio_c=10.0)
    close(by_name[0], direct[0])
    assert by_name[1].keys() == direct[1].keys() == {"pg_clipfrac", "ppo_kl"}


def test_dual_clip_bounds_negative_advantages() -> None:
    # clip 0.2, c = 3; tokens (A, r):
    #   (-1, 5):  ppo = max(5, 1.2) = 5 > bound -A*c = 3 -> 3 (dual clip active, zero grad)
    #   (-1, 2):  ppo = max(2, 1.2) = 2 < 3 -> 2 (grad d(-A r)/dlp = -A r = 2)
    #   (+1, 5):  ppo = max(-5, -1.2) = -1.2 (PPO clipped; A > 0 so no dual clip)
    #   (-2, 0.5): ppo = max(1, 1.6) = 1.6 (PPO clipped) < bound 6 -> 1.6
    #   padding (huge ratio and advantage) ignored
    # token-mean = (3 + 2 - 1.2 + 1.6) / 4 = 1.35; vanilla would give (5 + 2 - 1.2 + 1.6) / 4 = 1.85
    # pg_clipfrac = 2/4 (tokens 3, 4); pg_clipfrac_lower = 1/4 (token 1)
    # ppo_kl = -(log 5 + log 2 + log 5 + log 0.5) / 4 = -log(5) / 2
    ratios = torch.tensor([[5.0, 2.0, 5.0, 0.5, 100.0]])
    old = torch.tensor([[-2.0, -1.0, -3.0, -0.5, -4.0]])
    logprobs = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0, -50.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = compute_policy_loss("dual_clip", logprobs, old, adv, mask, clip_ratio_c=3.0)
    close(loss, 1.35)
    close(metrics["pg_clipfrac"], 0.5)
    close(metrics["pg_clipfrac_lower"], 0.25)
    close(metrics["ppo_kl"], -math.log(5.0) / 2)
    assert all(m.ndim == 0 and not m.requires_grad for m in metrics.values())
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.0, 2.0 / 4, 0.0, 0.0, 0.0]])
    close(policy_loss_clipped(logprobs.detach(), old, adv, mask)[0], 1.85)
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="clip_ratio_c"):
            compute_policy_loss("dual_clip", logprobs, old, adv, mask, clip_ratio_c=bad)


def test_gspo_sequence_ratio_and_gradient_1x2() -> None:
    # token log-ratios (0.1, -0.3): s = exp(mean) = exp(-0.1) = 0.9048374
    #   = geometric mean of token ratios sqrt(exp(0.1) * exp(-0.3))
    # A = +1, clip 0.2: s within [0.8, 1.2] -> unclipped; per-token loss -A*s = -0.9048374 on both tokens
    # seq-mean-token-mean (the paper's aggregation): loss = -0.9048374
    # gradient: d/dlp_t of (1/2) sum_t -A sg[s] exp(lp_t - sg[lp_t]) = -A s / 2 = -0.4524187 per token,
    #   which is the gradient of -A * exp(mean_t(lp_t - old_t)) w.r.t. lp_t: -A s * (1/2)
    old = torch.tensor([[-1.0, -2.0]])
    logprobs = (old + torch.tensor([[0.1, -0.3]])).requires_grad_(True)
    adv = torch.ones(1, 2)
    loss, metrics = compute_policy_loss("gspo", logprobs, old, adv, torch.ones(1, 2), agg="seq-mean-token-mean")
    s = math.exp(-0.1)
    assert math.isclose(s, math.sqrt(math.exp(0.1) * math.exp(-0.3)), rel_tol=1e-12)
    close(loss, -s)
    close(metrics["pg_clipfrac"], 0.0)
    close(metrics["ppo_kl"], 0.1)  # -(0.1 - 0.3) / 2
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[-s / 2, -s / 2]])
    # same gradient from the sequence-level objective written directly
    lp2 = logprobs.detach().clone().requires_grad_(True)
    (-(torch.exp((lp2 - old).mean()))).backward()
    assert lp2.grad is not None
    close(logprobs.grad, lp2.grad)


def test_gspo_small_clip_ragged_batch() -> None:
    # GSPO-sized clip: 1 - 3e-4 <= s <= 1 + 4e-4
    # row 0 (2 tokens): log-ratios (0.1, -0.3) -> s = 0.9048374, A = +1: max(-0.9048, -0.9997) = -0.9048374
    #   (unclipped: a lower ratio under A > 0 is the pessimistic branch)
    # row 1 (1 token + padding): log-ratio 0.5 -> s = exp(0.5) = 1.6487, A = +1: max(-1.6487, -1.0004) = -1.0004
    #   (clipped, zero gradient)
    # token-mean over 3 tokens: (2 * -0.9048374 - 1.0004) / 3 = -0.9366916
    # pg_clipfrac = 1 clipped token / 3 tokens; ppo_kl = -(0.1 - 0.3 + 0.5) / 3 = -0.1
    # grads: row 0 tokens -s/3 = -0.3016125 each; row 1 and padding 0
    old = torch.tensor([[-1.0, -2.0], [-0.7, -1.0]])
    logprobs = (old + torch.tensor([[0.1, -0.3], [0.5, 3.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = policy_loss_gspo(logprobs, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    s = math.exp(-0.1)
    close(loss, (2 * -s - 1.0004) / 3)
    close(metrics["pg_clipfrac"], 1.0 / 3.0)
    close(metrics["ppo_kl"], -0.1)
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[-s / 3, -s / 3], [0.0, 0.0]])
    # at ratio 1 (on-policy) GSPO equals vanilla PPO for any aggregation
    lp = old.clone()
    for agg in ("token-mean", "seq-mean-token-sum-norm"):
        close(policy_loss_gspo(lp, old, adv, mask, agg=agg)[0], policy_loss_clipped(lp, old, adv, mask, agg=agg)[0])


# -------------------------------------------------------------------------------------------- KL control


def test_adaptive_kl_controller_updates_by_hand() -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    assert ctl.value == 0.2
    # KL 7.5: error 7.5/6 - 1 = 0.25 -> clipped 0.2; 0.2 * (1 + 0.2 * 256/10000) = 0.201024
    assert math.isclose(ctl.update(7.5, 256), 0.201024, rel_tol=1e-12)
    # KL 5.4: error -0.1; 0.201024 * (1 - 0.1 * 512/10000) = 0.201024 * 0.99488 = 0.19999475712
    assert math.isclose(ctl.update(5.4, 512), 0.19999475712, rel_tol=1e-12)
    # on target: unchanged; KL 0: error -1 -> clipped -0.2, n_steps = horizon -> * 0.8
    assert math.isclose(ctl.update(6.0, 100), 0.19999475712, rel_tol=1e-12)
    assert math.isclose(ctl.update(0.0, 10000), 0.19999475712 * 0.8, rel_tol=1e-12)
    assert ctl.value == ctl.state_dict()["value"]


def test_kl_controllers_state_round_trip_and_errors() -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=2.0, horizon=1000)
    ctl.update(3.0, 100)  # error 3/2 - 1 = 0.5 -> clipped 0.2; 0.1 * (1 + 0.2 * 100/1000) = 0.102
    assert math.isclose(ctl.value, 0.102, rel_tol=1e-12)
    state = ctl.state_dict()
    assert state == {"value": ctl.value}
    fresh = AdaptiveKLController(init_kl_coef=0.5, target_kl=2.0, horizon=1000)
    fresh.load_state_dict(state)
    assert fresh.value == ctl.value
    assert fresh.update(1.0, 50) == ctl.update(1.0, 50)  # identical from here on
    fixed = FixedKLController(kl_coef=0.05)
    assert fixed.update(100.0, 1000) == 0.05 == fixed.value
    fixed2 = FixedKLController(kl_coef=0.0)
    fixed2.load_state_dict(fixed.state_dict())
    assert fixed2.value == 0.05
    controllers: list[KLController] = [ctl, fixed]  # both satisfy the shared interface (checked by mypy)
    assert all(isinstance(c.value, float) for c in controllers)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=0)
    with pytest.raises(ValueError, match="init_kl_coef"):
        AdaptiveKLController(init_kl_coef=-0.1, target_kl=1.0, horizon=10)
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(kl_coef=-1.0)
