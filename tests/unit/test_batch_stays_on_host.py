"""The controller's batches stay in host memory whatever the accelerator (a GPU run once failed in its first
scoring call: Lightning had moved the prompts to the GPU while the rollout's responses came back to the host)."""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_rlhf import RLHFStrategy
from lightning_rlhf.batch import Batch


def test_lightning_does_not_move_the_controllers_batch() -> None:
    batch = Batch({"prompts": torch.ones(2, 3, dtype=torch.long), "prompt_mask": torch.ones(2, 3, dtype=torch.long)})
    meta = torch.device("meta")  # any device other than the host's; the default hook would move every tensor there
    assert ModelParallelStrategy.batch_to_device(RLHFStrategy(rollout="hf"), batch, meta)["prompts"].device == meta
    out = RLHFStrategy(rollout="hf").batch_to_device(batch, meta)
    assert all(t.device.type == "cpu" for t in (out["prompts"], out["prompt_mask"]))
    assert torch.equal(out["prompts"], batch["prompts"])
