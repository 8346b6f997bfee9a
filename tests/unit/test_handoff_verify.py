"""Every weight hand-off is checked: a fingerprint of what the engine holds (sums of a few rows of every tensor) is
compared with one computed from the trainer's weights, so a hand-off that delivers the right names with wrong data,
or an engine that kept its old weights, fails at that step naming the tensor. Real transformers engines, tiny
models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor
from transformers import AutoTokenizer

import lightning_rlhf.engines.hybrid as hybrid_module
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, BatchingConfig, OptimConfig, RolloutConfig
from lightning_rlhf.engines.rollout import HFRolloutEngine, SamplingParams
from lightning_rlhf.engines.rollout.base import WeightSyncError, check_fingerprints, tensor_fingerprints
from lightning_rlhf.engines.rollout.reshard import TPSlice, shard_fingerprints
from lightning_rlhf.engines.train.lora import resolve_lora, unadapted_copy
from lightning_rlhf.roles import ActorRole
from tests.unit.test_actor_update import rollout_batch

DROPPED = "model.layers.0.mlp.down_proj.weight"


def _actor(path: str, *, verify_every: int = 1, lora: dict[str, Any] | None = None) -> ActorRole:
    tok = AutoTokenizer.from_pretrained(path)
    actor = ActorRole(
        path,
        tokenizer=tok,
        rollout=RolloutConfig(n=2, max_new_tokens=4, verify_every=verify_every),
        algorithm=AlgorithmConfig(batching=BatchingConfig(micro_batch_size=3)),
        optim=OptimConfig(lr=1e-2),
        lora=resolve_lora(lora, setting="lora", task_type="CAUSAL_LM"),
    )
    actor.load()
    actor.configure_optimizer(total_steps=10)
    actor.attach_engine(
        HFRolloutEngine(
            actor.model if lora is None else unadapted_copy(actor.model),
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            device=torch.device("cpu"),
        )
    )
    return actor


def _prompts() -> Batch:
    return Batch({"prompts": torch.tensor([[5, 6, 7], [8, 9, 10]]), "prompt_mask": torch.ones(2, 3, dtype=torch.long)})


def _zeroing(real: Any) -> Any:
    """``weights_for`` whose stream carries :data:`DROPPED` under its own name but with zeros: only the data is lost,
    so the names' check (``HandoffCheck``) passes."""

    def weights_for(*args: Any, **kwargs: Any) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in real(*args, **kwargs):
            yield name, torch.zeros_like(tensor) if name == DROPPED else tensor

    return weights_for


def test_a_hand_off_that_loses_one_tensors_data_fails_at_that_step(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    actor = _actor(tiny_model)
    actor.generate(_prompts())  # the engine was built from the actor: nothing to hand over, nothing to check
    actor.update(rollout_batch())
    monkeypatch.setattr(hybrid_module, "weights_for", _zeroing(hybrid_module.weights_for))
    with pytest.raises(WeightSyncError, match=f"holds other values than the trainer in '{DROPPED}'"):
        actor.generate(_prompts())
    with pytest.raises(WeightSyncError, match="holds no valid weights"):  # and it refuses to generate with them
        actor.rollout_engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))


