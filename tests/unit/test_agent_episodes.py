"""Multi-turn episodes (lightning_rlhf.agents.rollout): token in, token out, loss masks, tool results as
observations, and the ways an episode ends.

The engine here is a scripted stand-in: it answers each prompt with a fixed text chosen from the conversation so
far, tokenized and ended with the template's end-of-turn token, so that the episodes' bookkeeping can be checked
token by token. The real engines run episodes in tests/distributed/test_episodes.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_rlhf import GRPOModule
from lightning_rlhf.agents import Environment, Episode, EpisodeContext, ToolEnvironment, register_agent_loop
from lightning_rlhf.agents.driver import AgentLoopError
from lightning_rlhf.agents.env import environment_factory
from lightning_rlhf.agents.rollout import EpisodeRunner, episode_metrics, sample_episodes
from lightning_rlhf.agents.tokens import check_chat_template
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, EpisodeConfig, KLConfig, RolloutConfig
from lightning_rlhf.demo import addition_reward
from lightning_rlhf.demo.tiny import build_tiny_tokenizer
from lightning_rlhf.engines.rollout.base import RolloutOutput, SamplingParams
from lightning_rlhf.engines.rollout.requests import BatchedRequestQueue
from tests.agent_tools import calculator, nap
from tests.scripted import CALL, TOKENIZERS, ScriptedEngine, prompt_batch, qwen_style_tokenizer, run


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_episode_ids_decode_to_the_conversation_the_template_renders(name: str) -> None:
    tok = TOKENIZERS[name]()
    env = ToolEnvironment(tools=[calculator], system_prompt="Use the calculator.")
    batch, engine = run(
        tok, env, RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(max_turns=4, async_episodes=False)), n=2
    )
    assert len(batch) == 2 and engine.calls == [2, 2]  # lock-step: each turn, every live episode in one call
    # Each turn the two episodes hold the same tokens (this engine answers alike), so each call reads one prompt
    # and samples n=2 from it.
    assert engine.prompts_read == [1, 1]
    messages = batch["episode"][0]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[3]["content"] == "1517"  # the calculator ran in its worker
    assert messages[4]["content"] == "The answer is 1517."
    p, r = batch["prompt_mask"][0].bool(), batch["response_mask"][0].bool()
    ids = batch["prompts"][0][p].tolist() + batch["responses"][0][r].tolist()
    rendered = tok.apply_chat_template(messages, tools=[calculator], tokenize=False)
    # The same text, but for the newline the template writes after the last turn's end-of-turn token (the model
    # stops at that token; the newline comes with the next observation, if any).
    assert tok.decode(ids) + "\n" == rendered
    # Only the sampled turns are trained: the loss mask is 1 on exactly the engine's ids, 0 on the tool turn.
    loss = batch["sampled_mask"][0][r].bool()
    sampled = batch["responses"][0][r][loss].tolist()
    turn1 = [*tok.encode(messages[2]["content"], add_special_tokens=False)]
    turn2 = [*tok.encode(messages[4]["content"], add_special_tokens=False)]
    eot = check_chat_template(tok).end_of_turn_id
    assert sampled == [*turn1, eot, *turn2, eot]
    assert "1517" in tok.decode(batch["responses"][0][r][~loss].tolist())
    assert torch.equal(batch["rollout_logprobs"][0][r] != 0, loss)  # the engine's log-probs on sampled tokens only
    assert batch["turns"].tolist() == [2, 2] and batch["tool_calls"].tolist() == [1, 1]
    assert batch["tool_errors"].tolist() == [0, 0] and not batch["response_truncated"].any()
    assert batch["observation_tokens"][0] == (~loss).sum()


def test_lock_step_and_asynchronous_episodes_are_the_same_episodes() -> None:
    tok = build_tiny_tokenizer()
    env = ToolEnvironment(tools=[calculator])
    done = {}
    for mode in (True, False):
        batch, _ = run(
            tok,
            env,
            RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(async_episodes=mode)),
            texts=["a", "b", "c"],
        )
        done[mode] = (batch["responses"], batch["sampled_mask"])
    assert torch.equal(done[True][0], done[False][0]) and torch.equal(done[True][1], done[False][1])


def test_episodes_end_truncated_at_max_turns_and_the_budget() -> None:
    tok = build_tiny_tokenizer()
    env = ToolEnvironment(tools=[calculator])
    one, _ = run(tok, env, RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(max_turns=1)))
    assert one["response_truncated"].tolist() == [True] and one["turns"].tolist() == [1]
    assert [m["role"] for m in one["episode"][0]][-1] == "assistant"  # never ends on an observation
    assert one["sampled_mask"][0].sum() == one["response_mask"][0].sum()
    tight, _ = run(tok, env, RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(max_episode_tokens=100)))
    assert tight["response_truncated"].tolist() == [True] and tight["observation_tokens"].tolist() == [0]
    assert int(tight["response_mask"][0].sum()) <= 100
    cut, _ = run(tok, env, RolloutConfig(max_new_tokens=5))  # the first turn itself is cut: no stop token
    assert cut["response_truncated"].tolist() == [True] and int(cut["response_mask"][0].sum()) == 5


class BoundedEngine(ScriptedEngine):
    """Refuses a call whose longest prompt plus ``max_new_tokens`` passes the context, as both real engines do."""

    context_length = 256

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        longest = max(map(len, prompts))
        if longest + params.max_new_tokens > self.context_length:
            raise ValueError(f"{longest} + {params.max_new_tokens} > {self.context_length}")
        return super().generate(prompts, params)


@pytest.mark.parametrize("async_episodes", [False, True])
def test_episodes_at_the_context_bound_end_truncated_without_cutting_the_others(async_episodes: bool) -> None:
    tok = build_tiny_tokenizer()
    engine = BoundedEngine(tok, script=lambda text: f"Again.\n{CALL}")  # calls the tool every turn, never answers
    runner = EpisodeRunner(
        environment_factory(ToolEnvironment(tools=[calculator])),
        tok,
        RolloutConfig(
            max_new_tokens=90,
            episode=EpisodeConfig(max_turns=10, max_episode_tokens=10_000, async_episodes=async_episodes),
        ),
    )
    texts = ["1+1", "Please add these numbers for me, then say the sum: " * 3]  # the second is 84 tokens longer
    try:
        stops = (check_chat_template(tok).end_of_turn_id,)
        params = SamplingParams(max_new_tokens=90, stop_token_ids=stops, seed=3)
        batch = sample_episodes(engine, prompt_batch(tok, texts), runner, params, n=1, pad_id=tok.pad_token_id)
    finally:
        runner.close()
    assert batch["response_truncated"].tolist() == [True, True]
    short, long = batch["turns"].tolist()
    assert short > long >= 1  # the long prompt met the bound first; the short one went on in calls of its own
    for i in range(2):
        used = int(batch["prompt_mask"][i].sum() + batch["response_mask"][i].sum())
        assert (
            engine.context_length - 100 < used <= engine.context_length
        )  # it ran until less than a turn and its observation fit


def test_bad_calls_and_failing_tools_become_error_observations() -> None:
    tok = build_tiny_tokenizer()
    replies = iter(
        [
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
            "<tool_call>{not json</tool_call>",
            '<tool_call>{"name": "calculator", "arguments": {"expression": "import os"}}</tool_call>',
            "I give up.",
        ]
    )
    engine = ScriptedEngine(tok, script=lambda text: next(replies))
    batch, _ = run(tok, ToolEnvironment(tools=[calculator]), RolloutConfig(max_new_tokens=128), engine=engine)
    tools = [m["content"] for m in batch["episode"][0] if m["role"] == "tool"]
    assert tools[0] == "error: there is no tool named 'search' (the tools: calculator)"
    assert tools[1].startswith("error: the tool call is not valid JSON")
    assert tools[2].startswith("error: the tool calculator raised ValueError: not arithmetic")
    assert batch["tool_errors"].tolist() == [3] and batch["turns"].tolist() == [4]
    assert not batch["response_truncated"].any()


def test_an_environment_of_its_own_answers_with_user_turns_and_scores_the_episode() -> None:
    class Guess(Environment):
        def step(self, message):
            if "7" in message["content"]:
                return [], True
            return [{"role": "user", "content": "No. Try 7."}], False

        def reward(self, episode: Episode) -> float:
            return float(episode.turns == 2)

    tok = build_tiny_tokenizer()
    engine = ScriptedEngine(tok, script=lambda text: "7" if "Try 7" in text else "3")
    batch, _ = run(tok, Guess, RolloutConfig(max_new_tokens=8), engine=engine)
    assert [m["content"] for m in batch["episode"][0]][1:] == ["3", "No. Try 7.", "7"]
    assert batch["env_reward"] == [1.0] and batch["tool_calls"].tolist() == [0]


def test_each_row_gets_the_environment_its_column_names() -> None:
    """Several environments by name (TRL's multi-environment mode): a row's ``environment`` column picks its
    environment, with that environment's own tools in its prompt; a row naming none is a clear error."""

    class Guess(Environment):
        def step(self, message):
            return ([], True) if "7" in message["content"] else ([{"role": "user", "content": "Try 7."}], False)

    tok = qwen_style_tokenizer()  # a template that lists the tools in the prompt

    def script(text: str) -> str:
        if "guess" in text:
            return "7" if "Try 7" in text else "3"
        return "It is 1517." if "1517" in text else CALL

    choice = environment_factory({"calc": ToolEnvironment(tools=[calculator]), "guess": Guess})
    runner = EpisodeRunner(choice, tok, RolloutConfig(max_new_tokens=128))
    try:
        batch = prompt_batch(tok, ["37*41=?", "guess a number"])
        batch.columns["environment"] = ["calc", "guess"]
        stops = (check_chat_template(tok).end_of_turn_id,)
        params = SamplingParams(max_new_tokens=128, stop_token_ids=stops, seed=3)
        out = sample_episodes(ScriptedEngine(tok, script=script), batch, runner, params, n=1, pad_id=tok.pad_token_id)
        assert [[m["content"] for m in ep[1:]] for ep in out["episode"]] == [
            [CALL, "1517", "It is 1517."],
            ["3", "Try 7.", "7"],
        ]
        assert out["tool_calls"].tolist() == [1, 0]
        assert "calculator" in tok.decode(out["prompts"][0]) and "calculator" not in tok.decode(out["prompts"][1])
        with pytest.raises(ValueError, match=r"this row has 'chess'. HINT: give every dataset row an 'environment'"):
            batch.columns["environment"] = ["calc", "chess"]
            sample_episodes(ScriptedEngine(tok, script=script), batch, runner, params, n=1, pad_id=tok.pad_token_id)
    finally:
        runner.close()


def test_several_environments_score_all_or_none(tiny_model: str) -> None:
    class Scored(ToolEnvironment):
        def reward(self, episode: Episode) -> float:
            return 1.0

    settings = dict(reference=False, algorithm=AlgorithmConfig(kl=KLConfig(coef=0.0)))
    with pytest.raises(ValueError, match=r"\['scored'\] score their episodes \(reward\) and \['plain'\] do not"):
        GRPOModule(tiny_model, environment={"scored": Scored, "plain": ToolEnvironment}, **settings)
    GRPOModule(tiny_model, environment={"a": Scored, "b": Scored}, **settings)  # the environments' reward alone


def test_a_slow_tool_does_not_hold_the_other_episodes(tmp_path) -> None:
    """Two episodes, one whose tool waits until the other episode has had its next turn: asynchronously, the fast
    episode goes on while the slow tool runs (engine calls: both, the fast one alone, the slow one alone); in lock
    step the slow tool would wait for ever, so it times out, and each turn is one call of both."""
    flag = tmp_path / "fast-episode-answered"

    def wait_for_the_other(seconds: float) -> str:
        """Wait until the other episode has answered.

        Args:
            seconds: unused.
        """
        while not flag.exists():
            time.sleep(0.01)
        return "done"

    def fast(seconds: float) -> str:
        """Answer at once.

        Args:
            seconds: unused.
        """
        return "done"

    tok = build_tiny_tokenizer()

    def script(text: str) -> str:
        if "done" in text:
            if "fast" in text:
                flag.touch()
            return "Finished."
        name = "wait_for_the_other" if "slow" in text else "fast"
        return f'<tool_call>{{"name": "{name}", "arguments": {{"seconds": 0}}}}</tool_call>'

    calls = {}
    for mode in (True, False):
        flag.unlink(missing_ok=True)
        engine = ScriptedEngine(tok, script=script)
        cfg = RolloutConfig(
            max_new_tokens=128, episode=EpisodeConfig(async_episodes=mode, tool_workers=2, tool_timeout_s=3)
        )
        batch, _ = run(
            tok, ToolEnvironment(tools=[wait_for_the_other, fast]), cfg, texts=["slow", "fast"], engine=engine
        )
        calls[mode] = (engine.calls, batch["tool_errors"].tolist())
    assert calls == {True: ([2, 1, 1], [0, 0]), False: ([2, 2, 1], [1, 0])}


def test_episodes_read_calls_with_the_tokenizers_response_template() -> None:
    """A model that writes Llama-3-style JSON calls, with a tokenizer that says so (its ``response_template``): the
    default ``tool_parser="auto"`` reads the calls and the tools answer; Hermes' tags would see none."""
    from tests.unit.test_agent_tools import JSON_CALLS

    tok = qwen_style_tokenizer()
    tok.response_template = JSON_CALLS
    call = '{"name": "calculator", "parameters": {"expression": "37 * 41"}}'
    engine = ScriptedEngine(tok, script=lambda text: "It is 1517." if "1517" in text else call)
    batch, _ = run(tok, ToolEnvironment(tools=[calculator]), RolloutConfig(max_new_tokens=128), engine=engine)
    assert [m["content"] for m in batch["episode"][0] if m["role"] == "tool"] == ["1517"]
    assert batch["tool_calls"].tolist() == [1] and batch["turns"].tolist() == [2]
    hermes_cfg = RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(tool_parser="hermes"))
    hermes, _ = run(
        tok, ToolEnvironment(tools=[calculator]), hermes_cfg, engine=ScriptedEngine(tok, script=lambda text: call)
    )
    assert hermes["tool_calls"].tolist() == [0] and hermes["turns"].tolist() == [1]


