"""The rollout-mismatch masks (token, sequence, geometric mean) and metrics: known values on tiny tensors, no
gradient through a masked token, the metrics of an update, and the settings refused with their fix."""

from __future__ import annotations

import math

import pytest
import torch

import lightning_rlhf.roles.actor as actor_module
from lightning_rlhf.algorithms import compute_policy_loss, mismatch_metrics, rollout_log_ratio, rollout_mask
from lightning_rlhf.config import AlgorithmConfig, AsyncConfig
from tests.unit.test_actor_update import make_actor, rollout_batch

# Token ratios pi_old / pi_rollout: row 0 is 2, 1, 0.5 (product 1), row 1 is 1, 3 and a padded token (product 3,
# geometric mean sqrt(3)), row 2 is 1.2 three times (product 1.728, geometric mean 1.2).
RATIOS = torch.tensor([[2.0, 1.0, 0.5], [1.0, 3.0, 1.0], [1.2, 1.2, 1.2]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ROLLOUT = torch.log(torch.full((3, 3), 0.1))
OLD = ROLLOUT + torch.log(RATIOS)


def keep(mode: str, low: float, high: float) -> list[list[float]]:
    return rollout_mask(rollout_log_ratio(OLD, ROLLOUT, MASK), MASK, mode=mode, low=low, high=high).tolist()


def test_token_mask_leaves_out_each_token_out_of_bounds() -> None:
    assert keep("token", 0.6, 2.5) == [[1, 1, 0], [1, 0, 1], [1, 1, 1]]  # 0.5 and 3 out; the padded token is kept


def test_sequence_mask_bounds_the_product_of_the_ratios() -> None:
    assert keep("sequence", 0.5, 1.5) == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]  # 3 and 1.728 above 1.5
    assert keep("sequence", 0.0, 3.5) == [[1, 1, 1]] * 3  # low 0: no lower bound


def test_geometric_mask_bounds_the_geometric_mean_which_does_not_grow_with_length() -> None:
    assert keep("geometric", 0.9, 1.5) == [[1, 1, 1], [0, 0, 1], [1, 1, 1]]  # sqrt(3) out, 1.2 in (product 1.728)
    assert keep("geometric", 0.9, 1.1) == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    with pytest.raises(ValueError, match=r"rollout_mask='tokens': expected one of \['token', 'sequence'"):
        keep("tokens", 0.5, 2.0)


def test_mismatch_metrics_known_values() -> None:
    log_ratio = rollout_log_ratio(OLD[:2], ROLLOUT[:2], MASK[:2])
    kept = rollout_mask(log_ratio, MASK[:2], mode="token", low=0.6, high=2.5)
    out = {k: float(v) for k, v in mismatch_metrics(log_ratio, MASK[:2], kept).items()}
    r = [2.0, 1.0, 0.5, 1.0, 3.0]  # the five response tokens
    assert out["mismatch_kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 5, rel=1e-5)
    assert out["ess"] == pytest.approx(sum(r) ** 2 / (5 * sum(x * x for x in r)), rel=1e-5)  # 56.25 / 76.25
    assert out["ratio_max"] == pytest.approx(3.0, rel=1e-5)
    assert out["masked_fraction"] == pytest.approx(2 / 5)
    assert float(mismatch_metrics(log_ratio, MASK[:2])["masked_fraction"]) == 0  # no mask
    same = mismatch_metrics(torch.zeros(2, 3), MASK[:2])
    assert float(same["ess"]) == pytest.approx(1.0) and float(same["mismatch_kl"]) == 0
    assert mismatch_metrics(log_ratio, torch.zeros(2, 3)) == {}


def test_a_masked_token_gets_no_gradient_and_still_counts_in_the_token_mean() -> None:
    logprobs = torch.log(torch.tensor([[0.6, 0.2, 0.5]])).requires_grad_()
    old = torch.log(torch.tensor([[0.5, 0.25, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 0.5]])
    kept = torch.tensor([[1.0, 0.0, 1.0]])
    loss, _ = compute_policy_loss("vanilla", logprobs, old, adv * kept, torch.ones(1, 3), num_tokens=3)
    loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad[0, 1] == 0 and logprobs.grad[0, 0] != 0 and logprobs.grad[0, 2] != 0
    full, _ = compute_policy_loss("vanilla", logprobs.detach(), old, adv, torch.ones(1, 3), num_tokens=3)
    ratio = torch.exp(logprobs.detach() - old)
    masked_term = float(torch.maximum(adv * -ratio, -adv * ratio.clamp(0.8, 1.2))[0, 1])
    assert float(loss.detach()) == pytest.approx(float(full) - masked_term / 3, rel=1e-6)  # denominator 3, not 2


def _with_engine_gap(actor: actor_module.ActorRole, gap: float) -> dict:
    """A rollout whose engine log-probs are ``gap`` nats below the trainer's on every token (ratio e^gap)."""
    batch = rollout_batch()
    batch["rollout_logprobs"] = actor.log_prob(rollout_batch())["old_logprobs"] - gap
    return batch


def test_an_update_logs_the_mismatch_metrics_without_a_mask(tiny_model: str) -> None:
    actor = make_actor(tiny_model)
    metrics = actor.update(_with_engine_gap(actor, 0.1))
    assert metrics["rollout/mismatch_kl"] == pytest.approx(math.exp(0.1) - 1 - 0.1, rel=1e-3)
    assert metrics["rollout/ess"] == pytest.approx(1.0, abs=1e-5)  # every ratio the same
    assert metrics["rollout/ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-4)
    assert metrics["rollout/masked_fraction"] == 0
    assert metrics["actor/grad_norm"] > 0 and "actor/mismatch_kl" not in metrics
    assert not any(k.startswith("rollout/") for k in make_actor(tiny_model).update(rollout_batch()))  # no engine


def test_a_fully_masked_update_trains_nothing(tiny_model: str) -> None:
    actor = make_actor(tiny_model, rollout_mask="geometric")  # SkyRL's bounds 0.99 .. 1.01; every ratio is 1.105
    before = [p.detach().clone() for p in actor.model.parameters()]
    metrics = actor.update(_with_engine_gap(actor, 0.1))
    assert metrics["rollout/masked_fraction"] == 1.0
    assert metrics["actor/grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, actor.model.parameters(), strict=True))
    loose = make_actor(tiny_model, rollout_mask="geometric", rollout_mask_high=1.2)
    kept = loose.update(_with_engine_gap(loose, 0.1))
    assert kept["rollout/masked_fraction"] == 0 and kept["actor/grad_norm"] > 0


def test_mask_settings_defaults_and_refusals(monkeypatch: pytest.MonkeyPatch, tiny_model: str) -> None:
    assert AsyncConfig().rollout_mask == "none"
    assert AsyncConfig(rollout_mask="token").rollout_mask_bounds == (0.125, 8.0)
    assert AsyncConfig(rollout_mask="sequence").rollout_mask_bounds == (0.0, 3.0)
    assert AsyncConfig(rollout_mask="geometric", rollout_mask_low=0.9).rollout_mask_bounds == (0.9, 1.01)
    with pytest.raises(ValueError, match=r"AsyncConfig.rollout_mask='seq' is invalid: expected one of 'none', "):
        AlgorithmConfig(asynchronous=AsyncConfig(rollout_mask="seq"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rollout_mask_low=1.0 is invalid: expected a bound in \[0, 1\)"):
        AsyncConfig(rollout_mask="token", rollout_mask_low=1.0)
    with pytest.raises(ValueError, match=r"rollout_mask_high=2.0 is invalid: expected None with rollout_mask='none'"):
        AsyncConfig(rollout_mask_high=2.0)
    with pytest.raises(ValueError, match=r"rollout_mask_low='0.5' is invalid: expected None .* or a number"):
        AsyncConfig(rollout_mask="token", rollout_mask_low="0.5")  # type: ignore[arg-type]
    monkeypatch.setattr(actor_module, "ZERO_AT_ZERO_ADVANTAGE", frozenset({"gspo"}))
    with pytest.raises(ValueError, match=r"rollout_mask='token' with loss.policy_loss='vanilla'.*HINT"):
        make_actor(tiny_model, rollout_mask="token")
