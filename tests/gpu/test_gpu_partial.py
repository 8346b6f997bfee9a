"""Partial rollouts on a GPU (skipped without CUDA): the transformers engine on the device, sampling with
transformers' ``generate`` (the decoding loop is the CPU layer's), interrupted by a pause between two of its steps;
the requests go on after it from their tokens so far, stamped with the new version, and each sample keeps its length.
vLLM is not on the lent GPU machines; tests/unit/test_stream.py checks the same on the CPU decoding loop."""

from __future__ import annotations

import pytest
import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.engines.rollout.requests import SamplingParams
from lightning_rlhf.engines.stream import RolloutStream
from tests.scripted import interrupt_at, tiny_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS = 48


def test_a_pause_interrupts_transformers_generate_on_cuda_and_the_requests_go_on() -> None:
    engine = tiny_engine("cuda", decode="generate")
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=TOKENS, min_new_tokens=TOKENS, stop_token_ids=(1,))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    uninterrupted = engine.generate(prompts, greedy).responses
    reached = interrupt_at(engine, 5)
    stream = RolloutStream(engine, interrupt=True, max_staleness=2, pad_id=0)
    try:
        stream.resume(0)
        stream.submit(Batch({"uid": torch.arange(2)}, {}), prompts, greedy)
        assert reached.wait(timeout=120)
        stream.pause()
        stream.resume(1)
        out, figures = stream.take(2, version=1)
    finally:
        stream.close()
    versions = out["rollout_versions"].tolist()
    assert all(v[0] == 0 and v[-1] == 1 and v == sorted(v) for v in versions), versions  # cut once, then the new one
    assert out["response_mask"].sum(1).tolist() == [TOKENS] * 4  # each sample kept its length across the pause
    assert figures["rollout/stream/mixed_versions"] == 1.0
    first = [r[: v.count(0)] for r, v in zip(out["responses"].tolist(), versions, strict=True)]
    assert first == [list(r)[: len(f)] for r, f in zip(uninterrupted, first, strict=True)]  # the tokens before the cut
