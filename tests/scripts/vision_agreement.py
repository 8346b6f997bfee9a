"""A vision-language actor's rollout log-probs against the trainer's, with images, in one process (colocated).

Usage: python tests/scripts/vision_agreement.py --model DIR --engine generate|vllm --out DIR [--episodes]

The prompts come through ``PromptDataModule(image_column=...)`` (the chat template places one image placeholder, the
processor's patches repeat it); the engine (transformers' ``generate``, or vLLM fed the trainer's weights by the
hand-off, its own processor making the image inputs) samples 4 responses to each prompt at temperature 1; the trainer
scores them with ``forward_response``. Writes ``agreement.json``: the largest and mean ``|log p_engine - log
p_trainer|`` over sampled tokens, the token count and the number of distinct responses.

``--episodes``: two-turn episodes instead (the demo's ``CountTwiceEnvironment``: ``reset`` shows one image, ``step``
answers the first turn with a second image), run by the rollout's own :class:`EpisodeRunner` through the engine's
request queue; the report adds the images per row, the placeholders per row and how many of them are sampled (0: out
of the loss).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForImageTextToText

from lightning_rlhf.agents.rollout import EpisodeRunner, episode_rows
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import EpisodeConfig, RolloutConfig, VLLMConfig
from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.data import PromptDataModule
from lightning_rlhf.demo.vision_task import CountTwiceEnvironment, vision_dataset
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
def episode_agreement(kind: str, path: str) -> dict[str, object]:
    """``agreement`` over two-turn ``CountTwiceEnvironment`` episodes (module doc)."""
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    data = PromptDataModule(vision_dataset(4, seed=1), image_column="image", tokenizer=path, batch_size=4)
    data.setup("fit")
    tok = data._tokenizer
    engine = _engine(kind, path, model, tok)
    image_id = int(tok.convert_tokens_to_ids("<|image_pad|>"))
    cfg = RolloutConfig(max_new_tokens=6, episode=EpisodeConfig(max_turns=2, tool_workers=1, max_episode_tokens=96))
    runner = EpisodeRunner(CountTwiceEnvironment, tok, cfg, model_name=path)
    digits = [int(i) for i in tok.convert_tokens_to_ids(list("0123456789aeiou"))]  # a random model's turns end soon
    stops = (tok.eos_token_id, image_id, *digits)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5, stop_token_ids=stops)
    rows = [dict(r) for r in vision_dataset(4, seed=1) for _ in range(N)]
    try:
        episodes, _, _ = runner.run(engine, rows, params)
    finally:
        runner.close()
    batch = episode_rows(
        Batch({"uid": torch.arange(len(rows))}), episodes, [False] * len(rows), pad_id=tok.pad_token_id
    )
    scored = Batch({k: batch[k] for k in ("prompts", "prompt_mask", "responses", "response_mask")}, {})
    scored["vision"] = batch["vision"]
    train = forward_response(model, scored, output="logprobs", temperature=1.0)["logprobs"].float()
    sampled = batch["sampled_mask"].bool()
    gaps = (train - batch["rollout_logprobs"]).abs()[sampled]
    placeholders = batch["responses"] == image_id
    second = [ep for ep in episodes if ep.info.turns == 2]  # the turns sampled after the second image
    return {
        "max": float(gaps.max()),
        "mean": float(gaps.mean()),
        "tokens": int(gaps.numel()),
        "distinct": len({tuple(ep.ids) for ep in episodes}),
        "images": [len(v.images) for v in batch["vision"]],
        "placeholders": [int(p) for p in placeholders.sum(1)],
        "sampled_placeholders": int((placeholders & sampled).sum()),
        "two_turns": len(second),
        "messages": second[0].info.messages if second else [],
    }


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
    p.add_argument("--episodes", action="store_true")
    args = p.parse_args()
    report = (episode_agreement if args.episodes else agreement)(args.engine, args.model)
    with open(os.path.join(args.out, "agreement.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
