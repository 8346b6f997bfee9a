"""The demo task: single-line arithmetic ("3+4=" -> "7") with an exact-match reward."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets


def addition_dataset(*, num_prompts: int = 100, seed: int = 0, digits: int = 1) -> datasets.Dataset:
    """Builds the addition prompts ``"a+b="`` with their answers.

    With ``digits=1`` and ``num_prompts=100`` (the default) this is every pair ``a, b`` in ``0..9``, in
    order (``"0+0="``, ``"0+1="``, ...), whatever the seed. Otherwise ``num_prompts`` distinct pairs of
    ``digits``-digit-at-most operands are drawn with ``seed`` (all pairs, in order, if there are no more
    than ``num_prompts``).

    Runs on: any process (plain function).

    Args:
        num_prompts: Number of prompts.
        seed: Seed of the draw (only used when there are more pairs than ``num_prompts``).
        digits: Maximum number of digits of each operand.

    Returns:
        A dataset with string columns ``"prompt"`` (e.g. ``"3+4="``) and ``"answer"`` (e.g. ``"7"``).
    """
    if num_prompts < 1 or digits < 1:
        raise ValueError("num_prompts and digits must be positive")
    top = 10**digits
    total = top * top
    if total <= num_prompts:
        codes = list(range(total))
    else:
        codes = sorted(random.Random(seed).sample(range(total), num_prompts))
    pairs = [divmod(code, top) for code in codes]
    import datasets  # on use: a reward worker imports this module for `addition_reward` without `datasets`

    return datasets.Dataset.from_dict(
        {"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}
    )


HELD_OUT_PROMPTS = 20
"""How many of the 100 single-digit prompts the demo holds out: neither its warm start nor RL trains on them."""


def addition_splits(*, held_out: int = HELD_OUT_PROMPTS, seed: int = 0, digits: int = 1) -> datasets.DatasetDict:
    """The addition prompts split into ``"train"`` (what the warm start and RL train on) and ``"test"``
    (``held_out`` prompts that neither sees: the demo's ``val/score/mean`` is measured on them).

    The held-out prompts are drawn with ``seed`` (the same ones in every run and on every rank); each split keeps
    the order of :func:`addition_dataset`.

    Runs on: any process (plain function).

    Args:
        held_out: Number of held-out prompts (at least 1, fewer than all).
        seed: Seed of the draw.
        digits: ``digits`` of :func:`addition_dataset` (its default 100 prompts).

    Returns:
        A ``DatasetDict`` with ``"train"`` and ``"test"``, both with the columns ``"prompt"`` and ``"answer"``.
    """
    data = addition_dataset(seed=seed, digits=digits)
    if not 1 <= held_out < len(data):
        raise ValueError(f"addition_splits(held_out={held_out}): expected 1..{len(data) - 1}.")
    test = set(random.Random(seed).sample(range(len(data)), held_out))
    train = [i for i in range(len(data)) if i not in test]
    import datasets

    return datasets.DatasetDict({"train": data.select(train), "test": data.select(sorted(test))})


def addition_reward(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """Exact-match reward of the addition task.

    A completion scores 1.0 when, stripped of surrounding whitespace, it equals the answer, else 0.0.
    Completions are the decoded responses without special tokens (generation already cut at EOS).

    Runs on: any process (plain function).

    Args:
        prompts: The prompts (unused; part of the reward-function signature).
        completions: The decoded completions, one per prompt.
        answer: The ``"answer"`` dataset column, one per prompt.
        **kwargs: Other dataset columns (ignored).

    Returns:
        One reward per completion.
    """
    if len(completions) != len(answer):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
    return [
        1.0 if completion.strip() == str(ans).strip() else 0.0
        for completion, ans in zip(completions, answer, strict=True)
    ]


def addition_cost(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """The demo's cost for Safe-RLHF: writing the digit 7 is "unsafe" (cost 1.0), anything else costs 0.0.

    About one prompt in ten has an answer with a 7 (7 and 17), so a constraint ``E[cost] <= 0.02`` makes the
    policy give up those answers while it learns the others: a reward/safety trade-off in miniature.

    Runs on: any process (plain function).
    """
    return [1.0 if "7" in completion else 0.0 for completion in completions]