def test_async_tools_answer_episodes_from_their_worker() -> None:
    tok = build_tiny_tokenizer()
    call = '<tool_call>{"name": "nap", "arguments": {"seconds": 0.05}}</tool_call>'
    engine = ScriptedEngine(tok, script=lambda text: "Up." if "rested" in text else call)
    for mode in (True, False):
        cfg = RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(async_episodes=mode))
        batch, _ = run(tok, ToolEnvironment(tools=[nap]), cfg, texts=["a", "b", "c"], engine=engine)
        assert [[m["content"] for m in ep if m["role"] == "tool"] for ep in batch["episode"]] == [["rested"]] * 3
        assert batch["tool_errors"].tolist() == [0] * 3 and (batch["tool_s"] > 0).all()


class Wallet:
    """A TRL ``environment_factory``-style class: state per episode, public methods as tools (one plain, one
    ``async def``, one that hangs), ``reset(**row)`` adding text to the prompt, an ``async def get_reward``."""

    def __init__(self) -> None:
        self.balance = 0

    def reset(self, **row) -> str:
        self.balance = 10
        return " (balance: 10)"

    def deposit(self, amount: int) -> int:
        """Put money in.

        Args:
            amount: how much.
        """
        self.balance += amount
        return self.balance

    async def withdraw(self, amount: int) -> int:
        """Take money out.

        Args:
            amount: how much.
        """
        await asyncio.sleep(0)
        self.balance -= amount
        return self.balance

    def audit(self, depth: int) -> str:
        """Hang.

        Args:
            depth: unused.
        """
        time.sleep(60)
        return "never"

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return float(self.balance)


