"""The order of a rollout's memory phases (docs/hybrid-engine.md, "Memory phases"), on one process with a real
transformers engine: the engine's weights wake alone, take the hand-off, the trainer releases what the hand-off
gathered, and only then the KV cache wakes, the engine generates and goes back to sleep."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, BatchingConfig, OptimConfig, RolloutConfig
from lightning_rlhf.engines.rollout import HFRolloutEngine
from lightning_rlhf.engines.rollout.base import MEMORY_TAGS, check_prompt_tokens, wake_tags
from lightning_rlhf.roles import ActorRole


def _actor_with_engine(path: str) -> ActorRole:
    tok = AutoTokenizer.from_pretrained(path)
    actor = ActorRole(
        path,
        tokenizer=tok,
        rollout=RolloutConfig(n=2, max_new_tokens=4),
        algorithm=AlgorithmConfig(batching=BatchingConfig(micro_batch_size=2)),
        optim=OptimConfig(lr=1e-2),
    )
    actor.load()
    actor.configure_optimizer(total_steps=10)
    actor.attach_engine(
        HFRolloutEngine(
            actor.model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device=torch.device("cpu")
        )
    )
    return actor


def _prompts(tok: Any) -> Batch:
    ids = [tok("3+4=")["input_ids"], tok("12+1=")["input_ids"]]
    width = max(len(p) for p in ids)
    prompts = torch.full((len(ids), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, p in enumerate(ids):  # left-padded, as the data module gives them
        prompts[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return Batch({"prompts": prompts, "prompt_mask": mask, "uid": torch.arange(len(ids))})


def _record(calls: list[str], owner: Any, name: str, label: Any) -> None:
    """Wrap ``owner.name`` (an instance attribute shadows the real bound method, which still runs) so that each call
    appends ``label(*args, **kwargs)`` to ``calls``."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(label(*args, **kwargs))
        return real(*args, **kwargs)

    setattr(owner, name, recorded)


def _wake_label(tags: Any = None) -> str:
    return "wake:" + ("all" if tags is None else "+".join(tags))


def test_generate_runs_the_memory_phases_in_the_order_that_keeps_one_copy(tiny_model: str) -> None:
    actor = _actor_with_engine(tiny_model)
    engine = actor.rollout_engine
    actor.mark_weights_changed()  # as after an update: this rollout hands the weights over
    calls: list[str] = []
    _record(calls, engine, "wake_up", _wake_label)
    _record(calls, engine, "load_weights", lambda *a, **k: "handoff")
    _record(calls, actor.hybrid, "release_device_memory", lambda: "release")
    _record(calls, engine, "generate", lambda *a, **k: "generate")
    _record(calls, engine, "sleep", lambda: "sleep")

    rollout = actor.generate(_prompts(actor.tokenizer))

    assert len(rollout) == 4 and rollout["responses"].shape[0] == 4  # n=2 samples of 2 prompts: a real rollout
    assert calls == [
        "release",  # the optimizer state offloaded (where the engine asks) and the update's leftovers returned
        "wake:weights",
        "handoff",
        "release",  # the hand-off's gathered tensors, before the KV cache takes its memory
        "wake:kv_cache",
        "generate",
        "sleep",
    ]
    for (name, p), q in zip(actor.model.named_parameters(), engine.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)  # the hand-off really happened

    calls.clear()  # weights unchanged: no hand-off, the same phases otherwise
    actor.generate(_prompts(actor.tokenizer))
    assert calls == ["release", "wake:weights", "release", "wake:kv_cache", "generate", "sleep"]


def test_wake_tags_are_checked_by_every_engine(tiny_model: str) -> None:
    assert wake_tags(None, owner="E") == MEMORY_TAGS == ("weights", "kv_cache")
    assert wake_tags(["kv_cache", "weights"], owner="E") == MEMORY_TAGS  # in phase order, whatever was asked
    assert wake_tags((), owner="E") == ()
    engine = _actor_with_engine(tiny_model).rollout_engine
    engine.wake_up(tags=["kv_cache"])  # accepted: the transformers engine keeps no KV cache between calls
    with pytest.raises(ValueError, match=r"HFRolloutEngine.wake_up\(tags=\['weight'\]\): unknown memory tags "):
        engine.wake_up(tags=["weight"])
    with pytest.raises(ValueError, match=r"one string. HINT: wake_up\(tags=\['weights'\]\)"):
        engine.wake_up(tags="weights")


def test_prompts_vllm_would_fail_on_inside_generation_are_refused_first() -> None:
    check_prompt_tokens([[1, 2], [0, 9]], vocab_size=10, engine="E")  # ids 0..9 of 10: fine
    check_prompt_tokens([[1, 2_000_000]], vocab_size=None, engine="E")  # no vocabulary known: only emptiness
    with pytest.raises(ValueError, match=r"E.generate: prompt 1 of 2 has no tokens; vLLM refuses an empty prompt"):
        check_prompt_tokens([[1], []], vocab_size=10, engine="E")
    with pytest.raises(ValueError, match=r"prompt 0 holds token id 10, outside the model's vocabulary of 10 ids"):
        check_prompt_tokens([[3, 10, 2]], vocab_size=10, engine="E")
    with pytest.raises(ValueError, match=r"token id -1, .*HINT: tokenize with the tokenizer the model was saved"):
        check_prompt_tokens([[3, -1]], vocab_size=10, engine="E")
