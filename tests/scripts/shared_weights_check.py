"""Checks the colocated engines' shared weight store (``cpu/shared_weights.py``) under torchrun with 2
processes; the test launches it.

A tiny Qwen2 model (query/key/value biases, tied head, a parameter whose rows split unevenly) sharded as the trainer
shards it, and one transformers engine per rank built from the unsharded model: after each hand-off the engine's
parameters are exactly the full weights (cast to a bfloat16 engine's dtype too), its fused projections lie as one
tensor in the store (no copy when the loop fuses them), the weights change between hand-offs and the engine follows,
both ranks sample what an engine built from the full weights samples, and ``load_weights`` takes a private copy
first (the store keeps what the hand-off wrote), and only the first hand-off walks the parameters (the later ones make
the listed copies: cast rows, rows FSDP2 pads). Prints ``OK <rank> <dtype> <bytes received> <walks>`` per engine
dtype.

Then the shards placed in the store (a model whose rows all split evenly, float32): after the first hand-off every
FSDP2 shard of the rank is a view of its rows in the store (FSDP2's own flat buffer included); real training steps
(FSDP forward and backward, AdamW) then update the engine's weights in place, later hand-offs write nothing, and the
engine still samples what an engine built from the full weights samples. Prints ``PLACED <rank> <writes>``.

Then a bfloat16 engine fed by float32 shards stepped by AdamW: every hand-off casts the rows (with the CPU kernels,
one compiled cast per hand-off; without them, ``copy_``), a shard changed by hand included, and the engine's weights
are exactly the trainer's in bfloat16. Prints ``BF16 <rank> <compiled casts>``.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_rlhf.cpu import CPULayer, shared_weights
from lightning_rlhf.cpu.decode import _fused_rows
from lightning_rlhf.cpu.native import CastPlan
from lightning_rlhf.cpu.shared_weights import SharedWeights, shards_in_place
from lightning_rlhf.engines.rollout import HFRolloutEngine, SamplingParams
from lightning_rlhf.engines.train import shard_model
from lightning_rlhf.strategy.strategy import shutdown_process_groups

CPU = torch.device("cpu")


def samples_like_full_weights(engine: HFRolloutEngine, unsharded: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """What ``engine`` samples is what an engine built from the ``full`` weights samples."""
    with torch.no_grad():
        for name, p in unsharded.named_parameters():
            p.copy_(full[name])
    fresh = HFRolloutEngine(
        unsharded, pad_token_id=0, eos_token_id=1, device=CPU, dtype=engine.dtype, decode_loop=CPULayer().decode_loop()
    )
    params = SamplingParams(n=2, max_new_tokens=5, min_new_tokens=5, seed=3)
    got, want = engine.generate(PROMPTS, params), fresh.generate(PROMPTS, params)
    assert got.responses == want.responses, (engine.dtype, got.responses, want.responses)
    assert got.logprobs == want.logprobs


PROMPTS = [[5, 6, 7], [8, 9]]


def qwen2(vocab_size: int) -> Qwen2Config:
    """The tiny model's configuration (query/key/value biases, tied head)."""
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip


WRITE_SHARDS = shared_weights.write_shards


def counting_writes() -> list[int]:
    """Count the hand-offs' calls of ``write_shards`` (each rank's rows of every parameter, after which the store
    lists the copies that keep them up to date); put it back with ``shared_weights.write_shards = WRITE_SHARDS``."""
    writes = [0]

    def counting(*args: object, **kwargs: object) -> None:
        writes[0] += 1
        WRITE_SHARDS(*args, **kwargs)  # type: ignore[arg-type]

    shared_weights.write_shards = counting  # type: ignore[assignment]
    return writes


def placed_shards(rank: int, mesh: object, config: Qwen2Config) -> None:
    """Training steps with every shard placed in the store: the hand-off writes once, then only agrees."""
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config).train()
    unsharded = copy.deepcopy(model)
    engine = HFRolloutEngine(
        model, pad_token_id=0, eos_token_id=1, device=CPU, dtype=torch.float32, decode_loop=CPULayer().decode_loop()
    )
    shard_model(model, mesh, layer=CPULayer())  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = SharedWeights.attempt(engine, model)
    assert store is not None
    writes = counting_writes()
    generator = torch.Generator().manual_seed(rank)
    for step in range(3):
        ids = torch.randint(2, 67, (2, 6), generator=generator)  # each rank its own data
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        store.hand_off([0])
        assert shards_in_place(model, store.views), step
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, full[name]), (step, name)
            assert param.data_ptr() == store.views[name].data_ptr()
        for name, param in model.named_parameters():  # FSDP2's flat buffer reads the same rows
            local = param.to_local()
            rows = store.views[name][rank * local.shape[0] : (rank + 1) * local.shape[0]]
            assert local.data_ptr() == rows.data_ptr(), name
        for module in model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            group = state()._fsdp_param_group if state is not None else None
            for unit in group.fsdp_params if group is not None else ():
                assert unit._sharded_param_data.data_ptr() == unit.sharded_param.to_local().data_ptr()
        samples_like_full_weights(engine, unsharded, full)
    shared_weights.write_shards = WRITE_SHARDS
    sys.stdout.write(f"PLACED {rank} {writes[0]}\n")
    sys.stdout.flush()


