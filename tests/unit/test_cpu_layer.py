"""The CPU speed layer's one switch (``lightning_rlhf.cpu``): the strategy's ``cpu_kernels`` over the environment
variable over the device; the layer is an object chosen once (``cpu.device_layer``) and handed to the engines; with
the layer off every piece stands aside and the callers run PyTorch's own ops."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_rlhf import cpu
from lightning_rlhf.cpu import decode, native, onednn, switches
from lightning_rlhf.cpu.decode import sample_loop
from lightning_rlhf.engines.device_layer import PLAIN
from lightning_rlhf.engines.rollout import SamplingParams, make_rollout_engine
from lightning_rlhf.engines.rollout.vllm import vllm_available
from lightning_rlhf.engines.train import TrainEngine

SHAPE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
)  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no strategy setting and no environment variable, and leaves the process as it was."""
    saved = dict(switches._STATE)
    monkeypatch.delenv(cpu.ENV, raising=False)
    monkeypatch.delenv(cpu.OFF_ENV, raising=False)
    switches._STATE.update(setting=switches._UNSET, device=None)
    yield
    switches._STATE.clear()
    switches._STATE.update(saved)


def _fails(name: str) -> Callable[..., None]:
    def run(*args: object, **kwargs: object) -> None:
        pytest.fail(f"{name} ran with the layer off")

    return run


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE)).eval()


def test_the_strategy_wins_over_the_environment_which_wins_over_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu.setting() is None and cpu.enabled() == (not torch.cuda.is_available())
    cpu.configure(None, "cpu")
    assert cpu.enabled() and all(cpu.enabled(piece) for piece in cpu.PIECES)
    cpu.configure(None, "cuda")  # a GPU run: off unless forced
    assert not cpu.enabled() and not cpu.enabled("native")
    monkeypatch.setenv(cpu.ENV, "1")
    assert cpu.enabled("onednn")  # forced by the environment
    cpu.configure(False, "cpu")  # the strategy's argument wins
    assert not cpu.enabled()
    cpu.configure(True, "cuda")
    monkeypatch.setenv(cpu.ENV, "0")
    assert cpu.enabled()
    cpu.configure(None, "cpu")
    assert not cpu.enabled()  # the environment over the device


def test_bad_values_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu.ENV, "maybe")
    with pytest.raises(ValueError, match=r"LIGHTNING_RLHF_CPU_KERNELS='maybe' is invalid.*HINT"):
        cpu.enabled()
    with pytest.raises(ValueError, match=r"RLHFStrategy\(cpu_kernels='yes'\) is invalid.*HINT"):
        cpu.configure("yes", None)  # type: ignore[arg-type]
    monkeypatch.delenv(cpu.ENV)
    monkeypatch.setenv(cpu.OFF_ENV, "onednn,turbo")
    with pytest.raises(ValueError, match=r"names no piece \['turbo'\]. HINT"):
        cpu.enabled("native")
    with pytest.raises(ValueError, match="no piece 'turbo'"):
        cpu.enabled("turbo")


def test_a_strategy_checks_its_argument() -> None:
    from lightning_rlhf import RLHFStrategy

    with pytest.raises(ValueError, match=r"cpu_kernels=1\) is invalid"):
        RLHFStrategy(rollout="hf", cpu_kernels=1)  # type: ignore[arg-type]


def test_the_layer_is_chosen_once_by_the_device_and_the_switch() -> None:
    """A CPU run gets the CPU layer (its decoding loop serves even with the speed pieces off); a GPU run PyTorch's
    own, unless the layer is forced on."""
    assert isinstance(cpu.device_layer(None, "cpu"), cpu.CPULayer) and cpu.enabled()
    off = cpu.device_layer(False, "cpu")
    assert isinstance(off, cpu.CPULayer) and not cpu.enabled() and off.decode_loop() is decode
    assert cpu.device_layer(None, "cuda") is PLAIN and PLAIN.decode_loop() is None
    assert isinstance(cpu.device_layer(True, "cuda"), cpu.CPULayer)


def test_pieces_turn_off_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = cpu.device_layer(None, "cpu")
    with cpu.pieces_off("onednn", "rms_norm"):
        assert not cpu.enabled("onednn") and not cpu.enabled("rms_norm") and cpu.enabled("native")
        assert layer.prepare_model(tiny()) == 0
    assert cpu.enabled("onednn")
    monkeypatch.setenv(cpu.OFF_ENV, "shared_weights")
    assert not cpu.enabled("shared_weights") and cpu.enabled("onednn")
    monkeypatch.delenv(cpu.OFF_ENV)
    assert cpu.enabled("shared_weights")


