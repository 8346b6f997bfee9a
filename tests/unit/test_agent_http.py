"""Any agent over HTTP (lightning_rlhf.agents.proxy, .http): an agent written against the real ``openai`` client talks
to the policy through the real endpoint (FastAPI + uvicorn on 127.0.0.1) and its session becomes the same episode the
built-in tool loop makes; the endpoint refuses another model, another machine, streaming, an image and a conversation
that is not the session's, each with a clear error; an agent that fails or never answers is counted."""

from __future__ import annotations

import time

import pytest
from transformers.utils import get_json_schema

from lightning_rlhf.agents import ToolEnvironment, register_agent_loop
from lightning_rlhf.agents.http import AgentSettings, HttpAgentLoop
from lightning_rlhf.config import EpisodeConfig, RolloutConfig
from lightning_rlhf.demo.http_agent import solve
from lightning_rlhf.demo.tiny import build_tiny_tokenizer
from tests.agent_tools import calculator
from tests.scripted import ScriptedEngine, run


@register_agent_loop("test-openai")
class OpenAIAgent(HttpAgentLoop):
    """The demo's agent with the test calculator's schema."""

    def agent(self, task: str, settings: AgentSettings) -> str:
        return solve(task, settings, tools=[get_json_schema(calculator)])


@register_agent_loop("test-wrong-model")
class WrongModel(HttpAgentLoop):
    def agent(self, task: str, settings: AgentSettings) -> str:
        from openai import NotFoundError

        with pytest.raises(NotFoundError, match="the model 'gpt-4o' is not served here; the model being trained is"):
            solve(task, AgentSettings(settings.base_url, settings.api_key, "gpt-4o"))
        return "refused"


@register_agent_loop("test-silent")
class Silent(HttpAgentLoop):
    def agent(self, task: str, settings: AgentSettings) -> str:
        time.sleep(3)  # never asks: cut by the episode's timeout
        return ""


def episodes(loop: str, texts=("37*41=?", "2+3=?"), timeout_s: float = 600.0):
    tok = build_tiny_tokenizer()
    cfg = RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(agent_loop=loop, episode_timeout_s=timeout_s))
    return run(tok, ToolEnvironment(tools=[calculator]), cfg, texts=texts, engine=ScriptedEngine(tok))


def test_an_openai_client_agent_makes_the_episode_the_builtin_tool_loop_makes() -> None:
    builtin, _ = episodes("tools")
    over_http, engine = episodes("test-openai")
    for key in ("prompts", "prompt_mask", "responses", "response_mask", "sampled_mask", "turns", "tool_calls"):
        assert over_http[key].tolist() == builtin[key].tolist(), key
    assert over_http["rollout_logprobs"].tolist() == builtin["rollout_logprobs"].tolist()
    assert over_http["turns"].tolist() == [2, 2] and sum(engine.calls) == 4  # each request as its agent sent it
    assert [m["role"] for m in over_http["episode"][0]] == ["user", "assistant", "tool", "assistant"]
    assert over_http["episode"][0][-1]["content"] == "The answer is 1517."


def test_the_endpoint_refuses_another_model_and_a_silent_agent_is_cut_and_counted() -> None:
    refused, _ = episodes("test-wrong-model")
    assert refused["turns"].tolist() == [0, 0] and refused["response_truncated"].all()
    silent, _ = episodes("test-silent", texts=("1+1=?",), timeout_s=0.5)
    assert silent["episode_timeout"].tolist() == [True]


async def _complete(proxy, host: str, key: str, body: dict):
    return await proxy.complete(host, {"authorization": f"Bearer {key}"}, body)


def test_the_endpoint_refuses_other_machines_streaming_unknown_sessions_and_a_foreign_conversation() -> None:
    import asyncio
    from types import SimpleNamespace

    from lightning_rlhf.agents.proxy import ChatProxy

    async def scenario() -> list[tuple[int, str]]:
        proxy = ChatProxy("policy", build_tiny_tokenizer())
        problems: list[str] = []
        fake = SimpleNamespace(problem=lambda kind, text: problems.append(kind))
        key = proxy.open(fake)  # type: ignore[arg-type]
        user, other = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}
        foreign = {"model": "policy", "messages": [user, other, user]}
        picture = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}
        session = proxy._sessions[key]
        session.known = [user, {"role": "assistant", "content": "hello"}]
        out = [
            await _complete(proxy, "10.0.0.7", key, {"model": "policy", "messages": [user]}),
            await _complete(proxy, "127.0.0.1", "nope", {"model": "policy", "messages": [user]}),
            await _complete(proxy, "127.0.0.1", key, {"model": "policy", "messages": [user], "stream": True}),
            await _complete(proxy, "127.0.0.1", key, foreign),
            await _complete(proxy, "127.0.0.1", key, {"model": "policy", "messages": [picture]}),
        ]
        assert problems == ["http_diverged"] and proxy.diverged == 1
        return [(status, body["error"]["code"]) for status, body in out]

    assert asyncio.run(scenario()) == [
        (403, "permission_denied"),
        (401, "invalid_api_key"),
        (400, "invalid_request"),
        (400, "diverged"),
        (400, "invalid_request"),  # an image: agents over HTTP are served text only
    ]
