"""The head computing the log-probs in blocks (``engines/train/head.py``): the same log-probs, entropies and
gradients as the whole logits, on the left-aligned path, the shared-prompt packed path and an FSDP update over two
gloo ranks (the head's weight is the root unit's: its gradient must be reduced as before)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_forward import close, close_grad, rollout_batch
from test_zero_advantage import assert_same_gradients, grouped_batch, make_actor, record_gradients
from transformers import AutoModelForCausalLM

from lightning_rlhf.engines.train import forward_response, head


def _blocks(monkeypatch: pytest.MonkeyPatch, rows: int | None, vocab: int) -> list[int]:
    """Blocks of ``rows`` positions (None: the whole logits); returns the list each block's row count goes to."""
    monkeypatch.setattr(head, "HEAD_CHUNK_ELEMENTS", 1 << 40 if rows is None else rows * vocab)
    seen: list[int] = []
    block = head._block

    def counting(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, kw: Any) -> Any:
        seen.append(len(labels))
        return block(hidden, weight, labels, kw)

    monkeypatch.setattr(head, "_block", counting)
    return seen


def _outputs_and_grads(model: Any, batch: Any, group_size: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    out = forward_response(model, batch, output="logprobs", with_entropy=True, group_size=group_size, temperature=0.7)
    mask = batch["response_mask"].float()
    ((out["logprobs"] * batch["advantages"] + 0.1 * out["entropy"]) * mask).sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("group_size", [1, 2], ids=["left-aligned", "shared-prompts"])
def test_blocked_head_equals_the_whole_logits(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, group_size: int
) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    vocab = model.config.vocab_size
    batch = rollout_batch()
    if group_size > 1:  # pairs of rows with one prompt each: the packed forward
        for key in ("prompts", "prompt_mask"):
            batch[key] = batch[key][::2].repeat_interleave(2, 0)
    ref_out, ref_grads = _outputs_and_grads(model, batch, group_size)
    seen = _blocks(monkeypatch, 3, vocab)
    out, grads = _outputs_and_grads(model, batch, group_size)
    assert len(seen) > 2 and max(seen) == 3  # the blocked path ran, 3 positions at a time
    mask = batch["response_mask"].bool()
    close(out["logprobs"][mask], ref_out["logprobs"][mask])
    close(out["entropy"][mask], ref_out["entropy"][mask])
    head_weight = model.get_output_embeddings().weight
    assert ref_grads.keys() == grads.keys()
    assert any(p is head_weight for n, p in model.named_parameters() if n in grads)  # the head's weight learns
    for name, g in ref_grads.items():
        close_grad(grads[name], g)


def test_no_grad_blocks_are_not_recomputed(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    batch = rollout_batch()
    with torch.no_grad():
        ref = forward_response(model, batch, output="logprobs")["logprobs"]
        seen = _blocks(monkeypatch, 4, model.config.vocab_size)
        got = forward_response(model, batch, output="logprobs")["logprobs"]
    kept = len(seen) * 4 - 3  # the blocks cover the kept positions once (the last may be short)
    assert sum(seen) <= kept + 3 and len(seen) == -(-sum(seen) // 4)
    close(got[batch["response_mask"].bool()], ref[batch["response_mask"].bool()])


def _rank(rank: int, world: int, init: str, path: str, out: str) -> None:
    """One rank: an FSDP update with the whole logits, then one with the blocked head, on the same batch."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        batch = grouped_batch(2, set(), seed=40 + rank)
        saved: dict[str, Any] = {}
        for rows in (None, 5):
            actor, patch = make_actor(path, skip=False), pytest.MonkeyPatch()
            seen = _blocks(patch, rows, actor.model.config.vocab_size)
            grads = record_gradients(actor)
            actor.update(batch)
            patch.undo()
            saved[f"grads{rows}"], saved[f"blocks{rows}"] = grads, seen
        torch.save(saved, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_an_fsdp_update_with_the_blocked_head_has_the_same_gradients(tiny_model: str, tmp_path: Any) -> None:
    import torch.multiprocessing as mp

    init = f"file://{tmp_path}/store"
    mp.start_processes(_rank, args=(2, init, tiny_model, str(tmp_path)), nprocs=2, start_method="spawn")
    r0 = torch.load(tmp_path / "rank0.pt")
    assert not r0["blocksNone"] and len(r0["blocks5"]) > 4 and max(r0["blocks5"]) == 5
    assert_same_gradients(r0["grads5"], r0["gradsNone"])
