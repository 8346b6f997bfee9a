"""Rule rewards for math answers: GSM8K's final numbers and boxed LaTeX answers (``math-verify``), 1.0 for a
correct final answer, 0.0 otherwise (docs/rewards.md). ``math-verify``'s own timeouts use ``signal.alarm`` (main
thread only): in other threads they are off and the caller's (``RewardConfig.timeout_s``) bounds the call.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["extract_final_number", "gsm8k_reward", "math_reward"]

_MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own limit per parse / verify (its default); applies in a main thread only."""
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
"""A decimal number, with optional thousands separators ("1,234.5"), sign and fraction."""
_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER.pattern + ")")
_BOXED = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")


def extract_final_number(text: str) -> str | None:
    """The final numeric answer of a GSM8K-style text, without thousands separators, or None.

    Runs on: any process (plain function). ``text``: a completion, or a GSM8K reference (``"... #### 1,234"``).
    In order: the number after the last ``####``; the content of the last ``\\boxed{...}`` if it is a number; the
    last number in the text. E.g. ``"1234"``, ``"-3.5"``.
    """
    hashes = _HASHES.findall(text)
    if hashes:
        return str(hashes[-1]).replace(",", "")
    boxed = _BOXED.findall(text)
    if boxed and _NUMBER.fullmatch(boxed[-1].strip().strip("$")):
        return str(boxed[-1].strip().strip("$")).replace(",", "")
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def gsm8k_reward(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """GSM8K: 1.0 when the completion's final number equals the reference's, else 0.0.

    Runs on: the reward worker (or its child process); plain function. The final number is taken as in
    :func:`extract_final_number`; numbers compare exactly as decimals (``"72.0"`` equals ``"72"``). A boxed
    answer that is not a plain number (``\\boxed{\\frac{144}{2}}``) is checked with ``math-verify``. ``answer``:
    the dataset column, GSM8K's worked solution ending in ``#### <number>``, or the number alone.

    Raises:
        ValueError: a reference answer has no number (usually the wrong dataset column).
    """
    scores = []
    for i, (completion, ref) in enumerate(zip(completions, answer, strict=True)):
        gold = extract_final_number(str(ref))
        if gold is None:
            raise ValueError(
                f"gsm8k_reward: reference answer {i} ({str(ref)[-80:]!r}) holds no number. HINT: pass GSM8K's "
                "'answer' column ('... #### 72'); for LaTeX answers use math_reward."
            )
        pred = extract_final_number(completion)
        right = pred is not None and _same_number(pred, gold)
        if not right and (pred is None or "\\boxed" in completion):
            right = _verify(f"${gold}$", completion)
        scores.append(1.0 if right else 0.0)
    return scores


def math_reward(
    prompts: list[str],
    completions: list[str],
    solution: list[str] | None = None,
    answer: list[str] | None = None,
    **kwargs: Any,
) -> list[float]:
    """MATH-style answers: 1.0 when the completion's answer is mathematically equal to the reference's.

    Runs on: the reward worker (or its child process); plain function. Both sides are parsed with
    ``math-verify`` (a ``\\boxed{...}`` answer is preferred, then other LaTeX or plain expressions) and
    compared with its ``verify``: ``\\boxed{\\frac{1}{2}}`` equals ``0.5``, ``\\boxed{2x+2}`` equals
    ``2(x+1)``, sets and intervals compare as such. A reference that cannot be parsed scores every completion
    0.0 (under group-relative advantages that prompt then adds no gradient). The reference is the ``solution``
    column (a worked solution with a ``\\boxed{}`` answer), else ``answer`` (the answer alone, with or without
    ``$...$``).

    Raises:
        ValueError: the dataset has neither column.
    """
    refs = solution if solution is not None else answer
    if refs is None:
        raise ValueError(
            "math_reward needs the reference answers as a dataset column named `solution` or `answer`. "
            "HINT: rename the dataset's column (datasets.Dataset.rename_column)."
        )
    scores = []
    for completion, ref in zip(completions, refs, strict=True):
        ref = str(ref)
        gold = ref if ("$" in ref or "\\boxed" in ref or "\\(" in ref) else f"${ref}$"
        scores.append(1.0 if _verify(gold, completion) else 0.0)
    return scores


def _same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return False


def _verify(gold: str, completion: str) -> bool:
    """math-verify's parse + verify, with its signal-based timeouts only where Python allows them."""
    from math_verify import parse, verify

    timeout = _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(gold, extraction_mode="first_match", parsing_timeout=timeout)  # type: ignore[arg-type]
    if not gold_parsed:
        return False
    pred_parsed = parse(completion, parsing_timeout=timeout)  # type: ignore[arg-type]
    return bool(pred_parsed) and bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
