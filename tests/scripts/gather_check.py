"""Checks ``full_tensors`` (bucketed exchanges of FSDP2 shards: gloo's all-gather, or the host's shared memory)
under torchrun with 2 processes; the test launches it.

A tiny Qwen2 model sharded as the trainer shards it, plus parameters whose rows split unevenly (5 rows: 3 + 2;
1 row: 1 + 0): every bucket size and both transports must give exactly ``full_tensor()`` of each parameter, in
``named_parameters()`` order, cast when asked, with the bytes received counted; views of the shared buffer stay
right over several hand-offs; a group whose ranks cannot all map the buffer falls back on every rank. Prints
``FALLBACK <rank>`` and ``OK <rank> <float32 bytes received> <elements in the model>``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_rlhf.cpu import CPULayer, host_share
from lightning_rlhf.engines.train import full_tensors, shard_model
from lightning_rlhf.strategy.strategy import shutdown_process_groups


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=67, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    model.register_parameter("odd", nn.Parameter(torch.randn(5, 3)))
    model.register_parameter("single", nn.Parameter(torch.randn(1, 4)))
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    shard_model(model, mesh)
    layer = CPULayer()  # the shared transport is the CPU layer's host buffer
    got = []
    for transport in ("collective", "shared"):
        for bucket_bytes in (1, 200, 64 << 20):  # one parameter per bucket, several, all in one
            for dtype in (None, torch.bfloat16):
                received = [0]
                stream = list(
                    full_tensors(
                        model, received, dtype=dtype, bucket_bytes=bucket_bytes, transport=transport, layer=layer
                    )
                )
                assert [n for n, _ in stream] == list(expected), [n for n, _ in stream]
                for name, tensor in stream:
                    want = expected[name] if dtype is None else expected[name].to(dtype)
                    assert tensor.dtype == want.dtype and torch.equal(tensor, want), (transport, name, bucket_bytes)
                got.append(received[0])
    assert len(set(got[0::2])) == 1 and len(set(got[1::2])) == 1 and got[0] == 2 * got[1], got
    # views of the shared buffer, consumed as an engine does (each copied before the next is taken), over several
    # hand-offs whose buckets take the buffer's halves in turn; the weights change between hand-offs
    for handoff in range(3):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        now = {name: p.full_tensor() for name, p in model.named_parameters()}
        engine = {}
        for name, tensor in full_tensors(model, bucket_bytes=200, transport="shared", views=True, layer=layer):
            engine[name] = tensor.clone()
        for name, want in now.items():
            assert torch.equal(engine[name], want) and not torch.equal(want, expected[name]), (handoff, name)
    # no room for a larger buffer (here /dev/shm refuses the file): this request falls back, the buffer the group
    # has stays for the requests it fits, and the refused size is not asked of the ranks again
    group = dist.group.WORLD
    have = host_share.host_buffer(group, 1)
    assert have is not None
    create = host_share._create
    host_share._create = lambda nbytes: None  # type: ignore[assignment]
    assert host_share.host_buffer(group, have.half_bytes * 4) is None
    host_share._create = create  # type: ignore[assignment]
    assert host_share.host_buffer(group, have.half_bytes) is have
    assert host_share.host_buffer(group, have.half_bytes * 8) is None  # no collective: a rank asking alone returns
    single = dist.new_group([0])
    if rank == 0:
        assert host_share.host_buffer(single, 64) is None  # one rank: nothing to exchange
    # a process group whose ranks cannot all map the file (here rank 1 is refused, as on another host): every rank
    # falls back to the collective, and transport="shared" says why
    refuse = host_share._map if rank == 0 else lambda path, nbytes: None
    host_share._map = refuse  # type: ignore[assignment]
    other = dist.new_group([0, 1])
    assert host_share.host_buffer(other, 1024) is None
    assert not any(n.startswith("lightning_rlhf-") for n in os.listdir(host_share.SHM_DIR) if str(os.getpid()) in n)
    sys.stdout.write(f"FALLBACK {rank}\n")
    numel = sum(t.numel() for t in expected.values())
    sys.stdout.write(f"OK {rank} {got[0]} {numel}\n")
    sys.stdout.flush()
    dist.barrier()
    shutdown_process_groups()  # not a bare destroy: see its docstring (an exit-time abort)
    os._exit(0)  # as reshard_check.py: no interpreter finalisation under gloo's threads


if __name__ == "__main__":
    main()
