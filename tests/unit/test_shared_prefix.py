"""Training forwards that compute each group's prompt once: the same log-probs, entropies and gradients as one row at
a time, and a fallback wherever the rows are not whole groups of one prompt."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf.batch import Batch
from lightning_rlhf.engines.train import forward_response
from lightning_rlhf.engines.train.prefix import shares_prompts
from tests.unit.test_forward import close, close_grad


def grouped_batch(groups: int = 3, n: int = 4, seed: int = 0) -> Batch:
    """``groups`` prompts (left-padded, of different lengths), ``n`` samples each (right-padded, ragged)."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])[:groups]
    prompts = torch.randint(4, 18, (groups, 4), generator=g) * prompt_mask
    lengths = torch.randint(1, 6, (groups * n,), generator=g)
    mask = (torch.arange(5)[None] < lengths[:, None]).long()
    return Batch(
        {
            "prompts": prompts.repeat_interleave(n, 0),
            "prompt_mask": prompt_mask.repeat_interleave(n, 0),
            "responses": torch.randint(4, 18, (groups * n, 5), generator=g) * mask,
            "response_mask": mask,
        },
        meta={"group_size": n},
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_shared_prompt_gives_the_per_row_outputs_and_gradients(
    tiny_model: str, attn: str, temperature: float
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attn)
    batch = grouped_batch()
    mask = batch["response_mask"].bool()
    assert shares_prompts(model, batch, 4)
    outputs, grads = [], []
    for group_size in (1, 4):
        model.zero_grad()
        out = forward_response(
            model, batch, output="logprobs", temperature=temperature, with_entropy=True, group_size=group_size
        )
        (out["logprobs"][mask].sum() + 0.3 * out["entropy"][mask].sum()).backward()
        outputs.append(out)
        grads.append([p.grad.clone() for p in model.parameters()])
    for key in ("logprobs", "entropy"):
        close(outputs[1][key][mask], outputs[0][key][mask])
    for packed, per_row in zip(grads[1], grads[0], strict=True):
        close_grad(packed, per_row)
    assert model.config._attn_implementation == attn  # the packed call put the model's attention back


def test_rows_that_are_not_whole_groups_fall_back(tiny_model: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    batch = grouped_batch()
    assert not shares_prompts(model, batch, 1)  # off
    assert not shares_prompts(model, batch, 5)  # 12 rows are not groups of 5
    assert not shares_prompts(model, batch.select(torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])), 4)  # interleaved groups
    assert not shares_prompts(model, batch.select(torch.arange(1, 9)), 4)  # groups cut across
    other = Batch({**batch.tensors, "prompt_mask": batch["prompt_mask"].clone()})
    other["prompt_mask"][1, 0] = 1 - other["prompt_mask"][1, 0]  # same tokens, another padding: not one prompt
    assert not shares_prompts(model, other, 4)
    holed = Batch({**batch.tensors, "response_mask": batch["response_mask"].clone()})
    holed["response_mask"][0, :2] = torch.tensor([0, 1])  # not a response then its padding: the packed layout's form
    assert not shares_prompts(model, holed, 4)
    model.config.model_type = "gpt2"  # an architecture the packed attention does not know
    assert not shares_prompts(model, batch, 4)
