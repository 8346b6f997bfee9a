"""The rollout-engine protocol on the transformers engine (tests/vllm/ checks vLLM's):

- every weight hand-off is checked: a missing parameter, an unknown or repeated name, a wrong shape raise
  ``WeightSyncError`` naming them, the engine then refuses to generate until a complete hand-off arrives, and
  names are counted per hand-off; a tied head may be handed over under either name;
- an engine built from a meta-device model holds no weights until the first hand-off, then computes exactly what
  the real model computes (its rotary buffers recomputed, its head still tied to the embedding);
- ``make_rollout_engine`` builds the engine the strategy asks for, refusing bad settings first;
- ``weights_for`` streams full tensors to an engine without a slicer;
- every engine class (vLLM's read off the class, not built) declares the whole protocol, ``abilities`` included, and
  the engine server forwards ``fingerprint`` and a failed check's discard.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lightning_rlhf.config import RolloutConfig, VLLMConfig
from lightning_rlhf.engines.rollout import (
    EngineAbilities,
    HandoffCheck,
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
    WeightSyncError,
    make_rollout_engine,
    tied_aliases,
)
from lightning_rlhf.engines.rollout.hf_requests import HFRequestQueue
from lightning_rlhf.engines.rollout.reshard import weights_for

CPU = torch.device("cpu")
GREEDY = SamplingParams(n=1, max_new_tokens=5, greedy=True)
PROMPTS = [[1, 5, 6, 7], [1, 8, 9, 10, 11]]
EMBED = "model.embed_tokens.weight"


def _engine(model: torch.nn.Module, path: str) -> HFRolloutEngine:
    tok = AutoTokenizer.from_pretrained(path)
    return HFRolloutEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device=CPU)


def _meta_model(path: str) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def test_engine_declares_the_whole_protocol(tiny_model: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    eng = _engine(model, tiny_model)
    assert isinstance(eng, RolloutEngine)
    assert eng.param_names == [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in eng.param_names  # tied to the embedding: one parameter
    assert (eng.tp_size, eng.slicer, eng.dtype, eng.offload_optimizer) == (1, None, torch.float32, False)
    assert eng.weights_discarded is False  # built with real weights
    bf16 = HFRolloutEngine(model, pad_token_id=0, eos_token_id=2, device=CPU, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16


def test_handoff_missing_one_tensor_raises_and_blocks_generation(tiny_model: str, demo_model: str) -> None:
    eng = _engine(AutoModelForCausalLM.from_pretrained(tiny_model), tiny_model)
    before = eng.generate(PROMPTS, GREEDY).responses
    trained = AutoModelForCausalLM.from_pretrained(demo_model)  # other weights, same architecture
    missing = "model.layers.1.self_attn.k_proj.bias"
    partial = [(n, t) for n, t in trained.named_parameters() if n != missing]
    with pytest.raises(
        WeightSyncError, match=rf"missed 1 of the engine's {len(eng.param_names)} parameters: \['{missing}'\]"
    ):
        eng.load_weights(partial)
    assert eng.weights_discarded  # a mix of old and new weights
    with pytest.raises(WeightSyncError, match="holds no valid weights"):
        eng.generate(PROMPTS, GREEDY)
    received = eng.load_weights(trained.named_parameters())
    assert received == sum(p.numel() * 4 for p in trained.parameters())
    assert not eng.weights_discarded
    after = eng.generate(PROMPTS, GREEDY).responses
    assert after == _engine(trained, demo_model).generate(PROMPTS, GREEDY).responses
    assert after != before
    # names are counted per hand-off: a complete one before does not cover a partial one now
    with pytest.raises(WeightSyncError, match="missed 1 of"):
        eng.load_weights(partial)


def test_handoff_errors_list_names_and_reject_unknown_repeated_and_misshapen(tiny_model: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    eng = _engine(model, tiny_model)
    params = list(model.named_parameters())
    with pytest.raises(WeightSyncError) as err:
        eng.load_weights(params[:3])
    text = str(err.value)
    missing = [n for n, _ in params[3:]]
    assert f"missed {len(missing)} of the engine's {len(params)} parameters" in text
    assert str(missing[:10]) in text and f"and {len(missing) - 10} more" in text and missing[10] not in text
    assert "HINT" in text
    with pytest.raises(WeightSyncError, match=r"'not\.a\.param', which is not one of the engine's"):
        eng.load_weights([*params, ("not.a.param", torch.zeros(1))])
    with pytest.raises(WeightSyncError, match="twice in one hand-off"):
        eng.load_weights([*params, params[4]])
    name, tensor = params[5]
    with pytest.raises(WeightSyncError, match=rf"{name!r} has shape \(1, {tensor.shape[1]}\)"):
        eng.load_weights([(name, tensor[:1])])  # would broadcast into every row without the check
    assert eng.weights_discarded


def test_tied_head_counts_as_the_embedding(tiny_model: str, demo_model: str) -> None:
    eng = _engine(AutoModelForCausalLM.from_pretrained(tiny_model), tiny_model)
    assert tied_aliases(eng.model) == {"lm_head.weight": EMBED}
    trained = AutoModelForCausalLM.from_pretrained(demo_model)
    state = dict(trained.named_parameters())
    as_head = [("lm_head.weight" if n == EMBED else n, t) for n, t in state.items()]
    eng.load_weights(as_head)  # the head's name loads the embedding it is tied to
    torch.testing.assert_close(eng.model.get_parameter(EMBED), state[EMBED])
    both = [*state.items(), ("lm_head.weight", state[EMBED])]  # a state dict names both
    assert eng.load_weights(both) == sum(t.numel() * 4 for t in state.values())  # loaded once
    check = HandoffCheck("E", ["a", "b"], {"c": "a"})
    check.begin()
    assert (check.take("c"), check.take("a"), check.take("b")) == ("a", None, "b")
    check.finish()
    with pytest.raises(ValueError, match="not parameters"):
        HandoffCheck("E", ["a"], {"c": "x"})


def test_engine_built_from_meta_parameters_waits_for_the_first_handoff(tiny_model: str) -> None:
    real = AutoModelForCausalLM.from_pretrained(tiny_model)
    meta = _meta_model(tiny_model)
    assert all(p.is_meta for p in meta.parameters())
    eng = _engine(meta, tiny_model)
    assert all(p.device == CPU for p in eng.model.parameters())
    assert eng.weights_discarded
    assert eng.model.lm_head.weight is eng.model.get_parameter(EMBED)  # still tied after to_empty
    assert eng.param_names == [n for n, _ in real.named_parameters()]
    with pytest.raises(WeightSyncError, match="meta-device model"):
        eng.generate(PROMPTS, GREEDY)
    with pytest.raises(WeightSyncError, match="missed 1 of"):
        eng.load_weights(list(real.named_parameters())[1:])
    assert eng.weights_discarded
    eng.load_weights(weights_for(eng, real))
    assert not eng.weights_discarded
    for name, buf in real.named_buffers():  # rotary frequencies recomputed, not left as empty storage
        torch.testing.assert_close(eng.model.get_buffer(name), buf, msg=name)
    ids = torch.tensor(PROMPTS[1:])
    with torch.no_grad():
        torch.testing.assert_close(eng.model(ids).logits, real(ids).logits)
    assert eng.generate(PROMPTS, GREEDY).responses == _engine(real, tiny_model).generate(PROMPTS, GREEDY).responses
    assert all(p.is_meta for p in meta.parameters())  # the source model is left alone


def test_weights_for_streams_full_tensors_without_a_slicer(tiny_model: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    eng = _engine(model, tiny_model)
    received = [0]
    stream = list(weights_for(eng, model, received))
    assert [n for n, _ in stream] == eng.param_names
    for (_, t), p in zip(stream, model.parameters(), strict=True):
        assert t.shape == p.shape and t.data_ptr() == p.data_ptr()  # the full tensor itself, not a slice
    assert received == [0]  # one process: nothing comes from other ranks


def test_factory_builds_the_hf_engine_and_refuses_bad_settings(tiny_model: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    meta = _meta_model(tiny_model)
    kwargs = {
        "path": tiny_model,
        "model": meta,
        "rollout": RolloutConfig(n=2, generation_batch_size=3),
        "vllm": VLLMConfig(),
        "device": CPU,
        "dtype": torch.bfloat16,
        "max_model_len": 0,
    }
    eng = make_rollout_engine("hf", tokenizer=tok, **kwargs)  # type: ignore[arg-type]
    assert isinstance(eng, HFRolloutEngine)
    assert (eng.generation_batch_size, eng.dtype, eng.offload_optimizer) == (3, torch.bfloat16, False)
    assert (eng.pad_token_id, eng.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert eng.weights_discarded
    with pytest.raises(ValueError, match=r"kind='sglang'.*HINT: one of \['hf', 'vllm'\]"):
        make_rollout_engine("sglang", tokenizer=tok, **kwargs)  # type: ignore[arg-type]
    tok.pad_token = None
    with pytest.raises(ValueError, match=r"pad_token_id=None.*HINT"):
        make_rollout_engine("hf", tokenizer=tok, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_model_len=0\).*HINT"):
        make_rollout_engine("vllm", tokenizer=tok, **kwargs)  # type: ignore[arg-type]


def _protocol_members() -> dict[str, object]:
    """Every member :class:`RolloutEngine` declares (properties and methods), by name."""
    return {name: value for name, value in vars(RolloutEngine).items() if not name.startswith("_")}


def _instance_attributes(cls: type) -> set[str]:
    """The names ``cls.__init__`` assigns on ``self`` (``self.x = ...``, ``self.x: T = ...``, tuple targets)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))  # type: ignore[misc]
    targets: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets += node.targets
        elif isinstance(node, ast.AnnAssign):
            targets.append(node.target)
    names = set()
    for target in targets:
        for t in target.elts if isinstance(target, ast.Tuple) else [target]:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


