"""Any agent over HTTP (:class:`HttpAgentLoop`): an episode is an agent program of one's own, run as a process, that
talks to the policy through an OpenAI-compatible endpoint (:class:`~lightning_rlhf.agents.proxy.ChatProxy`); every
completion it asks for is a turn of the episode. docs/agents.md, "Any agent over HTTP".
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import os
import sys
from typing import Any

from lightning_rlhf.agents.context import EpisodeContext
from lightning_rlhf.agents.proxy import ChatProxy

__all__ = ["AgentSettings", "HttpAgentLoop"]

_OUTPUT_CHARS = 2000  # of the agent's output kept for the reward (its last characters)
_AGENT_THREADS = 64  # agents (functions) talking to the endpoint at once, per rank


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    """What an agent needs to reach the policy: the ``openai`` client's ``base_url`` and ``api_key`` (the episode's
    session) and the ``model`` to ask for (also ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``LIGHTNING_RLHF_MODEL`` in
    an agent program's environment)."""

    base_url: str
    api_key: str
    model: str


class HttpAgentLoop:
    """An agent loop whose episodes are agents of one's own that speak the OpenAI chat API. Subclass it and define
    either :meth:`command` (an agent program, run as a process with the client's settings in its environment) or
    :meth:`agent` (a plain function, e.g. a script's ``main``, run in a thread of its own: cheaper than a process per
    episode), then register it (``@register_agent_loop(name)``). The episode ends when the agent returns or exits;
    its reward is the environment's ``reward(episode)``, which sees the conversation (``episode.messages``) and the
    agent's output (``episode.row["agent_output"]``: the function's return value, or the program's last output). An
    agent silent for longer than ``EpisodeConfig.episode_timeout_s`` between two requests is cut (a program is killed)
    and counted (``rollout/episode_timeout``). Runs on: the rollout's process."""

    def command(self, episode: EpisodeContext) -> list[str] | None:
        """The agent program's command line for ``episode`` (its task as an argument: ``episode.opening``); None (the
        default): the agent is :meth:`agent`."""
        return None

    def agent(self, task: str, settings: AgentSettings) -> str:
        """The agent as a function of the episode's task (its first user message): talk to ``settings.base_url`` with
        the ``openai`` client, return its answer. Runs on: a thread of the rollout's process."""
        raise NotImplementedError(f"{type(self).__name__}: define agent(task, settings) or command(episode)")

    async def run(self, episode: EpisodeContext) -> None:
        """Run the agent for ``episode`` against this rollout's endpoint until it returns or exits."""
        runner = episode.runner
        proxy: ChatProxy = await runner.resources.get(
            "chat_proxy", lambda: ChatProxy(runner.model_name, runner.tokenizer).start()
        )
        key = proxy.open(episode)
        settings = AgentSettings(proxy.base_url, key, proxy.model)
        try:
            command = self.command(episode)
            if command is None:
                threads = await runner.resources.get("agent_threads", _threads)
                loop = asyncio.get_running_loop()
                output, code = await episode.wait(loop.run_in_executor(threads, self._call, episode.opening, settings))
            else:
                output, code = await self._program(episode, command, settings)
        finally:
            proxy.close(key)
        row: Any = episode.info.row
        episode.info.row = {**row, "agent_output": output[-_OUTPUT_CHARS:], "agent_exit": code}
        if code != 0:
            episode.problem("agent_failed", f"the agent ended with {code}: {output[-300:]!r}")
        if episode.info.turns == 0:
            episode.truncate()

    def _call(self, task: str, settings: AgentSettings) -> tuple[str, int]:
        try:
            return str(self.agent(task, settings)), 0
        except Exception as err:  # the episode counts it; the rollout goes on
            return f"{type(err).__name__}: {err}", 1

    @staticmethod
    async def _program(episode: EpisodeContext, command: list[str], settings: AgentSettings) -> tuple[str, int]:
        env = os.environ | {
            "OPENAI_BASE_URL": settings.base_url,
            "OPENAI_API_KEY": settings.api_key,
            "LIGHTNING_RLHF_MODEL": settings.model,
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        proc = await asyncio.create_subprocess_exec(
            *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            output, _ = await episode.wait(proc.communicate())
        finally:
            if proc.returncode is None:  # cut (the episode's timeout): the program goes with it
                proc.kill()
                await proc.wait()
        return output.decode(errors="replace"), int(proc.returncode or 0)


class _Threads(cf.ThreadPoolExecutor):
    """The agents' threads of one rollout (closed with it)."""

    async def aclose(self) -> None:
        self.shutdown(wait=False, cancel_futures=True)


async def _threads() -> _Threads:
    return _Threads(_AGENT_THREADS, thread_name_prefix="lightning-rlhf-agent")
