"""A second synthetic task for docs/your-own-task.md: "Which is larger, 41 or 19? Answer:" -> "41".

    python larger_task.py                 # writes train.jsonl (1,000 pairs) and heldout.jsonl (100 other pairs)

The reward is exact match: 1.0 when the completion, stripped, is the larger number, else 0.0. Recipes name it
``larger_task.larger_reward``: run ``lightning-rlhf`` from this folder so that it imports.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any


def make_rows(count: int, *, seed: int, exclude: set[tuple[int, int]] = frozenset()) -> list[dict[str, str]]:
    """``count`` distinct pairs ``a != b`` of numbers 0..99 (none in ``exclude``), as prompt/answer rows."""
    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    seen = set(exclude)
    while len(pairs) < count:
        a, b = rng.randrange(100), rng.randrange(100)
        if a != b and (a, b) not in seen:
            seen.add((a, b))
            pairs.append((a, b))
    return [{"prompt": f"Which is larger, {a} or {b}? Answer:", "answer": str(max(a, b))} for a, b in pairs]


def write_data(folder: str | Path = ".", *, train: int = 1000, heldout: int = 100, seed: int = 0) -> None:
    """Write ``train.jsonl`` and ``heldout.jsonl`` (no pair in both) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train_rows = make_rows(train, seed=seed)
    used = {(int(r["prompt"].split()[3].rstrip(",")), int(r["prompt"].split()[5].rstrip("?"))) for r in train_rows}
    for name, rows in (("train", train_rows), ("heldout", make_rows(heldout, seed=seed + 1, exclude=used))):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def larger_reward(prompts: list[str], completions: list[str], answer: list[str], **columns: Any) -> list[float]:
    """1.0 when the completion is exactly the larger number, else 0.0 (TRL's reward-function convention)."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for train.jsonl and heldout.jsonl")
    parser.add_argument("--train", type=int, default=1000)
    parser.add_argument("--heldout", type=int, default=100)
    args = parser.parse_args()
    write_data(args.out, train=args.train, heldout=args.heldout)