def test_an_engine_that_kept_its_old_weights_fails_at_that_step(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    actor = _actor(tiny_model)
    engine = actor.rollout_engine
    actor.update(rollout_batch())
    # A wake that says it holds the new weights (weights_discarded stays False) but restored the old ones: the
    # hand-off reaches nothing.
    monkeypatch.setattr(engine, "load_weights", lambda weights: 0)
    with pytest.raises(WeightSyncError, match=r"holds other values than the trainer in 'model\."):
        actor.generate(_prompts())


def test_verify_every_thins_the_checks_and_zero_turns_them_off(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    actor = _actor(tiny_model, verify_every=2)
    actor.update(rollout_batch())
    actor.generate(_prompts())  # hand-off 1: checked, and right
    assert actor.hybrid.verify_s > 0
    monkeypatch.setattr(hybrid_module, "weights_for", _zeroing(hybrid_module.weights_for))
    actor.update(rollout_batch(1))
    actor.generate(_prompts())  # hand-off 2: not checked, so the loss goes unseen
    assert actor.hybrid.verify_s == 0
    actor.update(rollout_batch(2))
    with pytest.raises(WeightSyncError, match=DROPPED):  # hand-off 3: checked
        actor.generate(_prompts())

    off = _actor(tiny_model, verify_every=0)
    off.update(rollout_batch())
    off.generate(_prompts())
    assert off.hybrid.verify_s == 0
    with pytest.raises(ValueError, match=r"RolloutConfig.verify_every=-1 is invalid: expected an integer >= 0"):
        RolloutConfig(verify_every=-1)


def test_a_lora_hand_off_fingerprints_the_merged_weights_only_when_it_is_checked(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merged stream is fingerprinted on the way (``_tapped``) on the hand-offs ``verify_every`` checks only:
    with ``verify_every=2``, the 1st and the 3rd."""
    calls = [0]
    real = hybrid_module.part_sums  # the fingerprint's sums, which only the tap computes in this module

    def counted(*args: Any, **kwargs: Any) -> Tensor:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(hybrid_module, "part_sums", counted)
    actor = _actor(tiny_model, verify_every=2, lora={"r": 4})
    seen = []
    for step in range(3):
        actor.update(rollout_batch(step))
        before = calls[0]
        actor.generate(_prompts())
        seen.append((calls[0] > before, actor.hybrid.verify_s > 0))
    assert seen == [(True, True), (False, False), (True, True)]


def test_the_trainers_fingerprint_of_a_tp_slice_is_the_slices_own() -> None:
    """One process: the trainer's side (rows it holds, cut to a TP rank's region, numbered in the slice) equals the
    engine's sums of the slice it holds, for a row block and a column block; a changed value in a summed row is
    caught, with its TP rank named."""
    model = torch.nn.Linear(8, 12, bias=True)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    regions = {"weight": [TPSlice(0, 2, 6), TPSlice(1, 4, 4)], "bias": [TPSlice(0, 6, 6), None]}
    for tp_rank in range(2):
        # one process plays TP rank `tp_rank` (tp_size 1 asks for region 0 of a slicer that gives that rank's)
        want = shard_fingerprints(model, dtype=torch.float32, slicer=lambda n, s, _, r=tp_rank: regions[n][r])
        held = {}
        for name, param in model.named_parameters():
            region = regions[name][tp_rank]
            part = param.data if region is None else param.data.narrow(region.dim, region.start, region.length)
            held[name] = part
        assert want["weight"][0] == ([(0, 1), (3, 4), (5, 6)] if tp_rank == 0 else [(0, 1), (6, 7), (11, 12)])
        assert want["bias"][0][-1] == ((0, 6) if tp_rank == 0 else (0, 12))  # a 1-D tensor is summed whole too
        ranges = {name: rows for name, (rows, _) in want.items()}
        check_fingerprints("E", want, tensor_fingerprints(held, ranges), rtol=1e-12, tp_rank=tp_rank)
        held["weight"] = held["weight"].clone()
        held["weight"][ranges["weight"][1][0], 0] += 1e-3  # the middle summed row
        where = "engine on TP rank 1" if tp_rank else "engine"
        with pytest.raises(WeightSyncError, match=f"{where} holds other values than the trainer in 'weight'"):
            check_fingerprints("E", want, tensor_fingerprints(held, ranges), rtol=1e-9, tp_rank=tp_rank)


def test_a_generation_only_pool_checks_what_it_received(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's side of a bridge hand-off (the broadcast replaced by a local stream): the header's fingerprints,
    made from the trainer's rows, catch a tensor whose data was lost on the way; the intact hand-off passes and
    records the version."""
    from transformers import AutoModelForCausalLM

    from lightning_rlhf.engines.hybrid import HybridEngine
    from lightning_rlhf.engines.rollout.bridge import WeightBridge, WeightHeader
    from lightning_rlhf.engines.rollout.reshard import shard_fingerprints

    trainer = AutoModelForCausalLM.from_pretrained(tiny_model)
    pool = HybridEngine(rollout=RolloutConfig(), tokenizer=None, model_path=tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    pool.engine = HFRolloutEngine(  # a copy of the trainer's weights, which the hand-off then replaces
        trainer,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        device=torch.device("cpu"),
    )
    header = WeightHeader(send=True, version=3, fingerprints=shard_fingerprints(trainer, dtype=torch.float32))

    def received(lose: str | None) -> Any:
        stream = ((n, torch.zeros_like(t) if n == lose else t.detach()) for n, t in trainer.named_parameters())
        return lambda bridge, device: (header, stream)

    bridge = WeightBridge(group=None, src=0)
    monkeypatch.setattr(hybrid_module, "receive_weights", received(DROPPED))
    with pytest.raises(WeightSyncError, match=f"holds other values than the trainer in '{DROPPED}'"):
        pool.receive(bridge)
    monkeypatch.setattr(hybrid_module, "receive_weights", received(None))
    metrics = pool.receive(bridge)
    assert pool.engine_version == 3 and metrics["perf/weight_verify_s"] > 0


def test_the_trainers_fingerprints_follow_new_values_and_new_parameters() -> None:
    """Which rows to read is planned once per model; the values are read at every call, and a parameter replaced by
    a new object (a reload) makes a new plan."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    first = shard_fingerprints(model, dtype=torch.float32)
    with torch.no_grad():
        model[0].weight.mul_(2)  # in place: the same parameter object
    doubled = shard_fingerprints(model, dtype=torch.float32)
    assert torch.allclose(doubled["0.weight"][1], 2 * first["0.weight"][1])
    assert torch.equal(doubled["1.weight"][1], first["1.weight"][1])
    model[1].weight = torch.nn.Parameter(torch.zeros(3, 6))  # a new object
    replaced = shard_fingerprints(model, dtype=torch.float32)
    assert torch.equal(replaced["1.weight"][1], torch.zeros(6))  # three rows' sums, then their absolute sums