@pytest.mark.parametrize("name", ["HFRolloutEngine", "VLLMRolloutEngine", "VLLMServerEngine"])
def test_every_engine_class_declares_the_whole_protocol(name: str) -> None:
    """Read off the classes (vLLM is not built): every member of ``RolloutEngine`` is a class attribute, a property,
    a method taking the Protocol's arguments, or an attribute ``__init__`` sets; ``abilities`` is declared by the class
    itself (an :class:`EngineAbilities`, or a property returning one), never left to a probe."""
    from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine
    from lightning_rlhf.engines.rollout.vllm_server import VLLMServerEngine

    cls = {"HFRolloutEngine": HFRolloutEngine, "VLLMRolloutEngine": VLLMRolloutEngine}.get(name, VLLMServerEngine)
    assigned = _instance_attributes(cls)
    missing = [m for m in _protocol_members() if not hasattr(cls, m) and m not in assigned]
    assert not missing, f"{name} lacks {missing}"
    for member, declared in _protocol_members().items():
        if not inspect.isfunction(declared):
            continue
        own = inspect.signature(getattr(cls, member)).parameters
        takes_any = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in own.values())
        lacking = [p for p in inspect.signature(declared).parameters if p not in own and not takes_any]
        assert not lacking, f"{name}.{member} does not take {lacking}"
    abilities = inspect.getattr_static(cls, "abilities")
    assert isinstance(abilities, EngineAbilities) or (
        isinstance(abilities, property) and inspect.signature(abilities.fget).return_annotation == "EngineAbilities"
    ), f"{name}.abilities is {abilities!r}"


