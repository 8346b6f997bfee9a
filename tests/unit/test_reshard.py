"""Resharding FSDP2 shards into tensor-parallel slices: the slicing rules, the exchange, the stand-in tensor."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_rlhf.engines.rollout.reshard import SliceHolder, TPSlice, tp_slice, tp_slicer
from tests.conftest import ROOT, SCRIPTS, failure_text

GQA = SimpleNamespace(model_type="qwen2", num_attention_heads=8, num_key_value_heads=2, hidden_size=256, head_dim=32)


def test_slices_follow_vllm_tensor_parallel_layout() -> None:
    def at(name: str, shape: tuple[int, ...], rank: int, tp: int = 2) -> TPSlice | None:
        return tp_slice(name, shape, config=GQA, tp_size=tp, tp_rank=rank)

    assert at("model.layers.0.self_attn.q_proj.weight", (256, 256), 1) == TPSlice(0, 128, 128)
    assert at("model.layers.0.self_attn.q_proj.bias", (256,), 1) == TPSlice(0, 128, 128)
    assert at("model.layers.0.self_attn.k_proj.weight", (64, 256), 1) == TPSlice(0, 32, 32)
    # TP 4 > 2 KV heads: each KV head is replicated on 2 ranks; rank 3 loads head 1
    assert at("model.layers.0.self_attn.v_proj.weight", (64, 256), 3, tp=4) == TPSlice(0, 32, 32)
    assert at("model.layers.0.self_attn.v_proj.weight", (64, 256), 1, tp=4) == TPSlice(0, 0, 32)
    assert at("model.layers.0.mlp.up_proj.weight", (512, 256), 1) == TPSlice(0, 256, 256)
    assert at("model.layers.0.self_attn.o_proj.weight", (256, 256), 1) == TPSlice(1, 128, 128)
    assert at("model.layers.0.mlp.down_proj.weight", (256, 512), 0) == TPSlice(1, 0, 256)
    # vocabulary 100 is padded to 128 and split 64 + 64; rank 1 holds rows 64..99
    assert at("model.embed_tokens.weight", (100, 256), 1) == TPSlice(0, 64, 36)
    assert at("lm_head.weight", (100, 256), 0) == TPSlice(0, 0, 64)
    assert at("model.layers.0.input_layernorm.weight", (256,), 1) is None  # replicated
    assert at("model.norm.weight", (256,), 0) is None
    assert tp_slice("model.layers.0.self_attn.q_proj.weight", (256, 256), config=GQA, tp_size=1, tp_rank=0) is None
    assert tp_slicer(GQA, 1) is None
    assert tp_slicer(SimpleNamespace(model_type="gpt2"), 2) is None  # other architectures: whole tensors


def test_slice_holder_answers_only_the_expected_narrow() -> None:
    held = torch.ones(2, 6)
    holder = SliceHolder(held, (7, 6), TPSlice(0, 1, 2))
    assert holder.shape == (7, 6) and holder.dim() == 2 and holder.size(0) == 7
    assert holder.narrow(0, 1, 2) is held
    assert holder.held_bytes == 48
    with pytest.raises(RuntimeError, match=r"asked for narrow\(dim=0, start=0, length=2\) but the resharded"):
        holder.narrow(0, 0, 2)
    with pytest.raises(RuntimeError, match="only supports narrow"):
        holder.add(1)


def ok_lines_of_two_ranks(script: str, *also: str, env: dict[str, str] | None = None) -> list[list[str]]:
    """Run ``tests/scripts/<script>`` under torchrun on 2 processes (``env`` added to the environment); its ``OK ...``
    (and ``also ...``) lines, split, sorted."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    environment = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [*cmd, str(SCRIPTS / script)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=environment
    )
    assert proc.returncode == 0, failure_text(proc)
    return sorted(line.split() for line in proc.stdout.splitlines() if line.startswith(("OK", *also)))


def test_exchange_moves_only_what_is_not_local() -> None:
    lines = ok_lines_of_two_ranks("reshard_check.py")
    # bytes received per case (float32): all-gather, aligned rows, column blocks, straddling rows
    assert lines[0][1:] == ["0", str(3 * 6 * 4), "0", str(3 * 3 * 4), "0"]
    assert lines[1][1:] == ["1", str(4 * 6 * 4), "0", str(4 * 3 * 4), str(1 * 6 * 4)]


def test_full_tensors_gathers_buckets_of_shards_exactly() -> None:
    lines = ok_lines_of_two_ranks("gather_check.py", "FALLBACK")
    assert lines[:2] == [["FALLBACK", "0"], ["FALLBACK", "1"]]
    lines = lines[2:]
    assert [line[1] for line in lines] == ["0", "1"]
    # each rank receives every element it does not hold: over both ranks, each element once (float32: 4 bytes)
    received, numel = [int(line[2]) for line in lines], int(lines[0][3])
    assert sum(received) == 4 * numel and min(received) > 0


@pytest.mark.parametrize("native", ["1", "0"], ids=["kernels", "eager"])
def test_colocated_engines_read_one_shared_copy_of_the_weights(native: str) -> None:
    # eager: without the CPU kernels a bfloat16 engine's rows are cast by copy_ at each hand-off (they once were not)
    lines = ok_lines_of_two_ranks("shared_weights_check.py", "PLACED", "BF16", env={"LIGHTNING_RLHF_NATIVE": native})
    # the shards placed in the store: three training steps and hand-offs, one write (the first hand-off's) per rank
    assert [line for line in lines if line[0] == "PLACED"] == [["PLACED", "0", "1"], ["PLACED", "1", "1"]]
    # a bfloat16 engine of float32 shards: the first of the 4 hand-offs writes every row (it walks the parameters);
    # each later one casts the rows with the compiled cast where the kernels are on (by copy_ without them: none
    # counted), a shard edited by hand included
    casts = "3" if native == "1" else "0"
    assert [line for line in lines if line[0] == "BF16"] == [["BF16", "0", casts], ["BF16", "1", casts]]
    lines = [line for line in lines if line[0] == "OK"]
    assert [line[:3] for line in lines] == [["OK", "0", "bfloat16"], ["OK", "0", "float32"],
                                            ["OK", "1", "bfloat16"], ["OK", "1", "float32"]]  # fmt: skip
    # each rank's engine reads the rows the other rank wrote: over both ranks, each element once
    by_dtype = {dtype: sum(int(line[3]) for line in lines if line[2] == dtype) for dtype in ("float32", "bfloat16")}
    assert by_dtype["float32"] == 2 * by_dtype["bfloat16"] > 0
    # four hand-offs per engine: the first walks the parameters, the others make the copies it listed
    assert [line[4] for line in lines] == ["1"] * 4
