"""The CPU layer keeps the FSDP root unit (embeddings, head) gathered over an update's micro-batches and reduces its
gradient once: two gloo ranks, the same gradients and step as gathering it per micro-batch, fewer all-gathers, and
every parameter sharded again after the update."""

from __future__ import annotations

import functools
from typing import Any

import torch

from lightning_rlhf.cpu import CPULayer
from lightning_rlhf.engines.train import forward_response


def all_sharded(actor: Any, world: int) -> bool:
    """Whether every parameter of the actor's model is a shard (none left gathered)."""
    return all(
        type(p.data).__name__ == "DTensor" and p.data.to_local().shape[0] < p.shape[0]
        for p in actor.model.parameters()
        if p.dim() and p.shape[0] >= world
    )


def _rank(rank: int, world: int, init: str, path: str, out: str) -> None:
    """One rank: an update with the root kept and one without, on the same batch; saves rank 0's figures."""
    import torch.distributed as dist
    from test_reshard_in_update import count_gathers, scores  # tests/unit, on sys.path
    from test_zero_advantage import grouped_batch, make_actor, record_gradients

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        batch = grouped_batch(3, set(), seed=30 + rank)  # 12 rows: 4 micro-batches of 3
        saved: dict[str, Any] = {}
        for keep in (False, True):
            layer = CPULayer()
            layer.keeps_root_in_update = lambda keep=keep: keep  # type: ignore[method-assign]
            actor = make_actor(path, skip=False)
            actor.train_engine.layer = layer
            grads = record_gradients(actor)
            stop = count_gathers(dist)
            actor.update(batch)
            saved[f"gathers{keep}"] = stop()
            saved[f"grads{keep}"] = grads
            saved[f"sharded{keep}"] = all_sharded(actor, world)
            saved[f"after{keep}"] = scores(actor, batch)  # a no-grad forward, which FSDP2 ends with the root whole
            assert not all_sharded(actor, world)
            actor.train_engine.infer(batch, functools.partial(forward_response, output="logprobs"))
            saved[f"sharded_after_scoring{keep}"] = all_sharded(actor, world)  # ... the engine's infer reshards it
        torch.save(saved, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_cpu_layer_keeps_the_root_gathered_over_an_update(tiny_model: str, tmp_path: Any) -> None:
    import torch.multiprocessing as mp

    assert CPULayer().keeps_root_in_update()
    init = f"file://{tmp_path}/store"
    mp.start_processes(_rank, args=(2, init, tiny_model, str(tmp_path)), nprocs=2, start_method="spawn")
    r0 = torch.load(tmp_path / "rank0.pt")
    ref, got = r0["gradsFalse"][0], r0["gradsTrue"][0]
    largest = max(float(g.abs().max()) for g in ref.values())
    assert largest > 1e-4
    for k, g in ref.items():
        torch.testing.assert_close(got[k], g, rtol=1e-5, atol=1e-6 * largest)
    torch.testing.assert_close(r0["afterTrue"], r0["afterFalse"], rtol=0, atol=1e-5)
    assert r0["gathersFalse"] - r0["gathersTrue"] == 3  # the root: once instead of once per micro-batch (4)
    assert r0["shardedTrue"] and r0["shardedFalse"]
    assert r0["sharded_after_scoringTrue"] and r0["sharded_after_scoringFalse"]
