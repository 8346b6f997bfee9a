"""Checks deferred loading + FSDP2 + ``materialize`` under torchrun with 2 processes; the test launches it.

Usage: ``torchrun --nproc-per-node 2 sharded_load.py CASE [CASE ...]`` where CASE is ``KIND:DTYPE:PATH`` with KIND
``causal`` (AutoModelForCausalLM), ``token`` (AutoModelForTokenClassification, num_labels=1) or ``seq``
(AutoModelForSequenceClassification, num_labels=1).

For each case every rank builds the reference with ``from_pretrained`` (whole, unsharded) and the deferred model
(``load_pretrained`` on meta, ``shard_model``, ``materialize``), then checks that each parameter's ``to_local()``
equals exactly the FSDP2 rows ``[r*ceil(n/w), min((r+1)*ceil(n/w), n))`` of the reference (fresh heads: of the
rank-independent fresh value, checked equal across ranks with an all-gather), and that the sharded forward
gives the reference's outputs. Prints one line per case and rank:
``OK <kind> <rank> <bytes read> <checkpoint bytes of the model's tensors> <local bytes> <fresh names>``.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

from lightning_rlhf.engines.train.fsdp import shard_model
from lightning_rlhf.engines.train.loading import load_pretrained, materialize
from lightning_rlhf.strategy.strategy import shutdown_process_groups

CLASSES = {
    "causal": (AutoModelForCausalLM, {}),
    "token": (AutoModelForTokenClassification, {"num_labels": 1}),
    "seq": (AutoModelForSequenceClassification, {"num_labels": 1}),
}


def check_case(kind: str, dtype_name: str, path: str, rank: int, world: int) -> str:
    """One case; returns the OK line. Runs on: every rank (collectives in the forward and the all-gathers)."""
    auto, kwargs = CLASSES[kind]
    dtype = getattr(torch, dtype_name)
    reference = auto.from_pretrained(path, dtype=dtype, **kwargs)
    model = load_pretrained(auto, path, setting=f"case {kind}", dtype=dtype, deferred=True, **kwargs)
    assert all(p.is_meta for p in model.parameters()), "deferred parameters must be on meta"
    mesh = init_device_mesh("cpu", (world,))
    shard_model(model, mesh)
    report = materialize(model, device=torch.device("cpu"))
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        local = param.to_local()
        rows = param.shape[0]
        chunk = math.ceil(rows / world)
        first = min(rank * chunk, rows)
        count = min(first + chunk, rows) - first
        assert tuple(local.shape) == (count, *param.shape[1:]), (name, local.shape, count)
        if name in report.fresh:
            full = param.full_tensor()  # an all-gather: the fresh value must be the same on every rank
            gathered = [torch.empty_like(full) for _ in range(world)]
            dist.all_gather(gathered, full)
            assert all(torch.equal(g, full) for g in gathered), f"fresh {name} differs across ranks"
            assert torch.equal(local, full.narrow(0, first, count)), name
            continue
        want = ref_params[name].detach().narrow(0, first, count)
        assert local.dtype == want.dtype and torch.equal(local, want), f"{kind}: rows of {name} differ on rank {rank}"
    for name, buf in reference.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), f"buffer {name} differs"
    if kind == "causal":
        assert model.lm_head.weight is model.model.embed_tokens.weight or not reference.config.tie_word_embeddings
    ids = torch.tensor([[1, 5, 9, 14, 30, 2], [1, 7, 7, 40, 41, 2]])
    with torch.no_grad():
        out = model(input_ids=ids).logits
        if report.fresh:  # the reference's head is random: compare through the backbone instead
            want_out = model.model(input_ids=ids).last_hidden_state
            ref_out = reference.model(input_ids=ids).last_hidden_state
            assert torch.equal(want_out, ref_out), f"{kind}: backbone outputs differ"
        else:
            ref_out = reference(input_ids=ids).logits
            assert torch.equal(out, ref_out), f"{kind}: outputs differ (max {float((out - ref_out).abs().max())})"
    fresh = ",".join(report.fresh) or "-"
    return f"OK {kind} {rank} {report.bytes_read} {report.checkpoint_bytes} {report.local_bytes} {fresh}"


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lines = []
    for case in sys.argv[1:]:
        kind, dtype_name, path = case.split(":", 2)
        lines.append(check_case(kind, dtype_name, path, rank, world))
    # one write per line: the two ranks share stdout, and print() may write its parts separately
    for line in lines:
        sys.stdout.write(line + "\n")
    sys.stdout.flush()
    dist.barrier()
    shutdown_process_groups()  # not a bare destroy: see its docstring (an exit-time abort)


if __name__ == "__main__":
    main()
