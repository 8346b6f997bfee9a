"""Activation checkpointing (``RLHFModule(activation_checkpointing=...)``): a checkpointed update equals the plain one
(fp32, the same gradient norm and the same weights after the step), on the shared-prefix forward too, whose
attention the recompute in the backward must see again. Real tiny transformers models."""

from __future__ import annotations

import pytest
import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.engines.train.prefix import shares_prompts
from lightning_rlhf.module import _checkpointed_roles
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
