"""Streamed rollouts (lightning_rlhf.engines.stream) on the transformers engine: a pause interrupts the running
requests between two decoding steps and they go on afterwards from their tokens so far, each token stamped with the
version of the weights that sampled it; a take returns the oldest complete groups and samples too stale a group
again; a failure in the stream's thread reaches the caller."""

from __future__ import annotations

import pytest
import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.engines.rollout.hf import HFRolloutEngine
from lightning_rlhf.engines.rollout.requests import SamplingParams
from lightning_rlhf.engines.stream import RolloutStream
from tests.scripted import interrupt_at, tiny_engine

TOKENS = 48


def engine_and_rows() -> tuple[HFRolloutEngine, Batch, list[list[int]]]:
    rows = Batch({"uid": torch.arange(2)}, {"prompt": ["a", "b"]})
    return tiny_engine(), rows, [[5, 6, 7, 8], [9, 10, 11]]


GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=TOKENS, min_new_tokens=TOKENS, stop_token_ids=(1,))


def test_a_pause_interrupts_the_running_requests_which_go_on_from_their_tokens_with_the_new_version() -> None:
    engine, rows, prompts = engine_and_rows()
    uninterrupted = engine.generate(prompts, GREEDY).responses  # what the same weights sample without a pause
    reached = interrupt_at(engine, 5)  # the chunk's check, then 4 tokens
    stream = RolloutStream(engine, interrupt=True, max_staleness=2, pad_id=0)
    try:
        stream.resume(0)
        stream.submit(rows, prompts, GREEDY)
        assert reached.wait(timeout=60)
        stream.pause()  # returns once the engine is idle: the step ended at its 4th token
        stream.resume(1)
        out, figures = stream.take(2, version=1)
    finally:
        stream.close()
    assert out["responses"].tolist() == [list(r) for r in uninterrupted]  # the continuation is the same sampling
    assert out["rollout_versions"].tolist() == [[0] * 4 + [1] * (TOKENS - 4)] * 4
    assert out["weight_version"].tolist() == [0, 0, 0, 0]  # its oldest token's
    assert out["prompt"] == ["a", "a", "b", "b"] and out["uid"].tolist() == [0, 0, 1, 1]
    assert figures["rollout/stream/mixed_versions"] == 1.0 and figures["rollout/stream/in_flight"] == 0.0
    assert out["rollout_logprobs"].shape == (4, TOKENS) and bool((out["rollout_logprobs"] != 0).all())


def test_a_take_samples_too_stale_a_group_again_and_keeps_the_others_in_flight() -> None:
    engine, rows, prompts = engine_and_rows()
    stream = RolloutStream(engine, interrupt=True, max_staleness=2, pad_id=0)
    try:
        stream.resume(0)
        stream.submit(rows, prompts, GREEDY)
        first, _ = stream.take(1, version=0)  # the oldest: the first row's group
        assert first["uid"].tolist() == [0, 0]
        stream.pause()
        stream.resume(5)  # five updates later: the other group's tokens are too old now
        again, figures = stream.take(1, version=5)
    finally:
        stream.close()
    assert again["uid"].tolist() == [1, 1] and again["weight_version"].tolist() == [5, 5]
    assert figures["rollout/stream/restarted"] == 1.0


def test_a_failure_in_the_streams_thread_reaches_the_caller() -> None:
    engine, rows, prompts = engine_and_rows()

    def broken(*args, **kwargs):
        raise RuntimeError("the engine broke")

    engine.sample = broken  # type: ignore[method-assign]
    stream = RolloutStream(engine, interrupt=True, max_staleness=2, pad_id=0)
    try:
        stream.resume(0)
        stream.submit(rows, prompts, GREEDY)
        with pytest.raises(RuntimeError, match="the rollout stream failed: RuntimeError: the engine broke"):
            stream.take(2, version=0)
    finally:
        stream.close()


def test_a_pause_right_after_a_resume_returns_even_before_the_driver_saw_the_resume() -> None:
    """A hand-off's pause and resume, then validation's pause at once (the pool's two calls of one step): the second
    pause must not wait for the driver to notice the resume in between (it hung when the driver had not: its idle
    mark was set once per pause, before it saw the resume)."""
    import asyncio
    import threading

    from lightning_rlhf.agents.driver import RequestDriver
    from lightning_rlhf.engines.rollout.requests import BatchedRequestQueue

    driver = RequestDriver(BatchedRequestQueue(tiny_engine()), lockstep=False, shared=False, timeout_s=600)
    thread = threading.Thread(target=asyncio.run, args=(driver.serve(),), daemon=True)
    thread.start()
    try:
        driver.pause(interrupt=False, timeout_s=30)
        for version in range(300):  # back to back: the driver's loop rarely runs between the two calls
            driver.resume(version)
            driver.pause(interrupt=False, timeout_s=30)  # TimeoutError if the driver never marks itself idle again
    finally:
        driver.close()
        thread.join(timeout=30)
    assert not thread.is_alive()
