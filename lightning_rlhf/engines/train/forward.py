"""Forward passes over (prompt, response) sequences, returning per-response-token outputs.

Layout of a rollout batch (same as the rollout engines produce):
``prompts [B, P]`` left-padded with ``prompt_mask``; ``responses [B, R]`` right-padded with
``response_mask`` (1 up to and including the EOS). Position ids follow the attention mask, so a left-padded
prompt sees the positions it saw during generation.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from lightning_rlhf.algorithms import entropy_from_logits, logprobs_from_logits
from lightning_rlhf.batch import Batch

__all__ = ["forward_response", "sequence_inputs"]


def sequence_inputs(batch: Batch, device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` (all ``[B, P + R]``) of a rollout batch.

    Runs on: worker.
    """
    input_ids = torch.cat([batch["prompts"], batch["responses"]], dim=1).to(device)
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).to(device)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def forward_response(
    model: nn.Module,
    batch: Batch,
    *,
    output: Literal["logprobs", "values"],
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> dict[str, Tensor]:
    """Run ``model`` on the batch and return outputs aligned with ``responses`` (``[B, R]`` each).

    Runs on: worker (every rank of the role together: the model is FSDP-sharded).

    Args:
        model: a causal LM (``output="logprobs"``) or a token classifier with one label (``"values"``).
        batch: a rollout batch (see the module docstring).
        output: ``"logprobs"`` gives ``logprobs`` (and ``entropy`` if asked); ``"values"`` gives ``values``.
        temperature: logits are divided by it, matching how the rollout was sampled.
        with_entropy: also return the per-token entropy of the (tempered) distribution.
    """
    device = next(model.parameters()).device
    input_ids, attention_mask, position_ids = sequence_inputs(batch, device)
    resp_len = batch["responses"].shape[1]
    if output == "values":
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        # The value of the state before response token t sits at the position that predicts t.
        return {"values": logits[:, -resp_len - 1 : -1, 0].float()}
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=resp_len + 1,
    ).logits[:, :-1]
    logits = logits.float() / temperature
    out = {"logprobs": logprobs_from_logits(logits, input_ids[:, -resp_len:])}
    if with_entropy:
        out["entropy"] = entropy_from_logits(logits)
    return out
