"""``RLHFStrategy(reshard_in_update=False)``: an update keeps every FSDP unit whole from its first forward to its
optimizer step and reduce-scatters the gradients once; a scoring call gathers each unit once for all its
micro-batches. Two gloo ranks: the same gradients and log-probs as FSDP2's default, the shards stepped (a later
forward sees the new weights), and the model sharded again after the update and after the scoring call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_rlhf.batch import Batch
from lightning_rlhf.engines.train import forward_response


def _rank(rank: int, world: int, init: str, path: str, out: str, dtype: str | None) -> None:
    """One rank: an update with each setting on the same batch; saves rank 0's gradients and log-probs."""
    import torch.distributed as dist
    from test_zero_advantage import grouped_batch, make_actor, record_gradients  # tests/unit, on sys.path

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        batch = grouped_batch(3, set(), seed=20 + rank)  # 12 rows: 4 micro-batches of 3
        saved: dict[str, Any] = {}
        for reshard in (True, False):
            actor = make_actor(path, skip=False, param_dtype=dtype)
            actor.train_engine.reshard_in_update = reshard
            before = scores(actor, batch)
            grads = record_gradients(actor)
            actor.update(batch)
            saved[f"sharded{reshard}"] = all(
                type(p.data).__name__ == "DTensor" and p.data.to_local().shape[0] < p.shape[0]
                for p in actor.model.parameters()
                if p.dim() and p.shape[0] >= world
            )
            saved[f"grads{reshard}"] = grads
            saved[f"before{reshard}"] = before
            saved[f"after{reshard}"] = scores(actor, batch)
            stop = count_gathers(dist)
            inferred = actor.train_engine.infer(batch, lambda m, micro: forward_response(m, micro, output="logprobs"))
            saved[f"gathers{reshard}"] = stop()
            saved[f"inferred{reshard}"] = inferred["logprobs"] * batch["response_mask"]
            saved[f"resharded{reshard}"] = all(
                type(p.data).__name__ == "DTensor" and p.data.to_local().shape[0] < p.shape[0]
                for p in actor.model.parameters()
                if p.dim() and p.shape[0] >= world
            )
        torch.save(saved, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def count_gathers(dist: Any) -> Callable[[], int]:
    """Count the all-gathers FSDP2 issues from now on (on CPU through the host's shared memory, else gloo's); the
    returned call stops counting and gives the count."""
    from lightning_rlhf.cpu.host_collectives import HostAllGather

    originals = (dist.all_gather_single, HostAllGather.__call__)
    calls = [0]

    def counting(function: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return function(*args, **kwargs)

        return counted

    def stop() -> int:
        dist.all_gather_single, HostAllGather.__call__ = originals
        return calls[0]

    dist.all_gather_single = counting(originals[0])
    HostAllGather.__call__ = counting(originals[1])  # type: ignore[method-assign]
    return stop


def scores(actor: Any, batch: Batch) -> Tensor:
    """The model's log-probs of the batch's responses (a no-grad FSDP forward)."""
    with torch.no_grad():
        return forward_response(actor.model, batch, output="logprobs")["logprobs"] * batch["response_mask"]


@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["fp32", "bf16-compute"])
def test_an_update_without_resharding_takes_the_same_gradients_and_steps_the_shards(
    tiny_model: str, tmp_path: Any, dtype: str | None
) -> None:
    import torch.multiprocessing as mp

    init = f"file://{tmp_path}/store"
    mp.start_processes(_rank, args=(2, init, tiny_model, str(tmp_path), dtype), nprocs=2, start_method="spawn")
    r0 = torch.load(tmp_path / "rank0.pt")
    ref, got = r0["gradsTrue"][0], r0["gradsFalse"][0]
    largest = max(float(g.abs().max()) for g in ref.values())
    assert largest > 1e-4
    for k, g in ref.items():  # bf16 compute: gradients reduced in float32 either way
        torch.testing.assert_close(got[k], g, rtol=1e-5 if dtype is None else 2e-2, atol=1e-6 * largest)
    moved = float((r0["afterTrue"] - r0["beforeTrue"]).abs().max())
    assert moved > 1e-3  # the step changed what the model computes ...
    assert float((r0["afterFalse"] - r0["afterTrue"]).abs().max()) < moved / 20  # ... in both settings alike
    assert r0["shardedTrue"] and r0["shardedFalse"]  # sharded again after the update
    # A scoring call over 4 micro-batches: each unit gathered once without resharding, once per micro-batch with;
    # the same log-probs, and every unit sharded again after it (FSDP2's default leaves the root unit whole after a
    # no-grad forward, so only the setting's own path is checked for that).
    assert r0["gathersTrue"] == 4 * r0["gathersFalse"] > 0
    torch.testing.assert_close(r0["inferredFalse"], r0["inferredTrue"], rtol=0, atol=5e-3 if dtype else 1e-5)
    assert r0["reshardedFalse"]
