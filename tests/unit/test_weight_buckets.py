"""The weight hand-off's buckets: whole fusion groups only, whatever the order and the bucket size."""

from __future__ import annotations

import pytest
import torch

from lightning_rlhf.engines.rollout.vllm import fusion_group, weight_buckets

LAYER = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.q_proj.bias",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
]


def test_fusion_groups_follow_vllm_modules() -> None:
    assert fusion_group("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert fusion_group("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert fusion_group("model.layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj"
    assert fusion_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert fusion_group("lm_head.weight") == "lm_head"


def _stream(names: list[str], numel: int = 4) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.zeros(numel)) for n in names]  # 16 bytes each


@pytest.mark.parametrize("bucket_bytes", [1, 40, 10_000])
@pytest.mark.parametrize("order", ["hf", "reversed", "interleaved"])
def test_buckets_never_split_a_fusion_group(bucket_bytes: int, order: str) -> None:
    names = {"hf": LAYER, "reversed": LAYER[::-1], "interleaved": LAYER[::2] + LAYER[1::2]}[order]
    buckets = list(weight_buckets(_stream(names), LAYER, bucket_bytes))
    seen = [n for b in buckets for n, _ in b]
    assert sorted(seen) == sorted(LAYER)
    home = {}
    for i, bucket in enumerate(buckets):
        for name, _ in bucket:
            assert home.setdefault(fusion_group(name), i) == i, f"{name} split from its group"
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        groups = {fusion_group(n) for n, _ in bucket}
        assert size <= bucket_bytes or len(groups) == 1  # only a lone oversize group may exceed the size
    if bucket_bytes == 10_000:
        assert len(buckets) == 1
    if bucket_bytes == 1:
        assert len(buckets) == len({fusion_group(n) for n in LAYER})  # 5: qkv, o, gate_up, down, norm


def test_unknown_or_missing_names_are_errors() -> None:
    with pytest.raises(KeyError, match="not among the names"):
        list(weight_buckets(_stream(["model.norm.weight"]), LAYER, 100))
    with pytest.raises(KeyError, match="incomplete fusion groups"):
        list(weight_buckets(_stream(LAYER[:2]), LAYER, 100))