def bf16_engine_steps(rank: int, mesh: object, config: Qwen2Config) -> None:
    """Training steps of float32 shards for a bfloat16 engine: each hand-off casts the rows."""
    torch.manual_seed(2)
    model = Qwen2ForCausalLM(config).train()
    unsharded = copy.deepcopy(model)
    engine = HFRolloutEngine(
        model, pad_token_id=0, eos_token_id=1, device=CPU, dtype=torch.bfloat16, decode_loop=CPULayer().decode_loop()
    )
    shard_model(model, mesh, layer=CPULayer())  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    store = SharedWeights.attempt(engine, model)
    assert store is not None
    casts, cast = [0], CastPlan.__call__

    def counting(plan: CastPlan) -> None:
        casts[0] += 1
        cast(plan)

    CastPlan.__call__ = counting  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(rank)
    for step in range(4):
        ids = torch.randint(2, 67, (2, 6), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 3:  # an edit by hand after the step: the hand-off casts it too
            with torch.no_grad():
                next(model.parameters()).to_local().add_(0.5)
        store.hand_off([0])
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, full[name].to(torch.bfloat16)), (step, name)
        samples_like_full_weights(engine, unsharded, full)
    CastPlan.__call__ = cast  # type: ignore[method-assign]
    sys.stdout.write(f"BF16 {rank} {casts[0]}\n")
    sys.stdout.flush()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    placed_shards(rank, mesh, qwen2(vocab_size=68))  # every row count even: every shard can be placed
    bf16_engine_steps(rank, mesh, qwen2(vocab_size=68))
    torch.manual_seed(0)
    config = qwen2(vocab_size=67)  # the embedding's rows split 34 + 33: FSDP2 pads rank 1's shard
    model = Qwen2ForCausalLM(config).eval()
    model.model.layers[0].mlp.register_parameter("odd", nn.Parameter(torch.randn(5, 3)))  # 3 + 2 rows
    unsharded = copy.deepcopy(model)
    loop = CPULayer().decode_loop()
    engines = {dtype: HFRolloutEngine(model, pad_token_id=0, eos_token_id=1, device=CPU, dtype=dtype, decode_loop=loop)
               for dtype in (torch.float32, torch.bfloat16)}  # fmt: skip
    shard_model(model, mesh, layer=CPULayer())
    for dtype, engine in engines.items():
        store = SharedWeights.attempt(engine, model)
        assert store is not None, "two ranks of one host must get a store"
        received_total = 0
        writes = counting_writes()
        for handoff in range(3):
            # An update starts with a collective (FSDP2's all-gather): no rank writes its shard (which may lie in the
            # store) while another rank's engine still generates.
            dist.barrier()
            with torch.no_grad():  # the update: every rank changes its own shard
                for param in model.parameters():
                    param.to_local().mul_(0.9).add_(0.01 * (handoff + 1))
            full = {name: p.full_tensor() for name, p in model.named_parameters()}
            received = [0]
            store.hand_off(received)
            received_total = received[0]
            for name, param in engine.model.named_parameters():
                assert torch.equal(param, full[name].to(dtype)), (dtype, handoff, name)
                view = store.views[name]
                assert param.data_ptr() == view.data_ptr(), f"{name} is not bound to the store"
            attn = engine.model.model.layers[1].self_attn
            assert _fused_rows([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is not None
            assert _fused_rows([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]) is not None
            mlp = engine.model.model.layers[1].mlp
            assert _fused_rows([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None
            samples_like_full_weights(engine, unsharded, full)
            if engine.model.model.embed_tokens.weight.data_ptr() != engine.model.lm_head.weight.data_ptr():
                raise AssertionError("the tied head came apart from the embedding")
        # an engine that takes weights any other way first takes a copy of its own: the store stays as written
        before = {name: view.clone() for name, view in store.views.items()}
        dist.barrier()
        engine.load_weights((name, torch.zeros_like(p)) for name, p in unsharded.named_parameters())
        assert all(float(p.abs().sum()) == 0 for p in engine.model.parameters())
        dist.barrier()  # both ranks loaded zeros: the store still holds the last hand-off
        assert all(torch.equal(view, before[name]) for name, view in store.views.items())
        store.hand_off([0])  # and the next hand-off binds the engine again
        assert all(p.data_ptr() == store.views[n].data_ptr() for n, p in engine.model.named_parameters())
        shared_weights.write_shards = WRITE_SHARDS
        # one write per line: torchrun's children write unbuffered, and print() writes the text and the newline apart
        sys.stdout.write(f"OK {rank} {str(dtype).removeprefix('torch.')} {received_total} {writes[0]}\n")
        sys.stdout.flush()
    shutdown_process_groups()  # not a bare destroy: see its docstring (an exit-time abort)


if __name__ == "__main__":
    main()