def test_a_trl_style_environment_keeps_state_runs_async_methods_and_times_out_a_hung_one() -> None:
    tok = build_tiny_tokenizer()
    turns = {
        0: '<tool_call>{"name": "deposit", "arguments": {"amount": 5}}</tool_call>',
        1: '<tool_call>{"name": "withdraw", "arguments": {"amount": 3}}</tool_call>',
        2: '<tool_call>{"name": "audit", "arguments": {"depth": 1}}</tool_call>',
    }
    engine = ScriptedEngine(tok, script=lambda text: turns.get(text.count("</tool_call>"), "Done."))  # calls so far
    cfg = RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(max_turns=5, tool_timeout_s=3))
    batch, _ = run(tok, Wallet, cfg, texts=["Spend wisely."], engine=engine)
    episode = batch["episode"][0]
    assert episode[0]["content"].endswith("(balance: 10)")
    tools = [m["content"] for m in episode if m["role"] == "tool"]
    assert tools == ["15", "12", "error: the tool audit timed out after 3 s"]
    assert batch["tool_errors"].tolist() == [1] and batch["env_reward"] == [12.0]  # the async get_reward, awaited


def test_reset_that_returns_nothing_is_refused() -> None:
    class Empty(Environment):
        def reset(self, row):
            return []

    with pytest.raises(ValueError, match=r"Empty.reset\(row\) returned \[\]; expected a non-empty list of chat"):
        run(build_tiny_tokenizer(), Empty, RolloutConfig(max_new_tokens=8))


