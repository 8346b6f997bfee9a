"""The memory and hand-off figures: each rank's peak resident memory (not rank 0's size at the end of a step), and
the bytes an engine takes in a weight hand-off (not only what rank 0 gathered from the other ranks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from lightning_rlhf import perf
from lightning_rlhf.config import AlgorithmConfig, BatchingConfig, OptimConfig, RolloutConfig
from lightning_rlhf.engines.rollout import HFRolloutEngine
from lightning_rlhf.engines.train.lora import resolve_lora
from lightning_rlhf.roles import ActorRole
from tests.unit.test_actor_update import rollout_batch

PEAK_SCRIPT = """
import gc, json, torch
from lightning_rlhf import perf
x = torch.ones(96 * 2**20)  # 384 MiB, touched: resident until freed
del x
gc.collect()
print(json.dumps({"used": perf.cpu_memory_used_gb(), "peak": perf.peak_rss_gb()}))
"""


def test_the_peak_counts_memory_freed_before_it_is_sampled() -> None:
    """What ``perf/cpu_memory_used_gb`` missed: a within-step peak freed before the end of the step."""
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["peak"] - figures["used"] > 0.3, figures  # the 0.375 GiB tensor, gone from the RSS


WINDOW_SCRIPT = """
import gc, json, torch
from lightning_rlhf import perf
x = torch.ones(128 * 2**20)  # 512 MiB before the window: the since-start peak
del x
gc.collect()
with perf.memory_window() as first:
    y = torch.ones(64 * 2**20)  # 256 MiB inside it, freed before it ends
    del y
    gc.collect()
with perf.memory_window() as second:
    pass
print(json.dumps({"first": first, "second": second, "since_start": perf.peak_rss_gb()}))
"""


def test_a_window_measures_its_own_peak_and_the_since_start_peak_stays() -> None:
    """What each role call's ``perf/memory_peak_gb/<role>.<method>`` rests on."""
    out = subprocess.run([sys.executable, "-c", WINDOW_SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    first, second = figures["first"], figures["second"]
    assert 0.2 < first["peak"] - first["before"] < 0.45, first  # the 0.25 GiB tensor, not the 0.5 GiB one before
    assert second["peak"] - second["before"] < 0.05, second  # a new window: the earlier peaks are not in it
    assert figures["since_start"] - first["before"] > 0.45, figures  # the 0.5 GiB peak before any window, kept


def test_call_memory_takes_the_largest_over_ranks() -> None:
    calls = {"actor.update": {0: {"before": 1.0, "peak": 3.0}, 1: {"before": 2.5, "peak": 3.5}}, "critic.values": {}}
    assert perf.call_memory_metrics(calls) == {
        "perf/memory_peak_gb/actor.update": 3.5,
        "perf/memory_added_gb/actor.update": 2.0,
    }
    census = {0: {"cpu": 1.0, "held/actor/params": 0.5}, 1: {"cpu": 1.0, "held/actor/params": 0.75}}
    assert perf.rank_memory_metrics(census)["perf/memory_held_gb/actor/params"] == 0.75


def test_every_ranks_peak_is_reported_with_the_largest() -> None:
    out = perf.rank_memory_metrics({1: {"cpu": 2.5, "cuda": 7.0}, 0: {"cpu": 3.0, "cuda": 5.0}, 2: {"cpu": 1.0}})
    assert out == {
        "perf/cpu_memory_peak_gb": 3.0,
        "perf/cpu_memory_peak_gb/rank0": 3.0,
        "perf/cpu_memory_peak_gb/rank1": 2.5,
        "perf/cpu_memory_peak_gb/rank2": 1.0,
        "perf/max_memory_allocated_gb": 7.0,
        "perf/max_memory_allocated_gb/rank0": 5.0,
        "perf/max_memory_allocated_gb/rank1": 7.0,
    }


def test_the_step_metrics_take_the_other_ranks_peaks_and_the_controllers_own() -> None:
    out = perf.step_perf_metrics(
        prompt_tokens=10, response_tokens=10, timings={}, params={}, epochs=1, device=torch.device("cpu"),
        dtype=torch.float32, world_size=2, rank_peaks={0: {"cpu": 0.0}, 1: {"cpu": 123.0}},
    )  # fmt: skip
    assert out["perf/cpu_memory_peak_gb"] == out["perf/cpu_memory_peak_gb/rank1"] == 123.0
    assert out["perf/cpu_memory_peak_gb/rank0"] == pytest.approx(perf.peak_rss_gb(), rel=0.05)  # read now
    assert out["perf/cpu_memory_peak_gb/rank0"] >= out["perf/cpu_memory_used_gb"] * 0.99


def actor_with_engine(path: str, lora: object = None) -> ActorRole:
    tok = AutoTokenizer.from_pretrained(path)
    role = ActorRole(
        path, tokenizer=tok, rollout=RolloutConfig(n=2),
        algorithm=AlgorithmConfig(batching=BatchingConfig(micro_batch_size=3)),
        optim=OptimConfig(lr=1e-2), lora=resolve_lora(lora, setting="lora", task_type="CAUSAL_LM"),
    )  # fmt: skip
    role.load()
    role.configure_optimizer(total_steps=10)
    engine_model = role.model
    if lora is not None:
        from lightning_rlhf.engines.train.lora import unadapted_copy

        engine_model = unadapted_copy(role.model)
    role.attach_engine(
        HFRolloutEngine(engine_model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device="cpu")
    )
    return role


@pytest.mark.parametrize("lora", [None, {"r": 4}], ids=["full", "lora-merged"])
def test_the_hand_off_counts_what_the_engine_takes(tiny_model: str, lora: object) -> None:
    from transformers import AutoModelForCausalLM

    actor = actor_with_engine(tiny_model, lora)
    actor.update(rollout_batch())
    _, gathered = actor.hybrid.sync()
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    weights = sum(p.numel() for p in base.parameters()) * 4  # float32, tied embedding once
    assert gathered == 0  # one process: nothing gathered from other ranks, yet the engine took every weight
    assert actor.hybrid.engine_bytes == weights
    actor.hybrid.sync()  # nothing changed: nothing taken
    assert actor.hybrid.engine_bytes == 0
