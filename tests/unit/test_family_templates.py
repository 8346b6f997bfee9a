"""The model families' catalogue (lightning_rlhf.demo.families): published shapes, tokenizers that reload as
themselves, and multi-turn token-in/token-out on each family's real chat template: the ids an episode trains on are
the ids the template gives the whole conversation (tool-call turns included), the re-tokenisation drift at tool
boundaries that peers keep finding. The engine is tests/scripted.py's stand-in; no model is built.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_rlhf.agents import Environment, ToolEnvironment
from lightning_rlhf.agents.env import environment_factory
from lightning_rlhf.agents.parsing import parse_json_calls
from lightning_rlhf.agents.rollout import EpisodeRunner, sample_episodes
from lightning_rlhf.agents.tokens import ChatDelta, check_chat_template, render_chat
from lightning_rlhf.agents.tools import ToolSet
from lightning_rlhf.config import EpisodeConfig, RolloutConfig
from lightning_rlhf.config.models import ensure_pad_token
from lightning_rlhf.demo.families import FAMILIES, build_family_tokenizer, family_config
from lightning_rlhf.engines.rollout.base import SamplingParams
from tests.agent_tools import calculator
from tests.scripted import ScriptedEngine, prompt_batch

tokenizer = functools.lru_cache(maxsize=None)(build_family_tokenizer)

_ARGS = {"expression": "37 * 41"}
HERMES = "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": _ARGS}) + "\n</tool_call>"
# How each family's model writes a call (what its template renders a call as) and which parser reads it.
CALLS = {
    "qwen2.5-0.5b": ("Let me compute.\n" + HERMES, "hermes"),
    "qwen3-0.6b": ("<think>\nI need the product.\n</think>\n\nLet me compute.\n" + HERMES, "hermes"),
    "llama-3.2-1b": (json.dumps({"name": "calculator", "parameters": _ARGS}), "llama3_json"),
    "smollm2-360m": (HERMES, "hermes"),
}
FINAL = {"qwen3-0.6b": "<think>\nThe tool said 1517.\n</think>\n\nThe answer is 1517."}


def test_each_family_has_its_published_shape_and_parameter_count() -> None:
    for name, fam in FAMILIES.items():
        with torch.device("meta"):  # the full depth, no memory
            model = AutoModelForCausalLM.from_config(family_config(name, layers=fam.layers))
        assert sum(p.numel() for p in model.parameters()) == fam.params, name
        cut = family_config(name)
        assert cut.num_hidden_layers == fam.cut and cut.vocab_size == fam.config["vocab_size"]
    gemma = family_config("gemma-3-1b")  # the cut keeps one layer of each kind
    assert gemma.layer_types == ["sliding_attention", "full_attention"] and gemma.query_pre_attn_scalar == 256
    assert family_config("llama-3.2-1b").rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_tokenizer_has_the_published_special_ids_and_reloads_as_itself(name: str, tmp_path) -> None:
    fam = FAMILIES[name]
    tok = tokenizer(name)
    tok.save_pretrained(tmp_path)
    family_config(name).save_pretrained(tmp_path)  # as in a model folder: the loader sees the model type
    again = AutoTokenizer.from_pretrained(tmp_path)
    for token, i in {**fam.specials, **fam.added}.items():
        assert tok.convert_tokens_to_ids(token) == i == again.convert_tokens_to_ids(token), token
    assert max(tok.get_vocab().values()) < fam.config["vocab_size"]  # the ids are a subset of the model's
    text = 'Hi <|im_start|>x\n37 * 41 = 1517 {"name": 1} <tool_call>[INST]'
    assert tok(text)["input_ids"] == again(text)["input_ids"]
    assert (tok("3+4=")["input_ids"][0] == fam.specials.get(fam.bos or "")) == fam.add_bos
    assert again.chat_template == fam.chat_template and again.eos_token == fam.eos


class FamilyEngine(ScriptedEngine):
    """tests/scripted.py's engine, for templates without a tool turn too."""

    def __init__(self, tok, script) -> None:
        self.tok, self.script, self.calls, self.prompts_read = tok, script, [], []
        self.eot = ChatDelta(tok).end_of_turn_id


def run(tok, env, cfg: RolloutConfig, script):
    """One episode of ``env`` for the prompt "37*41=?", the engine answering by ``script``."""
    ensure_pad_token(tok, source="test")  # Mistral has none: the package pads with the EOS token
    engine = FamilyEngine(tok, script)
    runner = EpisodeRunner(environment_factory(env), tok, cfg)
    try:
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens, stop_token_ids=(engine.eot,), seed=3)
        return sample_episodes(engine, prompt_batch(tok, ["37*41=?"]), runner, params, n=1, pad_id=tok.pad_token_id)
    finally:
        runner.close()


def _conversation_ids(batch, row: int = 0) -> list[int]:
    p, r = batch["prompt_mask"][row].bool(), batch["response_mask"][row].bool()
    return batch["prompts"][row][p].tolist() + batch["responses"][row][r].tolist()