def _untyped(x):
    """Echo.

    Args:
        x: anything.
    """
    return x


def test_environment_mistakes_fail_when_the_module_is_built(tiny_model: str, tmp_path: Path) -> None:
    """A tool without type hints, a tokenizer without a chat template and a tool format the tokenizer cannot read are
    refused by the module's constructor (on the controller, before any process or model starts), not by a worker at
    the first rollout."""
    settings = dict(reward=addition_reward, reference=False, algorithm=AlgorithmConfig(kl=KLConfig(coef=0.0)))
    with pytest.raises(ValueError, match=r"tool '_untyped': its JSON schema cannot be made .* HINT: .*type hint"):
        GRPOModule(tiny_model, environment=ToolEnvironment(tools=[_untyped]), **settings)
    bare = tmp_path / "no_template"
    shutil.copytree(tiny_model, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"an environment needs a chat template: the tokenizer has none"):
        GRPOModule(str(bare), environment=ToolEnvironment(tools=[calculator]), **settings)
    with pytest.raises(ValueError, match=r"tool_parser='template'\) reads calls with the tokenizer's response_temp"):
        GRPOModule(
            tiny_model, environment=ToolEnvironment(tools=[calculator]),
            rollout=RolloutConfig(episode=EpisodeConfig(tool_parser="template")), **settings,
        )  # fmt: skip
    GRPOModule(tiny_model, environment=ToolEnvironment(tools=[calculator]), **settings)  # the same, well made


