"""Activation checkpointing (``RLHFModule(activation_checkpointing=...)``): a checkpointed update equals the plain one
(fp32, the same gradient norm and the same weights after the step), on the shared-prefix forward too, whose
attention the recompute in the backward must see again, with LoRA adapters and for the critic. Real tiny
transformers models."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig
from lightning_rlhf.engines.train.lora import resolve_lora
from lightning_rlhf.engines.train.prefix import shares_prompts
from lightning_rlhf.module import _checkpointed_roles
from lightning_rlhf.roles import ActorRole, CriticRole
from tests.unit.test_actor_update import make_actor, rollout_batch


def grouped_batch() -> Batch:
    """The update test's batch with rows 2k and 2k+1 sharing their prompt: groups of 2 (the shared-prefix layout)."""
    data = dict(rollout_batch().tensors)
    data["prompts"] = data["prompts"].clone()
    data["prompts"][1::2] = data["prompts"][0::2]
    return Batch(data, meta={"group_size": 2})


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_a_checkpointed_update_equals_the_plain_one(tiny_model: str, shared_prefix: bool) -> None:
    plain = make_actor(tiny_model, shared_prefix=shared_prefix, micro_batch_size=2)  # whole groups per micro-batch
    checkpointed = make_actor(tiny_model, shared_prefix=shared_prefix, micro_batch_size=2)
    checkpointed.train_engine.activation_checkpointing = True
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.model.modules())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in plain.model.modules())
    assert shares_prompts(checkpointed.model, grouped_batch(), 2)  # the packed forward runs when it is on
    want, got = plain.update(grouped_batch()), checkpointed.update(grouped_batch())
    assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
    assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], rel=1e-5, abs=1e-7)
    for (name, a), (_, b) in zip(plain.model.named_parameters(), checkpointed.model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_the_setting_names_roles_or_takes_the_trained_ones() -> None:
    roles = {"actor": None, "critic": None, "reference": None}
    assert _checkpointed_roles(True, roles) == {"actor", "critic"}
    assert _checkpointed_roles(False, roles) == set()
    assert _checkpointed_roles(["critic"], roles) == {"critic"}
    with pytest.raises(ValueError, match=r"activation_checkpointing=\['critc'\]\) names \['critc'\], not roles"):
        _checkpointed_roles(["critc"], roles)


def _perturbed_adapters(role: Any) -> None:
    """Give every ``lora_B`` the same non-zero values (they start at zero, which makes ``lora_A``'s gradient zero)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in role.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)


def test_a_checkpointed_lora_update_equals_the_plain_one(tiny_model: str) -> None:
    """peft's frozen embedding gives the checkpointed blocks inputs that need no gradient: the adapters inside them
    still get theirs (every adapter moves, ``lora_A`` included once ``lora_B`` is not zero), equal to the plain
    update's."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    lora = resolve_lora({"r": 4}, setting="RLHFModule(lora=...)", task_type="CAUSAL_LM")
    actors = []
    for checkpointing in (False, True):
        actor = ActorRole(
            tiny_model, tokenizer=tok, rollout=RolloutConfig(n=2), lora=lora,
            algorithm=AlgorithmConfig(micro_batch_size=2), optim=OptimConfig(lr=1e-2),
        )  # fmt: skip
        actor.load()
        actor.train_engine.activation_checkpointing = checkpointing
        actor.configure_optimizer(total_steps=10)
        _perturbed_adapters(actor)
        actors.append(actor)
    plain, checkpointed = actors
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.model.modules())
    before = {n: p.detach().clone() for n, p in checkpointed.model.named_parameters() if p.requires_grad}
    want, got = plain.update(rollout_batch()), checkpointed.update(rollout_batch())
    assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
    assert want["actor/grad_norm"] > 0
    trained = dict(checkpointed.model.named_parameters())
    for name, a in plain.model.named_parameters():
        torch.testing.assert_close(trained[name], a, rtol=1e-5, atol=1e-6, msg=name)
    moved = [n for n, p in before.items() if not torch.equal(p, trained[n])]
    assert len(moved) == len(before) and any("lora_A" in n for n in moved)  # every adapter had a gradient


def test_a_checkpointed_critic_gives_the_same_values_and_update(tiny_model: str) -> None:
    critics = []
    for checkpointing in (False, True):
        critic = CriticRole(tiny_model, algorithm=AlgorithmConfig(micro_batch_size=2), optim=OptimConfig(lr=1e-2))
        torch.manual_seed(0)  # the value head is new: the same initial values in both
        critic.load()
        critic.train_engine.activation_checkpointing = checkpointing
        critic.configure_optimizer(total_steps=10)
        critics.append(critic)
    plain, checkpointed = critics
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.model.modules())
    batch = rollout_batch()
    values = plain.values(Batch(dict(batch.tensors)))["values"]
    torch.testing.assert_close(checkpointed.values(Batch(dict(batch.tensors)))["values"], values, rtol=0, atol=0)
    scored = Batch(dict(batch.tensors) | {"values": values, "returns": values + torch.randn(values.shape)})
    want, got = plain.update(scored), checkpointed.update(scored)
    assert got["critic/vf_loss"] == pytest.approx(want["critic/vf_loss"], rel=1e-6)
    assert got["critic/grad_norm"] == pytest.approx(want["critic/grad_norm"], rel=1e-5) and want["critic/grad_norm"] > 0
    trained = dict(checkpointed.model.named_parameters())
    for name, a in plain.model.named_parameters():
        torch.testing.assert_close(trained[name], a, rtol=1e-5, atol=1e-6, msg=name)
