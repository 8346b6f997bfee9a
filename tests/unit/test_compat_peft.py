"""Each reliance on peft in ``lightning_rlhf/compat/peft.py`` checked against the installed peft, on a tiny Qwen2 built
here: a release that renames the wrapper's parameters, changes the initial values, the scale, the saved keys, the
``"all-linear"`` rule or the merge fails here, with the name of the function, before a training run meets it."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from lightning_rlhf.compat.peft import (
    LORA_MARK,
    adapter_layers,
    base_layer_weight,
    base_name,
    config_scale,
    fresh_value,
    layer_scales,
    merge_stream,
    saved_key,
    target_layers,
    wrapped_name,
)

SHAPE = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
}  # fmt: skip


def causal_lm() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE))


def critic() -> Qwen2ForTokenClassification:
    torch.manual_seed(0)
    return Qwen2ForTokenClassification(Qwen2Config(**SHAPE, num_labels=1))


def wrapped(model: torch.nn.Module, **fields: object) -> torch.nn.Module:
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **fields})  # type: ignore[arg-type]
    return get_peft_model(model, config)  # type: ignore[arg-type]


def adapted_names(model: torch.nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def test_base_name_and_wrapped_name_map_peft_names_to_the_base_and_back() -> None:
    base = causal_lm()
    names = {n for n, _ in base.named_parameters()}
    model = wrapped(causal_lm())
    own = [n for n, _ in model.named_parameters() if LORA_MARK not in n]
    assert {base_name(n) for n in own} == names
    assert {wrapped_name(base_name(n), adapted_names(model)) for n in own} == set(own)
    head = wrapped(critic(), task_type="TOKEN_CLS", modules_to_save=["score"])
    score = [n for n, _ in head.named_parameters() if ".score." in n]
    assert score and {base_name(n) for n in score} == {"score.weight", "score.bias"}  # copy and original


def test_saved_key_is_the_key_peft_saves_each_trained_parameter_under() -> None:
    model = wrapped(critic(), task_type="TOKEN_CLS", modules_to_save=["score"])
    trained = {saved_key(n) for n, p in model.named_parameters() if p.requires_grad}
    assert trained == set(get_peft_model_state_dict(model))


def test_adapter_layers_are_the_layers_peft_wrapped_and_hold_their_weight_under_base_layer() -> None:
    model = wrapped(causal_lm())
    names = [n for n, _ in model.named_parameters()]
    assert adapter_layers(names) == sorted(adapted_names(model))
    assert all(base_layer_weight(layer) in names for layer in adapter_layers(names))


def test_fresh_values_follow_pefts_initialisation() -> None:
    model = wrapped(causal_lm(), r=16)
    for name, param in model.named_parameters():
        if ".lora_B." in name:
            assert not param.any() and not fresh_value(name, param).any(), name  # both zero
        elif ".lora_A." in name:  # Kaiming uniform with a = sqrt(5): uniform in +-1/sqrt(fan_in)
            bound = param.shape[1] ** -0.5
            for values in (param.detach(), fresh_value(name, param)):
                assert bound * 0.9 < values.abs().max() <= bound, name
            assert torch.equal(fresh_value(name, param), fresh_value(name, param))  # the same on every rank


@pytest.mark.parametrize("rslora", [False, True])
def test_the_scale_from_a_saved_config_is_the_scale_peft_uses(rslora: bool) -> None:
    model = wrapped(causal_lm(), r=16, lora_alpha=8, use_rslora=rslora)
    scales = layer_scales(model)
    assert set(scales) == adapted_names(model)
    expected = 8 / 4 if rslora else 8 / 16
    assert set(scales.values()) == {expected} == {config_scale(model.peft_config["default"].to_dict())}


@pytest.mark.parametrize(
    ("fields", "model"),
    [
        ({}, causal_lm),
        ({"target_modules": ["q_proj", "down_proj"]}, causal_lm),
        ({"target_modules": r".*\.mlp\..*_proj"}, causal_lm),
        ({"task_type": "TOKEN_CLS", "modules_to_save": ["score"]}, critic),
    ],
)
def test_target_layers_are_the_layers_peft_wraps(fields: dict[str, object], model: type) -> None:
    config = LoraConfig(**{"r": 4, "target_modules": "all-linear", **fields})  # type: ignore[arg-type]
    expected = {name.removeprefix("base_model.model.") for name in adapted_names(wrapped(model(), **fields))}
    found = {name for name, _ in target_layers(model(), dataclasses.replace(config))}
    assert found == expected and found


def test_merge_stream_computes_what_merge_and_unload_does() -> None:
    model = wrapped(causal_lm())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.1)
    merged = dict(merge_stream(iter(model.named_parameters()), layer_scales(model), None))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == {n for n, _ in causal_lm().named_parameters()}
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6, msg=name)
    assert any((merged[n] - p).abs().max() > 1e-3 for n, p in causal_lm().named_parameters())  # adapters merged


def test_outside_compat_peft_is_imported_from_its_top_level_only() -> None:
    root = Path(__file__).resolve().parents[2] / "lightning_rlhf"
    deep = [
        f"{path.relative_to(root)}:{node.lineno}: {node.module}"
        for path in root.rglob("*.py")
        if path != root / "compat" / "peft.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("peft.")
    ]
    assert deep == [], "peft's submodules are reached outside lightning_rlhf/compat/peft.py"