def test_each_engine_declares_what_it_offers(tiny_model: str) -> None:
    """The abilities the callers read (they probed the engines' attributes before): the transformers engine keeps
    copies each weight and, on CPU, binds shared weights, and serves its requests with kept sessions; vLLM takes
    adapters where built for LoRA; the engine server copies each weight and forwards nothing else."""
    from types import SimpleNamespace

    from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine
    from lightning_rlhf.engines.rollout.vllm_server import VLLMServerEngine

    eng = _engine(AutoModelForCausalLM.from_pretrained(tiny_model), tiny_model)
    assert eng.abilities == EngineAbilities(interrupts=True, copies_each_weight=True, binds_shared_weights=True)
    assert (eng.device, eng.tp_rank) == (CPU, 0)
    assert isinstance(eng.requests, HFRequestQueue) and eng.requests is eng.requests  # one queue, kept
    assert eng.context_length == AutoConfig.from_pretrained(tiny_model).max_position_embeddings
    vllm_abilities = inspect.getattr_static(VLLMRolloutEngine, "abilities").fget
    assert vllm_abilities(SimpleNamespace(_tp_group=None, _takes_adapters=False)) == EngineAbilities(interrupts=True)
    assert vllm_abilities(SimpleNamespace(_tp_group=object(), _takes_adapters=True)) == EngineAbilities(
        takes_adapters=True
    )  # a TP group serves rounds of collective calls: no interrupt
    server_abilities = inspect.getattr_static(VLLMServerEngine, "abilities").fget
    assert server_abilities(SimpleNamespace(tp_size=1)) == EngineAbilities(copies_each_weight=True, interrupts=True)
    assert server_abilities(SimpleNamespace(tp_size=2)) == EngineAbilities(copies_each_weight=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        server_abilities(SimpleNamespace(tp_size=1)).takes_adapters = True  # type: ignore[misc]


class _HeldEngine:
    """What the server's side asks of its engine for a fingerprint and a discard."""

    weights_discarded = False

    def fingerprint(self, ranges: dict[str, list[tuple[int, int]]]) -> dict[str, torch.Tensor]:
        return {
            name: torch.tensor([0.1 + a + b / 3 for a, b in rows], dtype=torch.float64) for name, rows in ranges.items()
        }


def test_the_engine_server_answers_fingerprints_and_takes_a_discard() -> None:
    """The client of an engine server forwards ``fingerprint`` (its sums exact, as float64 tensors) and a failed
    check's ``weights_discarded = True`` (the server's engine then refuses to generate), over a pipe to the server's
    own loop (no vLLM: the server's engine is a stand-in)."""
    import multiprocessing
    import threading
    from types import SimpleNamespace

    from lightning_rlhf.engines.rollout.vllm_server import VLLMServerEngine, _Server

    ours, theirs = multiprocessing.Pipe()
    server = _Server(theirs)
    server.engine = _HeldEngine()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    client = object.__new__(VLLMServerEngine)
    client._conn, client._discarded = ours, False
    client._proc = SimpleNamespace(poll=lambda: None, pid=0)  # type: ignore[assignment]
    ranges = {"a.weight": [(0, 2), (5, 6)], "b.bias": [(0, 1)]}
    held = client.fingerprint(ranges)
    assert held.keys() == ranges.keys()
    assert all(t.dtype == torch.float64 for t in held.values())
    assert torch.equal(held["a.weight"], _HeldEngine().fingerprint(ranges)["a.weight"])
    client.weights_discarded = True
    assert server.engine.weights_discarded and client.weights_discarded
    ours.send(("close",))
    thread.join(timeout=10)
    assert not thread.is_alive()
