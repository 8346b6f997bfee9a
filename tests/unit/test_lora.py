"""LoRA on the trained roles (lightning_rlhf/engines/train/lora.py): what is trained, the base as the reference, the
merged hand-off, deferred (sharded) loading of the wrapped model, and the bad settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from lightning_rlhf.compat.peft import base_name
from lightning_rlhf.engines.train import deferred_loading, forward_response, load_pretrained, materialize
from lightning_rlhf.engines.train.lora import apply_lora, has_lora, merged_weights, resolve_lora, unadapted_copy
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
        (8, "expected None, a peft.LoraConfig, a dict of its fields or a saved adapter's folder"),
        ("r=8", "'r=8': not a saved peft adapter"),
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
    with pytest.raises(
        ValueError, match=r"rank r=4096 exceeds the smaller dimension of the targeted .* HINT: r <= 64 "
    ):
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


def test_a_lora_config_without_targets_gets_all_linear_as_a_dict_does() -> None:
    from peft import LoraConfig

    given = LoraConfig(r=4)  # peft leaves target_modules None (its per-architecture guess: q_proj, v_proj)
    assert given.target_modules is None
    resolved = resolve_lora(given, setting=SETTING, task_type="CAUSAL_LM")
    assert resolved.target_modules == lora().target_modules == "all-linear"
    assert given.target_modules is None  # the user's object is not changed
    assert lora().lora_alpha == 8 and LoraConfig(r=4).lora_alpha == 8  # a dict's default alpha is 2r (r=4: 8)
    assert resolve_lora({"r": 16}, setting=SETTING, task_type="CAUSAL_LM").lora_alpha == 32  # peft's would be 8


def test_the_rank_hint_is_the_smallest_bound_over_every_targeted_layer(tiny_model: str) -> None:
    """The tiny model's q_proj is 128 x 128, its k_proj and v_proj 128 x 64: r=128 does not fit k_proj."""
    for r in (1024, 128):
        with pytest.raises(
            ValueError,
            match=r"targeted (k_proj/v_proj|[a-z_/]+) layers \(the smallest: .*k_proj, 128 x 64\)\. HINT: r <= 64 ",
        ):
            apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), lora(r=r), setting=SETTING)
    apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), lora(r=64), setting=SETTING)  # the bound fits


def test_targets_and_rank_are_checked_when_the_module_is_built_from_the_config_alone(
    tiny_model: str, tmp_path: Path
) -> None:
    """Before any process starts: the module's constructor checks against config.json; no weight file is read."""
    import shutil

    from lightning_rlhf import GRPOModule, SFTModule

    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(Path(tiny_model) / "config.json", config_only / "config.json")  # no weights next to it
    with pytest.raises(ValueError, match=r"r <= 64"):
        resolve_lora({"r": 128}, setting=SETTING, task_type="CAUSAL_LM", model=str(config_only))
    with pytest.raises(ValueError, match=r"target_modules=\['qkv'\] matches no linear layer"):
        resolve_lora(
            {"r": 4, "target_modules": ["qkv"]}, setting=SETTING, task_type="TOKEN_CLS", model=str(config_only)
        )
    with pytest.raises(ValueError, match=r"RLHFModule\(lora=...\): LoRA rank r=128 exceeds"):
        GRPOModule(tiny_model, reward=lambda completions, **_: [0.0] * len(completions), lora={"r": 128})
    with pytest.raises(ValueError, match=r"SFTModule\(lora=...\): LoRA rank r=128 exceeds"):
        SFTModule(tiny_model, lora={"r": 128})


def saved_adapter(tiny_model: str, folder: Path) -> Path:
    """A trained peft adapter saved as peft saves it (what an SFT LoRA run exports)."""
    model = trained(apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), lora(lora_alpha=6), setting=SETTING))
    model.save_pretrained(folder)
    return folder


def test_a_saved_adapter_is_the_trainable_starting_point(tiny_model: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    folder = saved_adapter(tiny_model, tmp_path / "sft_adapter")
    config = resolve_lora(str(folder), setting=SETTING, task_type="CAUSAL_LM", model=tiny_model)
    assert (config.r, config.lora_alpha, config.inference_mode) == (4, 6, False)
    saved = load_file(folder / "adapter_model.safetensors")
    whole = load_model(
        AutoModelForCausalLM, tiny_model, setting="ActorRole(path=...)", dtype=torch.float32, lora=config
    )
    with deferred_loading():
        deferred = load_pretrained(AutoModelForCausalLM, tiny_model, setting="ActorRole(path=...)")
    deferred = apply_lora(deferred, config, setting=SETTING)
    materialize(deferred, device="cpu")
    for model in (whole, deferred):  # loaded whole, and sharded-style from the checkpoint plan
        adapters = {n: p for n, p in model.named_parameters() if ".lora_" in n}
        assert adapters and all(p.requires_grad for p in adapters.values())  # trainable
        assert len(adapters) == len(saved)
        for name, param in adapters.items():
            key = name.replace(".default.", ".")
            torch.testing.assert_close(param.detach(), saved[key], rtol=0, atol=0, msg=name)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folder)
    batch = grouped_batch()
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        ours = forward_response(whole, batch, output="logprobs")["logprobs"][mask]
        peft_own = forward_response(reference, batch, output="logprobs")["logprobs"][mask]
        with whole.disable_adapter():  # the reference of a run started from it: the base, as in verl and TRL
            base = forward_response(whole, batch, output="logprobs")["logprobs"][mask]
    torch.testing.assert_close(ours, peft_own, rtol=0, atol=1e-6)
    assert (ours - base).abs().max() > 1e-3


def test_a_folder_that_is_no_lora_adapter_is_refused_with_the_fix(tiny_model: str) -> None:
    with pytest.raises(ValueError, match=r"not a saved peft adapter.*HINT: pass the folder peft's save_pretrained"):
        resolve_lora(tiny_model, setting=SETTING, task_type="CAUSAL_LM")
