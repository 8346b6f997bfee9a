"""Each private transformers access in ``lightning_rlhf/compat/transformers.py`` checked against the installed
transformers, on a tiny Qwen2 built here: a release that renames one fails here, naming the function."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lightning_rlhf.compat.transformers import attention_implementation, no_split_modules


def tiny() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def test_attention_implementation_routes_every_layer_through_the_registered_function_and_restores() -> None:
    model = tiny()
    calls: list[int] = []
    eager = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def counted(module: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(module.layer_idx)
        return eager(module, *args, **kwargs)

    AttentionInterface.register("lightning_rlhf_test_counted", counted)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(ids).logits
        with attention_implementation(model.config, "lightning_rlhf_test_counted"):
            inside = model(ids).logits
        after = model(ids).logits
    assert calls == [0, 1]  # each layer once, inside the block only
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(inside, before)
    torch.testing.assert_close(after, before)


def test_no_split_modules_names_the_repeated_blocks() -> None:
    model = tiny()
    names = no_split_modules(model)
    assert names == {"Qwen2DecoderLayer"}
    assert sum(type(m).__name__ in names for m in model.modules()) == 2  # one per layer
    assert no_split_modules(torch.nn.Linear(2, 2)) == set()
