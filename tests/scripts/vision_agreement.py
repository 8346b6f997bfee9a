"""A vision-language actor's rollout log-probs against the trainer's, with images, in one process (colocated).

Usage: python tests/scripts/vision_agreement.py --model DIR --engine generate|vllm --out DIR

The prompts come through ``PromptDataModule(image_column=...)`` (the chat template places one image placeholder, the
processor's patches repeat it); the engine (transformers' ``generate``, or vLLM fed the trainer's weights by the
hand-off, its own processor making the image inputs) samples 4 responses to each prompt at temperature 1; the trainer
scores them with ``forward_response``. Writes ``agreement.json``: the largest and mean ``|log p_engine - log
p_trainer|`` over sampled tokens, the token count and the number of distinct responses.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForImageTextToText

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import VLLMConfig
from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.data import PromptDataModule
from lightning_rlhf.demo.vision_task import vision_dataset
from lightning_rlhf.engines.rollout import HFRolloutEngine, RolloutEngine, SamplingParams
from lightning_rlhf.engines.train import forward_response

N = 4


def _engine(kind: str, path: str, model: torch.nn.Module, tok: object) -> RolloutEngine:
    if kind != "vllm":
        return HFRolloutEngine(
            model,
            pad_token_id=tok.pad_token_id,  # type: ignore[attr-defined]
            eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
            device=torch.device("cpu"),
            decode=kind,
        )
    from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine, check_vllm_settings

    config = VLLMConfig()  # load_format="dummy": the weights arrive by the hand-off, as in a run
    max_len = check_vllm_settings(
        path, config, dtype=torch.float32, device_type="cpu", world_size=1, max_prompt_length=64, max_new_tokens=6
    )
    engine = VLLMRolloutEngine(
        path,
        param_names=[n for n, _ in model.named_parameters()],
        config=config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=max_len,
        tie_word_embeddings=model.config.tie_word_embeddings,  # type: ignore[union-attr]
        hf_config=model.config,
        eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
        layer=CPULayer(),
    )
    engine.load_weights(model.named_parameters())
    return engine


@torch.no_grad()
def agreement(kind: str, path: str) -> dict[str, object]:
    """The largest and mean gap, the number of sampled tokens and of distinct responses (module doc)."""
    data = PromptDataModule(vision_dataset(8, seed=1), image_column="image", tokenizer=path, batch_size=8)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    tok = data._tokenizer
    engine = _engine(kind, path, model, tok)
    prompts = [row[m.bool()].tolist() for row, m in zip(batch["prompts"], batch["prompt_mask"], strict=True)]
    out = engine.generate(prompts, SamplingParams(n=N, temperature=1.0, max_new_tokens=6, seed=3), batch["vision"])
    rows = batch.select(torch.arange(len(batch)).repeat_interleave(N))
    width = max(map(len, out.responses))
    rows["responses"] = torch.tensor([r + [0] * (width - len(r)) for r in out.responses])
    rows["response_mask"] = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in out.responses])
    scored = Batch(
        {k: rows[k] for k in ("prompts", "prompt_mask", "responses", "response_mask")}, {"vision": rows["vision"]}
    )
    train = forward_response(model, scored, output="logprobs", temperature=1.0)["logprobs"].float()
    sampled = torch.tensor([r + [0.0] * (width - len(r)) for r in out.logprobs or []])
    gaps = (train - sampled).abs()[rows["response_mask"].bool()]
    return {
        "max": float(gaps.max()),
        "mean": float(gaps.mean()),
        "tokens": int(gaps.numel()),
        "distinct": len({tuple(r) for r in out.responses}),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--engine", required=True, choices=["generate", "vllm"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with open(os.path.join(args.out, "agreement.json"), "w") as f:
        json.dump(agreement(args.engine, args.model), f)


if __name__ == "__main__":
    main()
