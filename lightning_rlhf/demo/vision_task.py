"""The embedded visual task: "Where is the square?" on a generated 56 x 56 image, answered with its quadrant's number.

Each image is white with one filled square of a random colour and size in one of the four quadrants (at a random
place inside it); the answer is ``"1"`` (top left), ``"2"`` (top right), ``"3"`` (bottom left) or ``"4"`` (bottom
right), one token of the tiny vocabulary. The tiny VLM sees 4 image tokens (2 x 2 merged patches), one per quadrant:
the answer is where the one that differs sits. A policy that answers in the format but ignores the image is right a
quarter of the time.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

__all__ = ["CORNERS", "VISION_PROMPT", "corner_reward", "draw_square", "vision_dataset", "vision_splits"]

CORNERS = ("top left", "top right", "bottom left", "bottom right")
VISION_PROMPT = "Where is the square? 1 top left, 2 top right, 3 bottom left, 4 bottom right."
SIZE = 56
_COLOURS = ((220, 30, 30), (30, 160, 40), (40, 60, 220), (20, 20, 20), (230, 150, 20))


def draw_square(corner: int, rng: random.Random) -> Any:
    """A white ``SIZE`` square image with a filled square of a random colour and side inside quadrant ``corner``
    (0..3, in :data:`CORNERS` order). Runs on: any process."""
    from PIL import Image, ImageDraw

    half = SIZE // 2
    side = rng.randint(12, 22)
    x0 = (corner % 2) * half + rng.randint(1, half - side - 1)
    y0 = (corner // 2) * half + rng.randint(1, half - side - 1)
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    ImageDraw.Draw(image).rectangle([x0, y0, x0 + side, y0 + side], fill=rng.choice(_COLOURS))
    return image


def vision_dataset(num_prompts: int, *, seed: int = 0) -> datasets.Dataset:
    """``num_prompts`` rows with columns ``"prompt"`` (:data:`VISION_PROMPT`), ``"image"`` (a ``datasets.Image``) and
    ``"answer"`` (the square's quadrant, ``"1"`` to ``"4"``), the quadrants in turn, the drawings from ``seed``. Runs
    on: any process."""
    import datasets

    rng = random.Random(seed)
    corners = [i % len(CORNERS) for i in range(num_prompts)]
    features = datasets.Features(
        {"prompt": datasets.Value("string"), "image": datasets.Image(), "answer": datasets.Value("string")}
    )
    return datasets.Dataset.from_dict(
        {
            "prompt": [VISION_PROMPT] * num_prompts,
            "image": [draw_square(c, rng) for c in corners],
            "answer": [str(c + 1) for c in corners],
        },
        features=features,
    )


def vision_splits(*, train: int = 64, test: int = 16, seed: int = 0) -> datasets.DatasetDict:
    """Training and held-out drawings (different seeds: no image is in both). Runs on: any process."""
    import datasets

    return datasets.DatasetDict(
        {"train": vision_dataset(train, seed=seed), "test": vision_dataset(test, seed=seed + 10_007)}
    )


def corner_reward(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion, stripped, is its row's ``answer``; else 0.0. Runs on: any process."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def warm_start_vision(model_dir: str, out_dir: str, *, steps: int = 60, batch_size: int = 16, seed: int = 0) -> str:
    """Teach the tiny VLM in ``model_dir`` the answer format, not the task: supervised steps on the training drawings
    whose target corner is drawn at random (independent of the image), so the model answers with one of the four
    corners about evenly, right a quarter of the time. Saves model and processor to ``out_dir``; returns it.
    Runs on: one process (before the run's ranks start)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    data = vision_splits(seed=seed)["train"]
    rng = random.Random(seed)
    eos = processor.tokenizer.eos_token
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            rows = [data[rng.randrange(len(data))] for _ in range(batch_size)]
            chats = [
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["prompt"]}]}] for r in rows
            ]
            prompts = [processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
            texts = [p + str(rng.randint(1, len(CORNERS))) + eos for p in prompts]
            enc = processor(text=texts, images=[r["image"] for r in rows], return_tensors="pt", padding=True)
            enc_prompt = processor(text=prompts, images=[r["image"] for r in rows], return_tensors="pt", padding=True)
            labels = enc["input_ids"].clone()
            labels[enc["attention_mask"] == 0] = -100
            for i, n in enumerate(enc_prompt["attention_mask"].sum(1).tolist()):
                start = int((enc["attention_mask"][i] == 0).sum())  # left or right padding: the real tokens' start
                labels[i, start : start + n] = -100
            loss = model(**enc, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval().save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir
