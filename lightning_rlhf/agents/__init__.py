"""Agentic RL: multi-turn episodes in which the policy calls tools or acts in an environment (docs/agents.md).

Public names: :class:`Environment`, :class:`ToolEnvironment`, :class:`Episode`, :func:`register_tool_parser`,
:class:`ToolCall`, :class:`ParsedTurn`; agent loops (:func:`register_agent_loop`, :class:`AgentLoop`,
:class:`ToolLoop`, the :class:`EpisodeContext` a loop drives and the :class:`Turn` it samples). The rollout itself
(:func:`~lightning_rlhf.agents.rollout.sample_episodes`) runs inside the actor's (or a rollout pool's) ``generate``
when the module has an ``environment``.
"""

from typing import TYPE_CHECKING

from lightning_rlhf.agents.env import Environment, Episode, ToolEnvironment, as_environment, environment_factory
from lightning_rlhf.agents.parsing import ParsedTurn, ToolCall, get_tool_parser, register_tool_parser
from lightning_rlhf.lazy import lazy_exports

if TYPE_CHECKING:  # loaded on first use: the loops pull in the engines' request types (tool workers import this)
    from lightning_rlhf.agents.context import EpisodeContext, Turn
    from lightning_rlhf.agents.loops import AgentLoop, ToolLoop, agent_loop_names, register_agent_loop

__all__ = [
    "AgentLoop",
    "Environment",
    "Episode",
    "EpisodeContext",
    "ParsedTurn",
    "ToolCall",
    "ToolEnvironment",
    "ToolLoop",
    "Turn",
    "agent_loop_names",
    "as_environment",
    "environment_factory",
    "get_tool_parser",
    "register_agent_loop",
    "register_tool_parser",
]

__getattr__, __dir__ = lazy_exports(__name__, __file__)