def test_rollout_config_refuses_bad_episode_settings() -> None:
    for field, value in [("max_turns", 0), ("tool_timeout_s", 0), ("tool_workers", 0), ("max_episode_tokens", 1)]:
        with pytest.raises(ValueError, match=rf"EpisodeConfig.{field}={value}"):
            RolloutConfig(episode={field: value})
    assert dataclasses.replace(RolloutConfig(), episode=EpisodeConfig(max_turns=2)).episode.max_turns == 2


class GroupEngine(ScriptedEngine):
    """Rank ``rank`` of a TP-2 engine whose other rank is a thread: each ``agree`` and ``generate`` is collective, as
    vLLM's ``all_gather`` of the group's prompts is (a barrier; the rank that makes a call the other never makes
    breaks it at its timeout: a failure, not a hang)."""

    tp_size = 2

    def __init__(self, tokenizer, script, rank: int, meet: threading.Barrier, shared: dict) -> None:
        super().__init__(tokenizer, script)
        self.rank, self.meet, self.shared = rank, meet, shared
        self.collectives: list[str] = []

    def _together(self, kind: str, value: object) -> list:
        """Both ranks' ``value`` of their n-th collective call; both must be of ``kind``."""
        n = len(self.collectives)
        self.collectives.append(kind)
        self.shared.setdefault(n, {})[self.rank] = (kind, value)
        self.meet.wait()
        met = self.shared[n]
        assert {k for k, _ in met.values()} == {kind}, met  # the same call on both ranks
        return [v for _, v in met.values()]

    def agree(self, calls: int, busy: bool) -> tuple[int, bool]:
        both = self._together("agree", (calls, busy))
        return max(c for c, _ in both), any(b for _, b in both)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        self._together("generate", len(prompts))
        return super().generate(prompts, params)


