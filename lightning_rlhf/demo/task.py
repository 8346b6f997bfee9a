"""The demo task: single-line arithmetic ("3+4=" -> "7") with an exact-match reward."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets


def addition_dataset(*, num_prompts: int = 100, seed: int = 0, digits: int = 1) -> datasets.Dataset:
    """Builds the addition prompts ``"a+b="`` with their answers: a dataset with string columns ``"prompt"`` (e.g.
    ``"3+4="``) and ``"answer"`` (e.g. ``"7"``).

    With ``digits=1`` and ``num_prompts=100`` (the default) this is every pair ``a, b`` in ``0..9``, in order
    (``"0+0="``, ``"0+1="``, ...), whatever the seed. Otherwise ``num_prompts`` distinct pairs of
    ``digits``-digit-at-most operands are drawn with ``seed`` (all pairs, in order, if there are no more than
    ``num_prompts``). Runs on: any process (plain function)."""
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
    """The 100 prompts of :func:`addition_dataset` (of ``digits``) split into ``"train"`` (what the warm start and RL
    train on) and ``"test"`` (``held_out`` prompts, at least 1 and fewer than all, that neither sees: the demo's
    ``val/score/mean`` is measured on them); both with the columns ``"prompt"`` and ``"answer"``.

    The held-out prompts are drawn with ``seed`` (the same ones in every run and on every rank); each split keeps the
    order of :func:`addition_dataset`. Runs on: any process (plain function)."""
    data = addition_dataset(seed=seed, digits=digits)
    if not 1 <= held_out < len(data):
        raise ValueError(f"addition_splits(held_out={held_out}): expected 1..{len(data) - 1}.")
    test = set(random.Random(seed).sample(range(len(data)), held_out))
    train = [i for i in range(len(data)) if i not in test]
    import datasets

    return datasets.DatasetDict({"train": data.select(train), "test": data.select(sorted(test))})


def addition_reward(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """Exact-match reward of the addition task, one per completion: 1.0 when the completion (decoded without special
    tokens, cut at EOS), stripped of surrounding whitespace, equals its ``answer`` (the dataset column), else 0.0.
    ``prompts`` and the other columns (``kwargs``) are not read. Runs on: any process (plain function)."""
    if len(completions) != len(answer):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
    return [
        1.0 if completion.strip() == str(ans).strip() else 0.0
        for completion, ans in zip(completions, answer, strict=True)
    ]


def addition_cost(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """The demo's cost for Safe-RLHF: writing the digit 7 is "unsafe" (cost 1.0), anything else costs 0.0.

    About one prompt in ten has an answer with a 7 (7 and 17), so a constraint ``E[cost] <= 0.02`` makes the policy give
    up those answers while it learns the others: a reward/safety trade-off in miniature. Runs on: any process (plain
    function)."""
    return [1.0 if "7" in completion else 0.0 for completion in completions]