def _assert_template_gives(tok, ids: list[int], messages, **kwargs) -> None:
    """``ids`` are the template's rendering of ``messages``, but for what the template writes after the last turn's
    end-of-turn token (a newline: the model stops at the token)."""
    full = render_chat(tok, messages, generation=False, **kwargs)
    assert full[: len(ids)] == ids, (tok.decode(full), tok.decode(ids))
    assert tok.decode(full[len(ids) :]).strip() == ""


@pytest.mark.parametrize("name", sorted(CALLS))
def test_tool_episode_ids_are_the_template_of_the_whole_conversation(name: str) -> None:
    tok = tokenizer(name)
    call, parser = CALLS[name]
    final = FINAL.get(name, "The answer is 1517.")
    env = ToolEnvironment(tools=[calculator], system_prompt="Use the calculator.")
    cfg = RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(max_turns=4, tool_parser=parser))
    batch = run(tok, env, cfg, lambda text: final if "1517" in text else call)
    messages = batch["episode"][0]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[3]["content"] == "1517" and batch["tool_calls"].tolist() == [1]
    _assert_template_gives(tok, _conversation_ids(batch), messages, tools=ToolSet([calculator]).schemas)
    sampled = batch["responses"][0][batch["sampled_mask"][0].bool()].tolist()
    eot = ChatDelta(tok).end_of_turn_id
    assert sampled == [
        *tok.encode(call, add_special_tokens=False),
        eot,
        *tok.encode(final, add_special_tokens=False),
        eot,
    ]


class Teacher(Environment):
    """Answers the first turn with a user turn (no tools: templates without a tool role), ends at the second."""

    def reset(self, row):
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, message):
        if "1517" in message["content"]:
            return [], True
        return [{"role": "user", "content": "Not quite: 37 * 41 = 1517. Again?"}], False


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_user_turn_episode_ids_are_the_template_of_the_whole_conversation(name: str) -> None:
    tok = tokenizer(name)
    # Mistral's template writes " " + the answer after [/INST]: its models' answers start with a space. Qwen3's
    # writes a <think> block into the answers after the last user turn: its models write one.
    lead = {"mistral-7b-v0.3": " ", "qwen3-0.6b": "<think>\nHm.\n</think>\n\n"}.get(name, "")
    script = lambda text: lead + ("1517." if "Again" in text else "1500?")  # noqa: E731
    batch = run(tok, Teacher, RolloutConfig(max_new_tokens=64, episode=EpisodeConfig(max_turns=4)), script)
    messages = batch["episode"][0]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    ids = _conversation_ids(batch)
    if name == "qwen3-0.6b":  # the template drops the reasoning of answers before the last user turn; the model saw
        think = tok.encode(lead, add_special_tokens=False)  # it, so the episode keeps it: the one difference
        at = next(i for i in range(len(ids)) if ids[i : i + len(think)] == think)
        assert ids[at + len(think) :].count(think[0]) == 1  # the last answer's block is rendered too
        ids = ids[:at] + ids[at + len(think) :]
    _assert_template_gives(tok, ids, messages)


@pytest.mark.parametrize("name", ["gemma-3-1b", "mistral-7b-v0.3"])
def test_templates_without_a_tool_turn_are_refused_before_any_rollout(name: str) -> None:
    # Gemma-3 has no tool role (turns must alternate); Mistral v0.3 needs 9-character call ids, which a tool result
    # of a text-format call does not have. The template's own message is in the error, before any rollout; without
    # tools the same templates run episodes (the test above).
    with pytest.raises(ValueError, match=r"cannot render a 'tool' message .*(alternate|Tool call IDs).*HINT"):
        check_chat_template(tokenizer(name), tools=ToolSet([calculator]).schemas)
    check_chat_template(tokenizer(name), tool_turns=False)


def test_llama3_json_calls_are_read_and_a_broken_one_is_named() -> None:
    two = parse_json_calls('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [(c.name, c.arguments) for c in two.calls] == [("a", {}), ("b", {"x": 1})]
    assert parse_json_calls("The answer is 7.").calls == ()
    (broken,) = parse_json_calls('{"name": "a", "param').calls
    assert broken.error is not None and "not valid JSON" in broken.error


class TeacherWithSystem(Teacher):
    def reset(self, row):
        return [{"role": "system", "content": "Be brief."}, *super().reset(row)]


def test_mistral_episode_keeps_the_system_message_where_the_model_read_it() -> None:
    # Mistral v0.3's template writes the system message into the user turn that is the *last message*: rendering the
    # whole conversation (it ends with an answer) drops it. The episode trains on what the model was prompted with.
    tok = tokenizer("mistral-7b-v0.3")
    script = lambda text: " " + ("1517." if "Again" in text else "1500?")  # noqa: E731
    batch = run(tok, TeacherWithSystem, RolloutConfig(max_new_tokens=64, episode=EpisodeConfig(max_turns=4)), script)
    text = tok.decode(_conversation_ids(batch))
    assert text.startswith("<s>[INST] Be brief.\n\n37*41=?[/INST] 1500?</s>[INST] Not quite")
    whole = tok.decode(render_chat(tok, batch["episode"][0], generation=False))
    assert whole.startswith("<s>[INST] 37*41=?[/INST] 1500?</s>[INST] Not quite") and "Be brief" not in whole
