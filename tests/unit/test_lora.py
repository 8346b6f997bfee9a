"""LoRA on the trained roles (lightning_rlhf/engines/train/lora.py): what is trained, the base as the reference, the
merged hand-off, deferred (sharded) loading of the wrapped model, and the bad settings."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from lightning_rlhf.engines.train import deferred_loading, forward_response, load_pretrained, materialize
from lightning_rlhf.engines.train.lora import (
    apply_lora,
    base_name,
    has_lora,
    merged_weights,
    resolve_lora,
    unadapted_copy,
)
from lightning_rlhf.roles.base import load_model
from tests.unit.test_shared_prefix import grouped_batch

SETTING = "RLHFModule(lora=...)"


def lora(**fields: object) -> object:
    return resolve_lora({"r": 4, **fields}, setting=SETTING, task_type="CAUSAL_LM")


def trained(model: torch.nn.Module, steps: int = 3) -> torch.nn.Module:
    """A few optimizer steps on the adapters, so that B @ A is not zero."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    batch = grouped_batch()
    for _ in range(steps):
        out = forward_response(model, batch, output="logprobs")
        (-out["logprobs"][batch["response_mask"].bool()].sum()).backward()
        opt.step()
        opt.zero_grad()
    return model


def test_only_the_adapters_train_and_the_model_starts_as_its_base(tiny_model: str) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    model = load_model(
        AutoModelForCausalLM, tiny_model, setting="ActorRole(path=...)", dtype=torch.float32, lora=lora()
    )
    assert has_lora(model) and not has_lora(base)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # all-linear
    batch = grouped_batch()
    mask = batch["response_mask"].bool()
    with torch.no_grad():  # lora_B starts at zero: the wrapped model computes the base (to a matmul's rounding:
        torch.testing.assert_close(  # MKL's sums may differ by a data address's alignment, so not bit for bit)
            forward_response(model, batch, output="logprobs")["logprobs"][mask],
            forward_response(base, batch, output="logprobs")["logprobs"][mask],
            rtol=0,
            atol=1e-6,
        )


def test_the_reference_is_the_base_with_adapters_off_and_the_hand_off_is_the_merge(tiny_model: str) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    model = trained(apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), lora(), setting=SETTING))
    batch = grouped_batch()
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        adapted = forward_response(model, batch, output="logprobs")["logprobs"][mask]
        with model.disable_adapter():
            off = forward_response(model, batch, output="logprobs")["logprobs"][mask]
        plain = forward_response(base, batch, output="logprobs")["logprobs"][mask]
    torch.testing.assert_close(off, plain, rtol=0, atol=1e-6)  # what ReferenceRole(adapters_of=actor) computes
    assert (adapted - plain).abs().max() > 1e-3  # the adapters trained
    # The hand-off: base names, merged weights; an engine built from the unadapted copy computes the adapted model.
    merged = dict(merged_weights(model, iter(model.named_parameters()), None))
    engine_model = unadapted_copy(model)
    assert set(merged) == {n for n, _ in engine_model.named_parameters()} == {n for n, _ in base.named_parameters()}
    engine_model.load_state_dict(merged, strict=False)
    with torch.no_grad():
        served = forward_response(engine_model, batch, output="logprobs")["logprobs"][mask]
    assert (served - adapted).abs().max() < 1e-5
    assert all(base_name(n) in merged for n, _ in model.named_parameters() if ".lora_" not in n)


def test_deferred_loading_reads_the_base_and_starts_the_adapters_the_same_everywhere(tiny_model: str) -> None:
    whole = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), lora(), setting=SETTING)
    with deferred_loading():
        model = load_pretrained(AutoModelForCausalLM, tiny_model, setting="ActorRole(path=...)")
    model = apply_lora(model, lora(), setting=SETTING)
    assert all(p.is_meta for p in model.parameters())
    report = materialize(model, device="cpu")
    assert all(".lora_" in n for n in report.fresh) and report.fresh
    for (name, a), (other, b) in zip(whole.named_parameters(), model.named_parameters(), strict=True):
        assert name == other
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)  # the base read, the adapters seeded by name


def test_a_lora_critic_trains_its_value_head_whole(tiny_model: str) -> None:
    config = resolve_lora({"r": 4}, setting=SETTING, task_type="TOKEN_CLS", modules_to_save=["score"])
    model = load_model(
        AutoModelForTokenClassification, tiny_model, setting="CriticRole(path=...)", dtype=torch.float32,
        lora=config, num_labels=1,
    )  # fmt: skip
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("score" in n and ".lora_" not in n for n in names)
    assert all(".lora_" in n or "score" in n for n in names)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"r": 0}, "rank r=0 is invalid"),
        ({"r": 4, "rank": 8}, "unknown LoRA field"),
        ({"r": 4, "lora_dropout": 1.5}, "lora_dropout=1.5"),
        ({"r": 4, "bias": "all"}, "bias='all' is not supported"),
        ("r=8", "expected None, a peft.LoraConfig or a dict"),
    ],
)
def test_bad_lora_settings_are_named(given: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        resolve_lora(given, setting=SETTING, task_type="CAUSAL_LM")
    assert SETTING in str(info.value) and "HINT" in str(info.value)


def test_lora_on_a_role_that_is_not_trained_is_refused() -> None:
    from lightning_rlhf.roles.base import Role

    with pytest.raises(ValueError, match=r"ReferenceRole\(path=...\): lora=.* not trained \(optim=None\).*HINT"):
        Role(setting="ReferenceRole(path=...)", lora=lora())


def test_targets_that_match_nothing_or_a_rank_too_large_fail_before_training(tiny_model: str) -> None:
    with pytest.raises(ValueError, match=r"target_modules=\['qkv'\] matches no linear layer.*q_proj"):
        apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), lora(target_modules=["qkv"]), setting=SETTING)
    with pytest.raises(ValueError, match=r"rank r=4096 exceeds the smaller dimension of .* HINT: r <= "):
        apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), lora(r=4096), setting=SETTING)


def test_the_pool_hand_off_announces_the_merged_stream_in_its_order(tiny_model: str) -> None:
    """A rollout pool's header lists ``(name, shape)`` before the tensors come: exactly what the merge yields."""
    from lightning_rlhf.engines.train.lora import merged_specs

    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), lora(), setting=SETTING)
    streamed = [(n, tuple(t.shape)) for n, t in merged_weights(model, iter(model.named_parameters()), None)]
    assert merged_specs(model) == streamed


def test_supervised_fine_tuning_takes_lora_too(tiny_model: str) -> None:
    from lightning_rlhf import SFTModule

    module = SFTModule(tiny_model, lora={"r": 4})
    assert module.actor.lora is not None and module.actor.lora.r == 4
    with pytest.raises(ValueError, match=r"SFTModule\(lora=...\): LoRA rank r=0"):
        SFTModule(tiny_model, lora={"r": 0})