@pytest.mark.parametrize("async_episodes", [False, True])
def test_the_ranks_of_a_tp_group_make_the_same_collective_calls_when_their_episodes_differ(
    async_episodes: bool,
) -> None:
    tok = build_tiny_tokenizer()
    meet, shared = threading.Barrier(2, timeout=30), {}
    answers_at_once = GroupEngine(tok, lambda text: "The answer is 5.", 0, meet, shared)  # one turn per episode
    uses_the_tool = GroupEngine(tok, None, 1, meet, shared)  # a tool call, then the answer: two turns
    cfg = RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(max_turns=4, async_episodes=async_episodes))
    results: dict[int, Batch] = {}

    def rank(k: int, engine: GroupEngine, texts: list[str]) -> None:
        results[k], _ = run(tok, ToolEnvironment(tools=[calculator]), cfg, texts=texts, engine=engine)

    threads = [
        threading.Thread(target=rank, args=(0, answers_at_once, ["2+3=?"])),
        threading.Thread(target=rank, args=(1, uses_the_tool, ["37*41=?", "37*41=?"])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not meet.broken and len(results) == 2, "a rank waited for a collective call the other never made"
    assert results[0]["turns"].tolist() == [1] and results[1]["turns"].tolist() == [2, 2]
    # the same collective calls in the same order; the rank whose episode ended made its second call with no prompts
    assert answers_at_once.collectives == uses_the_tool.collectives
    assert answers_at_once.prompts_read[-1] == 0 and uses_the_tool.prompts_read[-1] > 0


# ------------------------------------------------------------------------------------------------ agent loops
def loop_run(tok, loop: str, timeout_s: float = 600.0, texts=("37*41=?",), engine=None) -> Batch:
    cfg = RolloutConfig(max_new_tokens=64, episode=EpisodeConfig(agent_loop=loop, episode_timeout_s=timeout_s))
    return run(tok, ToolEnvironment(tools=[calculator]), cfg, texts=texts, engine=engine)[0]


@register_agent_loop("test-critique")
class Critique:
    """A loop of its own: the model answers, a fixed user turn asks it to check, it answers again (no tools)."""

    async def run(self, episode: EpisodeContext) -> None:
        turn = await episode.generate()
        if turn.truncated:
            return
        assert episode.observe([{"role": "user", "content": "Check it."}])
        await episode.generate()


def test_a_registered_loop_of_ones_own_runs_its_turns_with_the_librarys_tokens_and_masks() -> None:
    tok = build_tiny_tokenizer()
    engine = ScriptedEngine(tok, script=lambda text: "It is 5." if "Check" not in text else "Checked: 5.")
    batch = loop_run(tok, "test-critique", engine=engine)
    messages = batch["episode"][0]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[-1]["content"] == "Checked: 5." and batch["turns"].tolist() == [2]
    r = batch["response_mask"][0].bool()
    sampled = batch["sampled_mask"][0][r].bool()
    eot = check_chat_template(tok).end_of_turn_id
    turn = [*tok.encode("It is 5.", add_special_tokens=False), eot]
    assert batch["responses"][0][r][sampled].tolist() == [
        *turn,
        *tok.encode("Checked: 5.", add_special_tokens=False),
        eot,
    ]
    assert "Check it." in tok.decode(batch["responses"][0][r][~sampled].tolist())
    assert batch["tool_calls"].tolist() == [0] and batch["episode_timeout"].tolist() == [False]


@register_agent_loop("test-raises")
async def raises(episode: EpisodeContext) -> None:
    await episode.generate()
    raise KeyError("no such thing")


@register_agent_loop("test-returns")
async def returns(episode: EpisodeContext) -> list[int]:
    turn = await episode.generate()
    return turn.ids


@register_agent_loop("test-hangs")
async def hangs(episode: EpisodeContext) -> None:
    if "slow" in episode.opening:
        await asyncio.Event().wait()  # never set
    await episode.generate()


@register_agent_loop("test-waits")
async def waits(episode: EpisodeContext) -> None:
    if "slow" in episode.opening:
        await episode.wait(asyncio.sleep(0.5))  # the engine goes on with the other episode meanwhile
    await episode.generate()
    await episode.generate()


def test_a_loop_that_raises_or_returns_a_value_stops_the_rollout_with_its_name() -> None:
    tok = build_tiny_tokenizer()
    with pytest.raises(AgentLoopError, match=r"'test-raises' \(_FunctionLoop\) raised in episode .*KeyError"):
        loop_run(tok, "test-raises")
    with pytest.raises(AgentLoopError, match=r"'test-returns' .* returned \[.*an agent loop returns None"):
        loop_run(tok, "test-returns")


def test_a_loop_that_never_returns_is_cut_and_counted_while_the_others_finish() -> None:
    tok = build_tiny_tokenizer()
    engine = ScriptedEngine(tok, script=lambda text: "ok.")
    batch = loop_run(tok, "test-hangs", timeout_s=0.5, texts=("slow", "fast"), engine=engine)
    assert batch["episode_timeout"].tolist() == [True, False]
    assert batch["response_truncated"].tolist() == [True, False] and batch["turns"].tolist() == [0, 1]
    assert "episode_timeout_s=0.5" in batch["episode_problems"][0]["episode_timeout"]
    assert episode_metrics(batch)["rollout/episode_timeout"] == 1.0


def test_awaiting_through_the_episode_lets_the_engine_go_on_with_the_others() -> None:
    tok = build_tiny_tokenizer()
    engine = ScriptedEngine(tok, script=lambda text: "ok.")
    batch = loop_run(tok, "test-waits", texts=("slow", "fast"), engine=engine)
    assert batch["turns"].tolist() == [2, 2]
    assert engine.calls == [1, 1, 1, 1]  # the fast episode's two turns ran while the slow one waited


def test_agent_loop_settings_are_checked_when_the_module_is_built(tiny_model: str) -> None:
    with pytest.raises(
        ValueError, match=r"agent_loop='nope'\) names no registered agent loop; registered: \[.*'tools'"
    ):
        GRPOModule(
            tiny_model,
            environment=ToolEnvironment,
            reward=addition_reward,
            rollout=RolloutConfig(episode=EpisodeConfig(agent_loop="nope")),
            reference=False,
            algorithm=AlgorithmConfig(kl=KLConfig(coef=0.0)),
        )
    with pytest.raises(ValueError, match="episode_timeout_s"):
        EpisodeConfig(episode_timeout_s=0)
    with pytest.raises(ValueError, match="not an `async def` method"):

        @register_agent_loop("test-sync")
        class Sync:
            def run(self, episode: EpisodeContext) -> None: ...

    with pytest.raises(ValueError, match="the name is taken by"):
        register_agent_loop("tools")(Critique)


class FailingQueue(BatchedRequestQueue):
    def step(self, done, busy: bool) -> bool:
        raise RuntimeError("the engine broke")


def test_an_engine_that_fails_mid_rollout_fails_the_rollout_without_a_hang() -> None:
    tok = build_tiny_tokenizer()
    engine = ScriptedEngine(tok)
    engine.__dict__["requests"] = FailingQueue(engine)
    with pytest.raises(RuntimeError, match="the engine broke"):
        loop_run(tok, "tools", texts=("a", "b"), engine=engine)
