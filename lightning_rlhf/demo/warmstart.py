"""Supervised warm start of the tiny demo model, its on-disk cache, and accuracy checks.

A randomly initialised tiny model never produces a correct sum, so RL has no signal. A few dozen
supervised steps bring it to a partly-right policy (sampled accuracy around 0.4) that RL can then
visibly improve.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lightning_rlhf.demo.task import addition_dataset, addition_reward
from lightning_rlhf.demo.tiny import save_tiny

log = logging.getLogger(__name__)

CACHE_VERSION = "v1"
"""Bumped whenever the tiny model, tokenizer or warm start change, so stale caches are not reused."""


def _load(model_dir: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, tokenizer


def _supervised_batch_tensors(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], answers: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + eos`` sequences with labels only on ``answer + eos``."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    assert eos is not None and pad is not None, "tokenizer needs eos and pad tokens"
    rows: list[tuple[list[int], list[int]]] = []
    for prompt, answer in zip(prompts, answers, strict=True):
        prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        response_ids = [*tokenizer(answer, add_special_tokens=False)["input_ids"], eos]
        rows.append((prompt_ids, response_ids))
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt_ids, response_ids) in enumerate(rows):
        n_prompt, n_total = len(prompt_ids), len(prompt_ids) + len(response_ids)
        input_ids[i, :n_total] = torch.tensor(prompt_ids + response_ids)
        attention_mask[i, :n_total] = 1
        labels[i, n_prompt:n_total] = torch.tensor(response_ids)
    return input_ids, attention_mask, labels


def warm_start(
    model_dir: str,
    out_dir: str,
    *,
    steps: int = 60,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    digits: int = 1,
) -> str:
    """Trains the model in ``model_dir`` supervised on the addition task and saves it to ``out_dir``.

    Each step draws ``batch_size`` prompts (with replacement) from :func:`addition_dataset` and minimises
    the cross-entropy of ``answer + eos`` given the prompt, with AdamW in plain PyTorch. Prompt ids are
    ``tokenizer(prompt, add_special_tokens=True)["input_ids"]`` (as the RL rollouts tokenize them) and the
    response is the answer's characters followed by EOS. Deterministic for a given seed; the global RNG
    state is left untouched. About 1.5 s on CPU for the defaults.

    Runs on: any process (plain function).

    Args:
        model_dir: Directory with a causal LM and its tokenizer (e.g. from :func:`save_tiny`).
        out_dir: Where the trained model and the tokenizer are saved (``save_pretrained``).
        steps: Number of optimizer steps.
        batch_size: Sequences per step.
        lr: AdamW learning rate.
        seed: Seed of the batch draws.
        digits: ``digits`` of :func:`addition_dataset`.

    Returns:
        ``out_dir``.
    """
    model, tokenizer = _load(model_dir)
    data = addition_dataset(seed=seed, digits=digits)
    input_ids, attention_mask, labels = _supervised_batch_tensors(tokenizer, data["prompt"], data["answer"])
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    start = time.perf_counter()
    loss = torch.zeros(())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            idx = torch.randint(0, input_ids.shape[0], (batch_size,), generator=generator)
            out = model(input_ids=input_ids[idx], attention_mask=attention_mask[idx], labels=labels[idx])
            loss = out.loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    log.info("warm start: %d steps in %.2fs, final loss %.3f", steps, time.perf_counter() - start, loss.item())
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def prepare_demo_model(cache_dir: str, *, seed: int = 0, warm_start_steps: int = 60) -> str:
    """Returns a warm-started tiny demo model, building and caching it on first use.

    The model lives in ``cache_dir/demo-model-v1-seed{seed}-ws{warm_start_steps}``; if that directory
    already has a ``config.json`` it is reused as is (nothing printed). Otherwise a tiny model is built
    (:func:`save_tiny`) and warm-started (:func:`warm_start`) in a temporary directory inside
    ``cache_dir`` that is then renamed into place, so concurrent callers never see a partial model.

    Runs on: any process (plain function).

    Args:
        cache_dir: Cache directory (created if missing).
        seed: Seed of the model initialisation and of the warm start.
        warm_start_steps: Supervised steps.

    Returns:
        The model directory (model and tokenizer, loadable with ``from_pretrained``).
    """
    final = os.path.join(cache_dir, f"demo-model-{CACHE_VERSION}-seed{seed}-ws{warm_start_steps}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-model-tmp-", dir=cache_dir)
    try:
        base = save_tiny(os.path.join(tmp, "base"), seed=seed)
        trained = warm_start(base, os.path.join(tmp, "model"), steps=warm_start_steps, seed=seed)
        if os.path.isdir(final) and not os.path.isfile(os.path.join(final, "config.json")):
            shutil.rmtree(final, ignore_errors=True)  # a foreign, incomplete leftover
        try:
            os.replace(trained, final)
        except OSError:
            # Another process finished first (its directory is complete, since it was renamed in whole).
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@torch.no_grad()
def _generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    do_sample: bool,
    temperature: float,
    max_new_tokens: int,
) -> list[str]:
    enc = tokenizer(prompts, add_special_tokens=True, padding=True, return_tensors="pt")
    kwargs: dict[str, Any] = {"do_sample": do_sample}
    if do_sample:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    out = model.generate(  # type: ignore[operator]  # nn.Module.__getattr__ hides it from mypy
        **enc,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **kwargs,
    )
    assert isinstance(out, torch.Tensor)
    responses = out[:, enc["input_ids"].shape[1] :].tolist()
    completions: list[str] = []
    for ids in responses:
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id)]
        completions.append(str(tokenizer.decode(ids, skip_special_tokens=True)))
    return completions


def sampled_accuracy(
    model_dir: str, *, num_samples: int = 8, temperature: float = 1.0, seed: int = 0, digits: int = 1
) -> float:
    """Mean exact-match reward of sampled completions over the 100 addition prompts.

    Each prompt is sampled ``num_samples`` times with ``model.generate`` (left padding, up to 4 new
    tokens, stopping at EOS, plain temperature sampling) and scored with :func:`addition_reward`.
    The global RNG state is left untouched.

    Runs on: any process (plain function).

    Args:
        model_dir: Directory with a causal LM and its tokenizer.
        num_samples: Samples per prompt.
        temperature: Sampling temperature.
        seed: Sampling seed.
        digits: ``digits`` of :func:`addition_dataset`.

    Returns:
        The accuracy in ``[0, 1]``.
    """
    model, tokenizer = _load(model_dir)
    data = addition_dataset(seed=seed, digits=digits)
    prompts = list(data["prompt"]) * num_samples
    answers = list(data["answer"]) * num_samples
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        completions = _generate_completions(
            model, tokenizer, prompts, do_sample=True, temperature=temperature, max_new_tokens=4
        )
    rewards = addition_reward(prompts, completions, answer=answers)
    return sum(rewards) / len(rewards)


def greedy_accuracy(model_dir: str, *, digits: int = 1) -> float:
    """Mean exact-match reward of greedy completions over the 100 addition prompts.

    Runs on: any process (plain function).

    Args:
        model_dir: Directory with a causal LM and its tokenizer.
        digits: ``digits`` of :func:`addition_dataset`.

    Returns:
        The accuracy in ``[0, 1]``.
    """
    model, tokenizer = _load(model_dir)
    data = addition_dataset(digits=digits)
    prompts, answers = list(data["prompt"]), list(data["answer"])
    completions = _generate_completions(model, tokenizer, prompts, do_sample=False, temperature=1.0, max_new_tokens=4)
    rewards = addition_reward(prompts, completions, answer=answers)
    return sum(rewards) / len(rewards)
