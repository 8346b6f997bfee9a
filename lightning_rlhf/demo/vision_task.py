"""The embedded visual task: "How many squares?" on a generated 56 x 56 image, answered with a digit.

Each image is white with 1 to 4 dark squares, each filling most of its own quadrant (at a small random offset); the
answer is their count, ``"1"`` to ``"4"`` (one token of the tiny vocabulary). The tiny VLM sees 4 image tokens (2 x 2
merged patches), one per quadrant, so the count is how many of them show a square. A policy that answers in the
format but ignores the image is right a quarter of the time.

The warm start (:func:`warm_start_vision`) teaches the answer format on the question **without its image**: a warm start
on the images with answers drawn at random teaches the model that the image tokens carry nothing, and its attention
leaves them (measured: under 1% of the answer position's attention after 60 such steps, and no learning from images in
200 supervised steps after it); the text-only one leaves the image tokens as the random model attends to them, and RL
(the vision tower frozen, the default) then learns to count.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from lightning_rlhf.agents.env import Environment, Episode, Message

if TYPE_CHECKING:
    import datasets

__all__ = [
    "COUNT_PROMPT",
    "CountTwiceEnvironment",
    "corner_reward",
    "count_reward",
    "draw_squares",
    "vision_dataset",
    "vision_splits",
    "warm_start_vision",
]

COUNT_PROMPT = "How many squares? Answer 1, 2, 3 or 4."
SIZE = 56
SIDE = 20
"""A square's side in pixels: 28-pixel quadrants, 3 pixels of margin and up to 2 of random offset."""


def draw_squares(quadrants: list[int], rng: random.Random) -> Any:
    """A white ``SIZE`` square image with a dark :data:`SIDE` square in each quadrant of ``quadrants`` (0 top left,
    1 top right, 2 bottom left, 3 bottom right), each offset at random by up to 2 pixels. Runs on: any process."""
    from PIL import Image, ImageDraw

    half = SIZE // 2
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for quadrant in quadrants:
        x0 = (quadrant % 2) * half + 3 + rng.randint(0, 2)
        y0 = (quadrant // 2) * half + 3 + rng.randint(0, 2)
        draw.rectangle([x0, y0, x0 + SIDE - 1, y0 + SIDE - 1], fill=(20, 20, 20))
    return image


def _count_row(rng: random.Random, count: int) -> dict[str, Any]:
    return {"prompt": COUNT_PROMPT, "image": draw_squares(rng.sample(range(4), count), rng), "answer": str(count)}


def vision_dataset(num_prompts: int, *, seed: int = 0) -> datasets.Dataset:
    """``num_prompts`` counting rows with columns ``"prompt"`` (:data:`COUNT_PROMPT`), ``"image"`` (a
    ``datasets.Image``) and ``"answer"`` (``"1"`` to ``"4"``, in turn), the drawings from ``seed``. Runs on: any
    process."""
    import datasets

    rng = random.Random(seed)
    rows = [_count_row(rng, 1 + i % 4) for i in range(num_prompts)]
    features = datasets.Features(
        {"prompt": datasets.Value("string"), "image": datasets.Image(), "answer": datasets.Value("string")}
    )
    return datasets.Dataset.from_list(rows, features=features)


def vision_splits(*, train: int = 64, test: int = 32, seed: int = 0) -> datasets.DatasetDict:
    """Training and held-out drawings (different seeds: no image is in both). Runs on: any process."""
    import datasets

    return datasets.DatasetDict(
        {"train": vision_dataset(train, seed=seed), "test": vision_dataset(test, seed=seed + 10_007)}
    )


def count_reward(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion, stripped, is its row's ``answer``; else 0.0. Runs on: any process."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


corner_reward = count_reward
"""The same exact-match reward under the name the first visual task used."""


class CountTwiceEnvironment(Environment):
    """A visual episode of two turns, an image in each: ``reset`` shows the row's image (``"image"``) with
    :data:`COUNT_PROMPT`; ``step`` answers the first reply with a second drawing of ``5 - answer`` squares and asks
    again; the reward is the share of the two replies that are right. What a multi-turn episode with an image
    observation looks like (docs/vision.md); the images are ``{"type": "image", "image": ...}`` items of the messages.
    Runs on: the rollout's process (one instance per episode)."""

    def reset(self, row: Any) -> list[Message]:
        """The row's image and the question, as the user's turn."""
        self.counts = [int(row["answer"])]
        content = [{"type": "image", "image": row["image"]}, {"type": "text", "text": COUNT_PROMPT}]
        return [{"role": "user", "content": content}]

    def step(self, message: Message) -> tuple[list[Message], bool]:
        """After the first reply, a second drawing and the question again; done after the second."""
        if len(self.counts) == 2:
            return [], True
        count = 5 - self.counts[0]
        rng = random.Random(self.counts[0])
        self.counts.append(count)
        picture = draw_squares(rng.sample(range(4), count), rng)
        return [
            {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "And here?"}]}
        ], False

    def reward(self, episode: Episode) -> float:
        """The share of the episode's (up to two) replies that give their image's count."""
        replies = [str(m.get("content", "")).strip() for m in episode.messages if m.get("role") == "assistant"]
        return sum(float(r == str(c)) for r, c in zip(replies, self.counts, strict=False)) / 2


def warm_start_vision(model_dir: str, out_dir: str, *, steps: int = 40, batch_size: int = 16, seed: int = 0) -> str:
    """Teach the answer format only: supervised steps on :data:`COUNT_PROMPT` without an image, each answer a digit
    from 1 to 4 drawn at random (the module's docstring says why without the image). Saves model and processor to
    ``out_dir``; returns it. Runs on: one process (before the run's ranks start)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    rng = random.Random(seed + 1)
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": COUNT_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    eos = processor.tokenizer.eos_token
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            texts = [prompt + str(rng.randint(1, 4)) + eos for _ in range(batch_size)]
            ids = processor.tokenizer(texts, return_tensors="pt", add_special_tokens=False)["input_ids"]
            labels = torch.full_like(ids, -100)
            labels[:, -2:] = ids[:, -2:]  # the digit and the EOS (every row has the same length)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval().save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def vision_held_out_accuracy(model_dir: str, *, seed: int = 0) -> float:
    """Mean :func:`count_reward` of the greedy answers of the model in ``model_dir`` to the held-out drawings
    (:func:`vision_splits`' ``"test"``, the demo's ``val/score/mean`` prompts). Runs on: any process."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    test = vision_splits(seed=seed)["test"]
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": COUNT_PROMPT}]}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    enc = processor(
        text=[prompt] * len(test), images=list(test["image"]), return_tensors="pt", add_special_tokens=False
    )
    with torch.no_grad():
        answers = model(**enc).logits[:, -1].argmax(-1)  # the answer is one token: greedy = the most likely one
    completions = processor.tokenizer.batch_decode(answers[:, None], skip_special_tokens=True)
    rewards = count_reward([prompt] * len(test), completions, list(test["answer"]))
    return sum(rewards) / len(rewards)
