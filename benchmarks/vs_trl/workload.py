"""The one definition of the side-by-side workload that ``bench.py`` feeds to TRL and to lightning_rlhf.

Both virtualenvs import this file (the project's ``.venv`` and TRL's ``.venv-trl``), so it imports only the
standard library, torch and transformers: never lightning_rlhf, never trl.

The workload (issue 11): a Qwen2-shaped model built locally under a fixed seed (``tiny`` 0.19M, ``small`` 4.0M,
``m30`` 30.3M or ``m100`` 100.7M parameters, tied embeddings) with the project's byte-level BPE tokenizer, "Add a and
b. Answer:" prompts in a fixed order (step k reads rows ``k*P .. k*P+P-1``), no chat template, no BOS; P prompts
(16 unless a run passes ``prompts``, as ``scaling.py`` does) x G=8 samples per step,
exactly 64 new tokens (EOS suppressed), temperature 1, reward 1 / 0.1 / 0 (the correct sum / some other number /
anything else), group-normalised advantages (epsilon 1e-4), one on-policy update per step over all P x G sequences,
token-mean loss, clip 0.2, AdamW lr 1e-6 with linear decay and no warm-up, gradient clipping at 1, no KL or a k3
KL to a frozen reference with beta 0.04.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
from typing import Any

SEED = 0
"""Seed of the random model initialisation and of the prompt operands."""
PROMPTS_PER_STEP = 16
"""P: prompts per RL step, the default of every function and script that takes ``prompts`` / ``--prompts``."""
SAMPLES_PER_PROMPT = 8
"""G: samples per prompt (the group of group-normalised advantages)."""
NEW_TOKENS = 64
"""Every completion is exactly this long: ``min_new_tokens = max_new_tokens`` (EOS is never sampled)."""
TEMPERATURE = 1.0
"""Sampling temperature (no top-k, no top-p)."""
CLIP = 0.2
"""PPO clip range, both sides of the ratio."""
LR = 1e-6
"""Peak AdamW learning rate; linear decay to 0 at the last step, no warm-up."""
GRAD_CLIP = 1.0
"""Global gradient-norm clip."""
ADV_EPS = 1e-4
"""Epsilon of the group normalisation ``(r - mean) / (std + eps)`` (TRL's value)."""
KL_BETA = 0.04
"""KL coefficient of the "with reference" variant (k3 estimator, in the loss, not in the reward)."""
MICRO_BATCH = 32
"""Sequences per forward/backward on one process (both sides; 128 sequences = 4 micro-batches in 1 process)."""
MAX_POSITIONS = 128
"""``max_position_embeddings`` of the models: room for the longest prompt (at most 13 tokens: operands stay in
0..99 whatever the prompt count) + 64 new tokens."""


TRL_PLAIN_RUN = {
    "use_vllm": False,
    "shuffle_dataset": False,
    "gradient_checkpointing": False,  # TRL's default is True
    "report_to": "none",
    "save_strategy": "no",
    "logging_steps": 1,
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
}
"""``GRPOConfig`` settings every TRL run of the benchmarks shares: transformers generation, prompts in order, no
activation checkpointing, no reporting or saving, a log line per step."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape of one benchmark model (a Qwen2 decoder with tied input/output embeddings)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def num_params(self) -> int:
        """Parameter count (embeddings counted once, as they are tied). Runs on: any process."""
        q = self.hidden * self.heads * self.head_dim + self.heads * self.head_dim
        kv = 2 * (self.hidden * self.kv_heads * self.head_dim + self.kv_heads * self.head_dim)
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        per_layer = q + kv + o + mlp + 2 * self.hidden
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden


MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=256, vocab=1024),
    "small": ModelSpec(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=704, vocab=4096),
    "m30": ModelSpec(hidden=512, layers=10, heads=8, kv_heads=2, head_dim=64, intermediate=1408, vocab=4096),
    "m100": ModelSpec(hidden=768, layers=16, heads=12, kv_heads=2, head_dim=64, intermediate=2048, vocab=4096),
}
"""The benchmark's models by name: 188,992 / 4,002,048 / 30,296,064 / 100,705,024 parameters."""


def check_prompts(prompts: int) -> int:
    """``prompts`` (P) if it is a positive multiple of 8, else a ValueError naming the setting.

    P x G sequences must split into micro-batches of :data:`MICRO_BATCH` on each of 1 or 2 processes, hence the
    multiple of 8 (8 x 8 = 64 = 2 x 32). Runs on: any process.
    """
    if prompts < 8 or prompts % 8:
        raise ValueError(
            f"prompts={prompts}: expected a positive multiple of 8 (P x {SAMPLES_PER_PROMPT} samples must split into "
            f"micro-batches of MICRO_BATCH={MICRO_BATCH} on 1 or 2 processes). HINT: pass --prompts 16, 32, 64, ..."
        )
    return prompts


def prompt_rows(steps: int, prompts: int = PROMPTS_PER_STEP) -> list[dict[str, str]]:
    """The prompts of ``steps`` RL steps of ``prompts`` (P) prompts each, in order: step k reads rows
    ``k*P .. k*P+P-1``.

    Each row is ``{"prompt": "Add 12 and 7. Answer:", "answer": "19"}``; operands are drawn in 0..99 with
    :data:`SEED`, so the rows are the same on every machine and in both virtualenvs (one stream: a run with a
    smaller P reads a prefix of a larger P's rows).

    Runs on: any process (plain function).
    """
    if steps < 1:
        raise ValueError(f"prompt_rows(steps={steps}): expected at least 1 step. HINT: pass --steps >= 1.")
    check_prompts(prompts)
    rng = random.Random(SEED)
    rows = []
    for _ in range(steps * prompts):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"prompt": f"Add {a} and {b}. Answer:", "answer": str(a + b)})
    return rows


