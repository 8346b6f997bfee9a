"""Greedy decoding of an exported actor folder by transformers and by vLLM (in this process, on CPU).

Usage: python tests/scripts/export_vllm.py --model DIR --out FILE.json

Writes ``{"prompts": [...], "hf": [[token ids], ...], "vllm": [[token ids], ...]}``: the first few greedy tokens
of each prompt, which must agree when vLLM loads the folder's weights, config and tokenizer as transformers does.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = ["3+4=", "1+1=", "8+9=", "5+0="]
NEW_TOKENS = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = [tokenizer(text)["input_ids"] for text in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    hf = []
    with torch.no_grad():
        for prompt in ids:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            hf.append(out[0, len(prompt) :].tolist())

    # As lightning_rlhf's colocated engine runs vLLM on CPU: in this process, eager, a small KV cache.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=64, seed=0
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in ids], params, use_tqdm=False)
    vllm = [list(o.outputs[0].token_ids) for o in outputs]
    with open(args.out, "w") as f:
        json.dump({"prompts": PROMPTS, "hf": hf, "vllm": vllm}, f)


if __name__ == "__main__":
    main()
