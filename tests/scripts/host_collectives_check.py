"""Checks FSDP2's collectives through the host's shared memory (``cpu/host_collectives.py``) under torchrun
with 2 processes; the test launches it.

- All-gathers and reduce-scatters (sum and average) of several sizes in a row (the buffer's halves alternate, the
  buffer grows) give exactly gloo's results; a call larger than ``MAX_HALF_BYTES`` takes gloo's collective.
- A tiny Qwen2 model sharded as the trainer shards it (``shard_model``: the shared-memory collectives) and the same
  model sharded with gloo's collectives give the same loss and the same sharded gradients, bitwise, over two
  micro-batches (the gradients reduced with the second) and two steps.

Rank 0 prints ``OK <rank> <shared-memory calls> <gloo calls>`` for each rank (the calls counted in the first part).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_rlhf.cpu import CPULayer, host_collectives
from lightning_rlhf.engines.train import shard_model
from lightning_rlhf.strategy.strategy import shutdown_process_groups


def collectives(rank: int) -> tuple[int, int]:
    """Each collective against gloo's; returns (shared-memory calls, gloo calls)."""
    group = dist.group.WORLD
    gathers, scatters = host_collectives.HostAllGather(), host_collectives.HostReduceScatter()
    counts = {"gloo": 0}
    plain_gather, plain_scatter = host_collectives.gloo_all_gather, host_collectives.gloo_reduce_scatter

    def counted(function):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            counts["gloo"] += 1
            return function(*args, **kwargs)

        return call

    calls = 0
    for size in (8, 1000, 24, 70_000, 70_000, 5):
        g = torch.Generator().manual_seed(size * 10 + rank)
        x = torch.randn(size, generator=g)
        got, want = torch.empty(2 * size), torch.empty(2 * size)
        gathers.allocate((2 * size,), dtype=torch.float32, device=torch.device("cpu"))
        gathers(got, x, group)
        plain_gather(want, x, group, False)
        assert torch.equal(got, want), f"all-gather of {size} differs"
        y = torch.randn(2 * size, generator=g)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            out = torch.empty(size)
            scatters(out, y, group, op)
            everything = torch.empty(4 * size)
            plain_gather(everything, y, group, False)
            parts = everything.view(2, 2, size)[:, rank]
            expected = parts[0] + parts[1]
            if op == dist.ReduceOp.AVG:
                expected = expected / 2
            assert torch.equal(out, expected), f"reduce-scatter ({op}) of {2 * size} differs"
        calls += 3
    # Over the size limit: gloo's collectives (counted), the same results.
    host_collectives.MAX_HALF_BYTES = 1024
    host_collectives.gloo_all_gather = counted(plain_gather)
    host_collectives.gloo_reduce_scatter = counted(plain_scatter)
    try:
        x = torch.full((200,), float(rank + 1))
        got = torch.empty(400)
        gathers(got, x, group)
        assert got[:200].eq(1).all() and got[200:].eq(2).all()
        out = torch.empty(100)
        scatters(out, torch.ones(200), group, dist.ReduceOp.SUM)
        assert out.eq(2).all()
        small = torch.empty(8)
        gathers(small, torch.full((4,), float(rank)), group)  # under the limit: shared memory, not counted
        assert small[:4].eq(0).all() and small[4:].eq(1).all()
        calls += 1
    finally:
        host_collectives.MAX_HALF_BYTES = 128 * 2**20
        host_collectives.gloo_all_gather, host_collectives.gloo_reduce_scatter = plain_gather, plain_scatter
    return calls, counts["gloo"]


def training(rank: int) -> None:
    """The same two steps with shared-memory and with gloo collectives: same losses and sharded gradients."""
    mesh = init_device_mesh("cpu", (2,))
    config = Qwen2Config(
        vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True,
    )  # fmt: skip
    models = []
    for host in (True, False):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        if host:
            shard_model(model, mesh, layer=CPULayer())  # the CPU layer: the host's shared-memory collectives
        else:
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        models.append(model)
    assert isinstance(models[0].model.layers[0]._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm,
                      host_collectives.HostAllGather)  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        batches = [torch.randint(0, 67, (3, 9), generator=g) for _ in range(2)]
        results = []
        for model in models:
            losses = []
            for k, ids in enumerate(batches):
                model.set_requires_gradient_sync(k == 1)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.detach())
            grads = [p.grad.to_local().clone() for p in model.parameters()]
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)  # a plain SGD step on the shards: the next gather reads it
                    p.grad = None
            results.append((losses, grads))
        (la, ga), (lb, gb) = results
        assert all(torch.equal(a, b) for a, b in zip(la, lb, strict=True)), f"step {step}: losses differ"
        assert all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True)), f"step {step}: gradients differ"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    calls, gloo = collectives(rank)
    training(rank)
    results: list[tuple[int, int, int]] = [(0, 0, 0)] * 2
    dist.all_gather_object(results, (rank, calls, gloo))
    if rank == 0:  # one writer: both ranks' lines
        print("\n".join(f"OK {r} {c} {g}" for r, c, g in results), flush=True)
    shutdown_process_groups()


if __name__ == "__main__":
    main()
