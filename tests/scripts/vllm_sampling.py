"""The vLLM engine's sampling against transformers and the trainer's log-probs (one process, no process group).

Usage: python tests/scripts/vllm_sampling.py --model DIR --out DIR

Writes ``sampling.json``: greedy responses (temperature 0, n=3) of vLLM and of transformers' greedy decoding,
the largest gap between vLLM's log-probs and the trainer's (``forward_response``) for greedy (temperature 1)
and sampled (temperature 0.7) rollouts, the error a temperature below vLLM's floor raises, the tokenizer's EOS id
and greedy responses with ``min_new_tokens=5``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import VLLMConfig
from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.engines.rollout import HFRolloutEngine, SamplingParams
from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine, check_vllm_settings
from lightning_rlhf.engines.train import forward_response

PROMPTS = ["3+4=", "12+9=", "5+5=", "7+8="]


def _batch(prompts: list[list[int]], responses: list[list[int]], n: int) -> Batch:
    rows = [p for p in prompts for _ in range(n)]
    width_p, width_r = max(map(len, rows)), max(map(len, responses))
    return Batch(
        {
            "prompts": torch.tensor([[0] * (width_p - len(p)) + p for p in rows]),
            "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in rows]),
            "responses": torch.tensor([r + [0] * (width_r - len(r)) for r in responses]),
            "response_mask": torch.tensor([[1] * len(r) + [0] * (width_r - len(r)) for r in responses]),
        }
    )


@torch.no_grad()
def _gap(model: torch.nn.Module, prompts: list[list[int]], out: object, n: int, temperature: float) -> float:
    batch = _batch(prompts, out.responses, n)  # type: ignore[attr-defined]
    train = forward_response(model, batch, output="logprobs", temperature=temperature)["logprobs"]
    width = batch["responses"].shape[1]
    engine = torch.tensor([r + [0.0] * (width - len(r)) for r in out.logprobs])  # type: ignore[attr-defined]
    mask = batch["response_mask"].bool()
    return float((train.exp() - engine.exp()).abs()[mask].max())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = VLLMConfig(load_format="auto")
    max_len = check_vllm_settings(
        args.model, config, dtype=torch.float32, device_type="cpu", world_size=1, max_prompt_length=8, max_new_tokens=6
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
        eos_token_id=tok.eos_token_id,
        layer=CPULayer(),
    )
    hf = HFRolloutEngine(
        model,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        device=torch.device("cpu"),
        decode_loop=CPULayer().decode_loop(),
    )
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    greedy = SamplingParams(n=3, temperature=0.0, max_new_tokens=6)
    vllm_greedy = engine.generate(prompts, greedy)
    sampled = engine.generate(prompts, SamplingParams(n=4, temperature=0.7, max_new_tokens=6, seed=3))
    try:
        engine.generate(prompts, SamplingParams(n=2, temperature=1e-3, max_new_tokens=6))
        refused = ""
    except ValueError as err:
        refused = str(err)
    report = {
        "vllm_greedy": vllm_greedy.responses,
        "hf_greedy": hf.generate(prompts, greedy).responses,
        "greedy_gap": _gap(model, prompts, vllm_greedy, 3, 1.0),
        "sampled_gap": _gap(model, prompts, sampled, 4, 0.7),
        "sampled_distinct": len({tuple(r) for r in sampled.responses}),
        "refused": refused,
        "eos": tok.eos_token_id,
        # the EOS reaches vLLM as a stop token id (it runs without a tokenizer): held back until min_tokens
        "min_tokens": engine.generate(
            prompts, SamplingParams(n=1, max_new_tokens=8, min_new_tokens=5, greedy=True)
        ).responses,
    }
    with open(os.path.join(args.out, "sampling.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
