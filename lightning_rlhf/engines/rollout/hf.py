"""Rollouts with plain transformers ``generate``: the reference engine, and the one used where vLLM is absent.

It keeps its own unsharded copy of the actor in inference layout, so each rank generates for its own prompts
without any collective (ranks finish at different lengths without waiting for one another). After every
actor update the copy is refreshed one parameter at a time from the FSDP shards (``load_weights``). On a GPU
the copy is moved to host memory while training runs (``sleep``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from lightning_rlhf.engines.rollout.base import RolloutOutput, SamplingParams

__all__ = ["HFRolloutEngine"]


class HFRolloutEngine:
    """Rollout engine on a transformers causal LM.

    Runs on: every worker rank.

    Args:
        model: the actor before sharding; the engine deep-copies it.
        pad_token_id: padding id of the tokenizer.
        eos_token_id: end-of-sequence id of the tokenizer.
        device: where to generate.
        generation_batch_size: prompts per ``generate`` call.
        dtype: dtype of the engine's copy (the training compute dtype, e.g. bfloat16 on GPUs); None keeps the
            actor's.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_token_id: int,
        eos_token_id: int,
        device: torch.device,
        generation_batch_size: int = 64,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model: Any = copy.deepcopy(model).to(device=device, dtype=dtype).eval().requires_grad_(False)
        self._params = dict(self.model.named_parameters())
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.device = device
        self.generation_batch_size = generation_batch_size

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample ``params.n`` responses per prompt; see :class:`RolloutEngine`. Runs on: worker."""
        stops = {self.eos_token_id, *params.stop_token_ids}
        config = GenerationConfig(
            do_sample=not params.greedy,
            temperature=params.temperature if not params.greedy else None,
            top_p=params.top_p if not params.greedy else None,
            top_k=params.top_k if not params.greedy else None,
            max_new_tokens=params.max_new_tokens,
            num_return_sequences=params.n,
            eos_token_id=sorted(stops),
            pad_token_id=self.pad_token_id,
        )
        responses: list[list[int]] = []
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(params.seed)
            for start in range(0, len(prompts), self.generation_batch_size):
                chunk = prompts[start : start + self.generation_batch_size]
                ids, mask = self._left_pad(chunk)
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
                responses.extend(_cut_at_stop(row, stops) for row in out[:, ids.shape[1] :].tolist())
        return RolloutOutput(responses=responses)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            if p:
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """Copy new weights in by transformers name; unknown names raise. Runs on: worker."""
        received = 0
        with torch.no_grad():
            for name, tensor in weights:
                param = self._params.get(name)
                if param is None:
                    raise KeyError(f"HFRolloutEngine.load_weights: the engine has no parameter {name!r}")
                param.copy_(tensor)
                received += tensor.numel() * tensor.element_size()
        return received

    def sleep(self) -> None:
        """Move the weights to host memory on a GPU; nothing to free on CPU. Runs on: worker."""
        if self.device.type != "cpu":
            self.model.to("cpu")

    def wake_up(self) -> None:
        """Bring the weights back to the device. Runs on: worker."""
        if self.device.type != "cpu":
            self.model.to(self.device)


def _cut_at_stop(row: list[int], stops: set[int]) -> list[int]:
    """Keep tokens up to and including the first stop token (the rest is padding)."""
    for i, tok in enumerate(row):
        if tok in stops:
            return row[: i + 1]
    return row
