"""Agentic RL: multi-turn episodes in which the policy calls tools or acts in an environment (docs/agents.md).

Public names: :class:`Environment`, :class:`ToolEnvironment`, :class:`Episode`, :func:`register_tool_parser`,
:class:`ToolCall`, :class:`ParsedTurn`; the rollout itself (:func:`~lightning_rlhf.agents.rollout.sample_episodes`)
runs inside the actor's (or a rollout pool's) ``generate`` when the module has an ``environment``.
"""

from lightning_rlhf.agents.env import Environment, Episode, ToolEnvironment, as_environment, environment_factory
from lightning_rlhf.agents.parsing import ParsedTurn, ToolCall, get_tool_parser, register_tool_parser

__all__ = [
    "Environment",
    "Episode",
    "ParsedTurn",
    "ToolCall",
    "ToolEnvironment",
    "as_environment",
    "environment_factory",
    "get_tool_parser",
    "register_tool_parser",
]