@pytest.mark.parametrize("layer", ["off", "plain"])
def test_off_every_piece_stands_aside(layer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched off (or PyTorch's own layer, a GPU run's), nothing of the CPU layer runs."""
    chosen = cpu.device_layer(False, "cpu") if layer == "off" else PLAIN
    model = tiny()
    TrainEngine(micro_batch_size=1, layer=chosen).bind(model)
    assert not any("forward" in module.__dict__ for module in model.modules())  # nothing switched
    assert chosen.token_kernels() is None
    loop = chosen.decode_loop()
    if layer == "off":  # the decoding loop (a CPU run's, even off) calls none of the compiled or oneDNN kernels
        for module, name in [(native, n) for n in ("rms_norm", "silu_mul", "decode_attention")] + [(onednn, "packs")]:
            monkeypatch.setattr(module, name, _fails(name))
        monkeypatch.setattr(native.DecodeStep, "make", _fails("DecodeStep"))
        assert loop is not None
        params = SamplingParams(n=2, max_new_tokens=4)
        loop.sample_loop(model, [[5, 6, 7]], params, stops={1}, pad_token_id=0, device=torch.device("cpu"))
    else:
        assert loop is None
    assert chosen.host_buffer(None, 64) is None  # type: ignore[arg-type]  # off: not even a group is needed
    assert chosen.weight_store(object(), model) is None and chosen.fsdp_collectives(model) == 0


def test_on_the_training_engine_switches_the_norms_and_linears() -> None:
    layer = cpu.device_layer(None, "cpu")
    model = tiny()
    engine = TrainEngine(micro_batch_size=1)
    engine.bind(model)  # PyTorch's own layer: nothing switched until the strategy hands the CPU layer in
    assert not any("forward" in module.__dict__ for module in model.modules())
    engine.layer = layer
    switched = sum("forward" in module.__dict__ for module in model.modules())
    assert switched == 2 * 2 + 1 + (2 * 7 + 1 if cpu.enabled("onednn") and cpu.matmul_product(torch.float32) else 0)
    assert cpu.restore_model(model) == switched


def test_the_rollout_factory_hands_the_layer_s_loop_to_the_transformers_engine() -> None:
    """The transformers engine samples with the loop of the layer it was given, and with ``generate`` without."""
    from lightning_rlhf.config import RolloutConfig, VLLMConfig

    class Tokenizer:
        pad_token_id, eos_token_id = 0, 1

    kwargs = dict(
        path="tiny", model=tiny(), tokenizer=Tokenizer(), rollout=RolloutConfig(), vllm=VLLMConfig(),
        device=torch.device("cpu"), dtype=None, max_model_len=64,
    )  # fmt: skip
    params = SamplingParams(n=1, max_new_tokens=4)
    looping = make_rollout_engine("hf", layer=cpu.CPULayer(), **kwargs)  # type: ignore[arg-type]
    plain = make_rollout_engine("hf", **kwargs)  # type: ignore[arg-type]
    assert looping.decodes_with_loop([[5, 6]], params)  # type: ignore[attr-defined]
    assert not plain.decodes_with_loop([[5, 6]], params)  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_decoding_loop_samples_the_same_with_the_layer_on_or_off(dtype: torch.dtype) -> None:
    model = tiny().to(dtype)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, min_new_tokens=8)
    runs = []
    for on in (True, False):
        cpu.configure(on, "cpu")
        torch.manual_seed(0)
        runs.append(
            sample_loop(model, [[5, 6, 7], [8, 9]], params, stops={1}, pad_token_id=0, device=torch.device("cpu"))
        )
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


def test_switched_norms_leave_tensors_of_other_devices_to_their_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced on for a GPU run, the layer still never runs on a GPU's tensors: a switched norm given a tensor of
    another device (here the meta device, standing in for CUDA) runs its class's own forward."""
    from lightning_rlhf.cpu import kernels

    layer = cpu.device_layer(True, "cuda")
    norm = tiny().model.norm
    assert layer.prepare_model(norm, linears=False) == 1
    monkeypatch.setattr(kernels, "rms_norm", lambda *args: pytest.fail("the fused norm ran on a non-CPU tensor"))
    out = norm.to("meta")(torch.empty(2, 64, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 64)


@pytest.mark.skipif(not vllm_available(), reason="needs vLLM")
def test_a_vllm_engine_on_cpu_refuses_a_layer_without_vllm_cpus_workarounds() -> None:
    """Without the CPU layer's workarounds a vLLM engine on CPU samples from a stale tied head: refused at once,
    before vLLM is set up, naming the layer and the fix."""
    from lightning_rlhf.config import VLLMConfig
    from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine

    assert cpu.CPULayer.serves_vllm_cpu and not PLAIN.serves_vllm_cpu
    with pytest.raises(ValueError, match=r"layer='torch'.*HINT: .*device_layer"):
        VLLMRolloutEngine(
            "unused", param_names=[], config=VLLMConfig(), dtype=torch.float32, device=torch.device("cpu"),
            max_model_len=64, layer=PLAIN,
        )  # fmt: skip


def test_a_tied_vocabulary_is_packed_once_a_hand_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first hand-off vLLM's reload has packed the tied weight for the embedding: the head takes that
    product. From the next on, the embedding loads in place (outside the reload, unpacked) and the head packs it:
    the vocabulary, most of the bytes at a real width, is packed once a hand-off, never twice."""
    packed: list[torch.nn.Module] = []

    class Method:
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            packed.append(layer)
            layer.cpu_linear = object()

    weight = torch.nn.Parameter(torch.zeros(4, 2))
    embed, head, model = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    embed.weight, head.weight = weight, weight
    embed.cpu_linear, head.cpu_linear, head.quant_method = object(), object(), Method()
    model.model = torch.nn.Module()
    model.model.embed_tokens, model.lm_head = embed, head
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    cpu._refresh_tied_head(worker)
    assert head.cpu_linear is embed.cpu_linear and packed == []
    loaded: list[torch.nn.Module] = []
    monkeypatch.setattr(cpu.vllm_compat, "load_in_place", loaded.append)
    cpu._tied_embedding_in_place(worker)  # the next hand-off: the embedding loads in place, not packed by vLLM
    assert loaded == [embed] and embed.cpu_linear is head.cpu_linear
    cpu._refresh_tied_head(worker)  # so the head packs the vocabulary, once, and the embedding shares its product
    assert packed == [head] and embed.cpu_linear is head.cpu_linear
