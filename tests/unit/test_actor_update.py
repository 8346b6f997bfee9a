"""The actor's update on one process (no sharding): on-policy shortcut, off-policy guard, weight hand-off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

import lightning_rlhf.engines.hybrid as hybrid_module
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig
from lightning_rlhf.config.settings import flat_names
from lightning_rlhf.engines.rollout import HFRolloutEngine
from lightning_rlhf.roles import ActorRole


def grouped(flat: dict) -> dict:
    """``AlgorithmConfig`` keywords for settings given by their flat names (``ppo_epochs`` -> ``batching``)."""
    groups: dict = {}
    for key, value in flat.items():
        group, name = flat_names(AlgorithmConfig)[key]
        groups.setdefault(group, {})[name] = value
    return groups


def make_actor(path: str, **algo) -> ActorRole:
    tok = AutoTokenizer.from_pretrained(path)
    role = ActorRole(
        path,
        tokenizer=tok,
        rollout=RolloutConfig(n=2),
        algorithm=AlgorithmConfig(**grouped({"micro_batch_size": 3} | algo)),
        optim=OptimConfig(lr=1e-2),
    )
    role.load()
    role.configure_optimizer(total_steps=10)
    return role


def rollout_batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    return Batch(
        {
            "prompts": torch.randint(4, 18, (6, 3), generator=g),
            "prompt_mask": torch.ones(6, 3, dtype=torch.long),
            "responses": torch.randint(4, 18, (6, 4), generator=g) * mask,
            "response_mask": mask,
            "advantages": torch.randn(6, 1, generator=g).expand(6, 4) * mask,
        }
    )


def test_on_policy_update_without_old_logprobs_equals_the_two_pass_update(tiny_model: str) -> None:
    a, b = make_actor(tiny_model), make_actor(tiny_model)
    two_pass = a.log_prob(rollout_batch())
    assert two_pass["old_logprobs"].shape == (6, 4)
    ma = a.update(two_pass)
    mb = b.update(rollout_batch())
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=name)
    assert ma["actor/pg_loss"] == pytest.approx(mb["actor/pg_loss"], abs=1e-6)
    assert ma["actor/grad_norm"] > 0


def test_off_policy_update_needs_old_logprobs(tiny_model: str) -> None:
    actor = make_actor(tiny_model, ppo_epochs=2)
    with pytest.raises(KeyError, match="`old_logprobs` missing and the update is off-policy"):
        actor.update(rollout_batch())


def test_weights_reach_the_engine_only_after_an_update(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    actor = make_actor(tiny_model)
    tok = actor.tokenizer
    actor.attach_engine(
        HFRolloutEngine(
            actor.model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device=torch.device("cpu")
        )
    )
    assert actor.hybrid.sync() == (0.0, 0)  # nothing changed yet
    actor.update(rollout_batch())
    # The hand-off is timed with the hybrid engine's clock: a scripted one makes its seconds known exactly.
    readings = iter([100.0, 102.5, 200.0, 200.25])
    monkeypatch.setattr(hybrid_module, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    seconds, received = actor.hybrid.sync()
    assert received == 0  # one unsharded process: nothing comes from other ranks
    assert seconds == 2.5 - actor.hybrid.wait_s  # one reading before the hand-off, one after
    assert actor.hybrid.verify_s == 0.25 and next(readings, None) is None  # then two around its check
    monkeypatch.undo()
    for (name, p), q in zip(actor.model.named_parameters(), actor.rollout_engine.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    assert actor.hybrid.sync() == (0.0, 0)


@pytest.mark.parametrize(
    ("loss", "agg"),
    [
        ("dual_clip", "token-mean"),
        ("gspo", "seq-mean-token-sum-norm"),
        ("cispo", "token-mean"),
        ("sapo", "seq-mean-token-mean"),
        ("gpg", "token-mean"),
        ("dppo_kl", "token-mean"),
        ("dppo_tv", "token-mean"),
    ],
)
def test_registered_policy_losses_train(tiny_model: str, loss: str, agg: str) -> None:
    actor = make_actor(tiny_model, policy_loss=loss, loss_agg=agg)
    before = [p.detach().clone() for p in actor.model.parameters()]
    metrics = actor.update(rollout_batch())
    assert metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, actor.model.parameters(), strict=True))


def test_loss_mask_excludes_tokens_from_the_update(tiny_model: str) -> None:
    actor = make_actor(tiny_model)
    batch = rollout_batch()
    batch["loss_mask"] = torch.zeros_like(batch["response_mask"])  # e.g. every response truncated (DAPO)
    before = [p.detach().clone() for p in actor.model.parameters()]
    metrics = actor.update(batch)
    assert metrics["actor/grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, actor.model.parameters(), strict=True))