_NUMBER = re.compile(r"-?\d+")


def reward(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """The workload's reward: 1.0 when the first number of the completion is the answer, 0.1 when the completion
    holds some other number, 0.0 otherwise. Takes the reward-function signature of both frameworks
    (``prompts``, ``completions``, dataset columns by name, anything else ignored).

    Runs on: any process (plain function; both sides call it in the training process).
    """
    scores = []
    for completion, ans in zip(completions, answer, strict=True):
        found = _NUMBER.search(str(completion))
        scores.append(0.0 if found is None else 1.0 if found.group() == str(ans) else 0.1)
    return scores


def random_model(spec: ModelSpec, *, pad_id: int, bos_id: int, eos_id: int) -> Any:
    """The random-init Qwen2 causal LM of ``spec`` (seed :data:`SEED`, float32), in memory. Runs on: any process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        initializer_range=0.02,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def build_model(model_dir: str, spec: ModelSpec, *, pad_id: int, bos_id: int, eos_id: int) -> None:
    """Build the random-init Qwen2 causal LM of ``spec`` (seed :data:`SEED`, float32) and save it into
    ``model_dir`` (safetensors), next to the tokenizer already saved there.

    Runs on: the benchmark's driver, once per model (project venv); both sides load the folder.
    """
    model = random_model(spec, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)
    got = sum(p.numel() for p in model.parameters())
    if got != spec.num_params():
        raise RuntimeError(f"model of {spec} has {got} parameters, expected {spec.num_params()}")
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = pad_id, bos_id, eos_id
    model.save_pretrained(model_dir, safe_serialization=True)


def prompt_ids(model_dir: str, steps: int, prompts: int = PROMPTS_PER_STEP) -> list[list[int]]:
    """Token ids of every prompt as both frameworks encode them (``tokenizer(text)`` with the default
    ``add_special_tokens=True``), loaded with ``AutoTokenizer`` from ``model_dir``.

    Runs on: any process; the driver runs it in both virtualenvs and compares (:func:`ids_digest`).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [list(tok(row["prompt"])["input_ids"]) for row in prompt_rows(steps, prompts)]


def ids_digest(model_dir: str, steps: int, prompts: int = PROMPTS_PER_STEP) -> dict[str, Any]:
    """What the tokenizer check compares between the two virtualenvs: a hash of every prompt's ids, the prompt
    token count per step (``prompts`` prompts x G samples), whether any prompt starts with BOS, and the longest
    prompt plus :data:`NEW_TOKENS` against :data:`MAX_POSITIONS`.

    Runs on: any process.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = prompt_ids(model_dir, steps, prompts)
    per_step = [sum(len(x) for x in ids[k * prompts : (k + 1) * prompts]) * SAMPLES_PER_PROMPT for k in range(steps)]
    longest = max(len(x) for x in ids)
    return {
        "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        "prompt_tokens_per_step": per_step,
        "starts_with_bos": any(x and x[0] == tok.bos_token_id for x in ids),
        "tokenizer_class": type(tok).__name__,
        "fits_positions": longest + NEW_TOKENS <= MAX_POSITIONS,
    }


def set_threads(threads: int) -> None:
    """Pin torch's intra-op threads (both sides call it before building anything). Runs on: every process."""
    import torch

    torch.set_num_threads(max(1, threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, threads)))


if __name__ == "__main__":  # python workload.py MODEL_DIR STEPS [PROMPTS]: the tokenizer digest (run in each venv)
    import sys

    count = int(sys.argv[3]) if len(sys.argv) > 3 else PROMPTS_PER_STEP
    print(json.dumps(ids_digest(sys.argv[1], int(sys.argv[2]), count)))
