"""Unit tests for lightning_rlhf.algorithms, checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlhf.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    Registry,
    aggregate_loss,
    compute_advantages,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss_clipped,
    scores_to_token_rewards,
    value_loss_clipped,
)


def close(actual: torch.Tensor, expected: object, atol: float = 1e-5) -> None:
    exp = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, exp, atol=atol, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- registry


def test_registry_register_get_names_contains() -> None:
    reg: Registry = Registry("widget")

    @reg.register("beta")
    def beta() -> int:
        return 2

    @reg.register("alpha")
    def alpha() -> int:
        return 1

    assert reg.get("alpha") is alpha
    assert reg.get("beta")() == 2
    assert reg.names() == ["alpha", "beta"]
    assert "alpha" in reg
    assert "gamma" not in reg


def test_registry_duplicate_raises() -> None:
    reg: Registry = Registry("widget")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match=r"widget.*'a'"):
        reg.register("a")(lambda: 2)


def test_registry_unknown_with_and_without_suggestion() -> None:
    with pytest.raises(ValueError) as info:
        ADVANTAGE_ESTIMATORS.get("gea")
    message = str(info.value)
    assert message.startswith("Unknown advantage estimator 'gea'. Valid: gae, gpg, grpo, ")
    assert message.endswith(". Did you mean 'gae'?")
    with pytest.raises(ValueError) as info:
        KL_ESTIMATORS.get("zzz")
    assert str(info.value) == "Unknown KL estimator 'zzz'. Valid: k1, k2, k3."
    assert {"seq-mean-token-mean", "seq-mean-token-sum", "token-mean"} <= set(LOSS_AGGREGATIONS.names())


# --------------------------------------------------------------------------------------------- functional


def test_masked_sum_mean_var_whiten() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    # sum over valid = 1 + 2 + 3 = 6 (nan in padding ignored)
    close(masked_sum(x, m), 6.0)
    close(masked_sum(x, m, dim=-1), [6.0, 0.0])
    # per-row means: 6/3 = 2; empty row -> 0 (not nan)
    close(masked_mean(x, m, dim=-1), [2.0, 0.0])
    close(masked_mean(x, m), 2.0)
    # deviations from 2: (-1, 0, 1) -> sum of squares 2; unbiased 2/2 = 1, biased 2/3
    close(masked_var(x, m), 1.0)
    close(masked_var(x, m, unbiased=False), 2.0 / 3.0)
    # whitening: (x - 2) / 1 = (-1, 0, 1); without mean shift: +2 -> (1, 2, 3)
    close(masked_whiten(x, m)[0, :3], [-1.0, 0.0, 1.0])
    close(masked_whiten(x, m, shift_mean=False)[0, :3], [1.0, 2.0, 3.0])


def test_scores_to_token_rewards_ragged_and_empty() -> None:
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor(
        [
            [1, 1, 0, 0],  # last valid token at t=1
            [1, 1, 1, 1],  # t=3
            [0, 0, 0, 0],  # empty -> zeros row
            [0, 1, 1, 0],  # leading padding, last valid at t=2
        ]
    )
    expected = [[0, 1, 0, 0], [0, 0, 0, 2], [0, 0, 0, 0], [0, 0, 4, 0]]
    close(scores_to_token_rewards(scores, mask), expected)
    # integer scores become float32
    out = scores_to_token_rewards(torch.tensor([5, 6]), torch.tensor([[1, 0], [1, 1]]))
    assert out.dtype == torch.float32
    close(out, [[5.0, 0.0], [0.0, 6.0]])


def test_logprobs_and_entropy_match_categorical() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=gen) * 3
    labels = torch.randint(0, 5, (2, 3), generator=gen)
    dist = torch.distributions.Categorical(logits=logits)
    close(logprobs_from_logits(logits, labels), dist.log_prob(labels))
    close(entropy_from_logits(logits), dist.entropy())
    # low-precision input is upcast (row by row) and gives float32 results
    half = logits.bfloat16()
    dist16 = torch.distributions.Categorical(logits=half.float())
    lp16 = logprobs_from_logits(half, labels)
    assert lp16.dtype == torch.float32 and lp16.shape == (2, 3)
    close(lp16, dist16.log_prob(labels))
    close(entropy_from_logits(half), dist16.entropy())


def test_logprobs_gradient() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)]]], requires_grad=True)  # p = (1/4, 3/4)
    lp = logprobs_from_logits(logits, torch.tensor([[1]]))
    close(lp, [[math.log(0.75)]])
    lp.sum().backward()
    assert logits.grad is not None
    # d log p_1 / d logits = onehot(1) - p = (-1/4, 1/4)
    close(logits.grad, [[[-0.25, 0.25]]])


# --------------------------------------------------------------------------------------------- advantages


def test_gae_hand_example() -> None:
    # gamma = 0.9, lam = 0.8 -> gamma * lam = 0.72; rewards (0, 0, 1), values (0.5, 0.4, 0.3)
    # t=2: delta = 1 + 0.9*0   - 0.3 =  0.7   A2 = 0.7
    # t=1: delta = 0 + 0.9*0.3 - 0.4 = -0.13  A1 = -0.13 + 0.72*0.7   = 0.374
    # t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14  A0 = -0.14 + 0.72*0.374 = 0.12928
    # returns = A + V = (0.62928, 0.774, 1.0)
    # whiten: mean = 1.20328/3 = 0.4010933, unbiased var = 0.0819809, std = 0.2863230
    #   -> (-0.9493241, -0.0946251, 1.0439492)
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 0.3]])
    mask = torch.ones(1, 3)
    adv, ret = compute_advantages("gae", token_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=0.8)
    close(ret, [[0.62928, 0.774, 1.0]])
    close(adv, [[-0.9493241, -0.0946251, 1.0439492]])

    # Same response followed by padding with junk reward/value: padding contributes nothing.
    rewards_p = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values_p = torch.tensor([[0.5, 0.4, 0.3, 100.0]])
    mask_p = torch.tensor([[1, 1, 1, 0]])
    adv_p, ret_p = compute_advantages(
        "gae", token_rewards=rewards_p, response_mask=mask_p, values=values_p, gamma=0.9, lam=0.8
    )
    close(ret_p, [[0.62928, 0.774, 1.0, 0.0]])
    close(adv_p, [[-0.9493241, -0.0946251, 1.0439492, 0.0]])


def test_gae_requires_values() -> None:
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", token_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2))


def test_grpo_hand_example() -> None:
    # group 7: scores (1, 0, 2): mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1 -> (0, -1, 1)
    # group -1: size 1, score 3 -> mean 0, std 1 -> 3
    # group 4: scores (0.5, 0.5): std 0 -> (0, 0)
    group_ids = torch.tensor([7, 7, 7, -1, 4, 4])
    scores = torch.tensor([1.0, 0.0, 2.0, 3.0, 0.5, 0.5])
    mask = torch.tensor(
        [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]],
    )
    rewards = scores_to_token_rewards(scores, mask)
    adv, ret = compute_advantages("grpo", token_rewards=rewards, response_mask=mask, group_ids=group_ids)
    per_seq = torch.tensor([0.0, -1.0, 1.0, 3.0, 0.0, 0.0]).unsqueeze(-1)
    close(adv, per_seq * mask, atol=1e-5)
    close(ret, adv)
    # without std normalisation: score - mean; singleton still gives its score
    adv_nostd, _ = compute_advantages(
        "grpo", token_rewards=rewards, response_mask=mask, group_ids=group_ids, norm_by_std=False
    )
    close(adv_nostd, per_seq * mask)
    # non-unit std: group (0, 4) -> mean 2, std sqrt(8) -> -+2/sqrt(8) = -+0.7071068
    adv2, _ = compute_advantages(
        "grpo",
        token_rewards=torch.tensor([[0.0], [4.0]]),
        response_mask=torch.ones(2, 1),
        group_ids=torch.tensor([0, 0]),
    )
    close(adv2, [[-0.7071068], [0.7071068]])


def test_grpo_requires_group_ids() -> None:
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", token_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2))


def _random_ragged_mask(gen: torch.Generator, b: int, t: int) -> torch.Tensor:
    mask = (torch.rand(b, t, generator=gen) > 0.3).long()  # holes allowed
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    mask = mask * (torch.arange(t) < lengths.unsqueeze(-1)).long()  # ragged right padding
    mask[0] = 0  # one empty row
    mask[1] = 1  # one full row
    return mask


def test_gae_matches_slow_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    b, t, gamma, lam = 6, 7, 0.95, 0.9
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64)
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = _random_ragged_mask(gen, b, t)
    adv, ret = compute_advantages("gae", token_rewards=rewards, response_mask=mask, values=values, gamma=gamma, lam=lam)
    raw = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        idx = [j for j in range(t) if mask[i, j]]  # valid tokens only; padding is skipped
        last_adv, next_v = 0.0, 0.0
        for j in reversed(idx):
            delta = float(rewards[i, j]) + gamma * next_v - float(values[i, j])
            last_adv = delta + gamma * lam * last_adv
            raw[i, j] = last_adv
            next_v = float(values[i, j])
    valid = raw[mask.bool()]
    whitened = (raw - valid.mean()) / torch.sqrt(valid.var(unbiased=True) + 1e-8)
    close(ret, (raw + values) * mask)
    close(adv, whitened * mask)


def test_grpo_matches_slow_loop() -> None:
    gen = torch.Generator().manual_seed(2)
    b, t, eps = 12, 5, 1e-6
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = _random_ragged_mask(gen, b, t)
    group_ids = torch.tensor([3, 3, 3, 0, 0, 9, 5, 5, 5, 5, 3, 1])
    adv, _ = compute_advantages("grpo", token_rewards=rewards * mask, response_mask=mask, group_ids=group_ids, eps=eps)
    scores = [float((rewards[i] * mask[i]).sum()) for i in range(b)]
    expected = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        members = [scores[j] for j in range(b) if group_ids[j] == group_ids[i]]
        if len(members) == 1:
            a = scores[i]
        else:
            mean = sum(members) / len(members)
            std = math.sqrt(sum((s - mean) ** 2 for s in members) / (len(members) - 1))
            a = (scores[i] - mean) / (std + eps)
        expected[i] = a * mask[i]
    close(adv, expected)


# ---------------------------------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand() -> None:
    lp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # k1 = lp - ref = (0.5, -1.0); k2 = 0.5 * (0.25, 1.0) = (0.125, 0.5)
    close(kl_penalty(lp, ref, estimator="k1"), [0.5, -1.0])
    close(kl_penalty(lp, ref, estimator="k2"), [0.125, 0.5])
    # k3: r = ref - lp = (-0.5, 1.0); exp(-0.5) + 0.5 - 1 = 0.1065307; exp(1) - 1 - 1 = 0.7182818
    close(kl_penalty(lp, ref), [0.1065307, 0.7182818])
    # clamps: r = -30 -> -20: exp(-20) + 20 - 1 ~ 19 -> 10; r = +30 -> 20: exp(20) - 21 -> 10; r = 0 -> 0
    close(kl_penalty(torch.tensor([0.0, 0.0, -3.0]), torch.tensor([-30.0, 30.0, -3.0])), [10.0, 10.0, 0.0])
    with pytest.raises(ValueError, match="Did you mean 'k3'"):
        kl_penalty(lp, ref, estimator="k33")


# ------------------------------------------------------------------------------------------------ losses


def test_aggregations_ragged() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5; with num_tokens = 5 -> 2.0; num_tokens = 0 -> clamp 1 -> 10
    close(aggregate_loss(loss, mask), 2.5)
    close(aggregate_loss(loss, mask, num_tokens=5), 2.0)
    close(aggregate_loss(loss, mask, num_tokens=torch.tensor(5)), 2.0)
    close(aggregate_loss(loss, mask, num_tokens=0.0), 10.0)
    # seq-mean-token-sum: per-seq sums (6, 4, 0), mean over 3 seqs = 10/3
    close(aggregate_loss(loss, mask, mode="seq-mean-token-sum"), 10.0 / 3.0)
    # seq-mean-token-mean: per-seq means (2, 4, -), mean over non-empty seqs = 3
    close(aggregate_loss(loss, mask, mode="seq-mean-token-mean"), 3.0)
    # all empty -> 0, not nan
    close(aggregate_loss(loss, torch.zeros(3, 3), mode="seq-mean-token-mean"), 0.0)
    close(aggregate_loss(loss, torch.zeros(3, 3)), 0.0)


def test_policy_loss_clipped_both_sides() -> None:
    # tokens: (A=+1, r=1.5), (A=+1, r=0.5), (A=-1, r=1.5), (A=-1, r=0.5), padding; clip 0.2
    # a: max(-1.5, -1.2) = -1.2 clipped | b: max(-0.5, -0.8) = -0.5
    # c: max( 1.5,  1.2) =  1.5         | d: max( 0.5,  0.8) =  0.8 clipped
    # token-mean = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15; clipfrac = 2/4
    # ppo_kl = mean(-log r) = -(2 log 1.5 + 2 log 0.5) / 4 = -log(0.75) / 2 = 0.1438410
    ratios = torch.tensor([[1.5, 0.5, 1.5, 0.5, 9.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.0, -1.0]])
    logprobs = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = policy_loss_clipped(logprobs, old, adv, mask)
    close(loss, 0.15)
    close(metrics["pg_clipfrac"], 0.5)
    close(metrics["ppo_kl"], -math.log(0.75) / 2)
    assert all(m.ndim == 0 and not m.requires_grad for m in metrics.values())
    loss.backward()
    assert logprobs.grad is not None
    # d/dlp (-A r) = -A r on unclipped tokens, 0 on clipped ones; divided by 4 tokens
    close(logprobs.grad, [[0.0, -0.5 / 4, 1.5 / 4, 0.0, 0.0]])
    # asymmetric clip: a -> -1.28 (clip_high 0.28), d -> 0.9 (clip_low 0.1)
    loss2, _ = policy_loss_clipped(logprobs.detach(), old, adv, mask, clip_low=0.1, clip_high=0.28)
    close(loss2, (-1.28 - 0.5 + 1.5 + 0.9) / 4)
    # seq-mean-token-sum over the single sequence = sum of token losses = 0.6
    loss3, _ = policy_loss_clipped(logprobs.detach(), old, adv, mask, agg="seq-mean-token-sum")
    close(loss3, 0.6)


def test_value_loss_clipped() -> None:
    # clip 0.2
    # t0: v=1.0, old=0.5, R=2: v_clip = 0.7; max((1-2)^2 = 1, (0.7-2)^2 = 1.69) = 1.69 clipped -> 0.845
    # t1: v=1.0, old=0.9, R=0: within clip; both 1 -> 0.5 (not strictly larger)
    # t2: v=2.0, old=0.5, R=0: v_clip = 0.7; max(4, 0.49) = 4 -> 2.0
    # padding t3 ignored. mean = (0.845 + 0.5 + 2.0) / 3 = 1.115; clipfrac = 1/3
    values = torch.tensor([[1.0, 1.0, 2.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.9, 0.5, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss_clipped(values, old, returns, mask)
    close(loss, 1.115)
    close(metrics["vf_clipfrac"], 1.0 / 3.0)
    loss.backward()
    assert values.grad is not None
    # grads: t0 clipped (no grad through clamp) 0; t1 (v - R)/3 = 1/3; t2 (v - R)/3 = 2/3
    close(values.grad, [[0.0, 1.0 / 3.0, 2.0 / 3.0, 0.0]])
