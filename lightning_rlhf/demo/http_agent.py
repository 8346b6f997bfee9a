"""The tool task's agent over HTTP (``python -m lightning_rlhf.demo --task tools --agent http``): a small agent written
against the ``openai`` client, as one would write it for any OpenAI-compatible server. It asks for a completion with
the calculator as a tool, runs the calculator itself when the model calls it, sends the result back, and returns the
model's final answer. Run alone against a server: ``OPENAI_BASE_URL=... OPENAI_API_KEY=... LIGHTNING_RLHF_MODEL=...
python -m lightning_rlhf.demo.http_agent "482+397="``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from lightning_rlhf.agents.http import AgentSettings, HttpAgentLoop
from lightning_rlhf.agents.loops import register_agent_loop
from lightning_rlhf.demo.calculator import calculator

__all__ = ["CALCULATOR_TOOL", "CalculatorHttpAgent", "solve"]

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer arithmetic expression with +, - and *.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": 'The expression, e.g. "482+397" or "12*(3-1)".'}
            },
            "required": ["expression"],
        },
    },
}
"""The calculator in OpenAI's tool format (what the environment's ``calculator`` renders to)."""


def solve(
    task: str, settings: AgentSettings, *, max_requests: int = 4, tools: list[dict[str, Any]] | None = None
) -> str:
    """Ask the model ``task`` with the calculator as a tool (``tools``: its schema; default :data:`CALCULATOR_TOOL`);
    run its calls; return its last answer. Runs on: the agent's thread or process."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=settings.base_url, api_key=settings.api_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": task}]
    answer = ""
    for _ in range(max_requests):
        try:
            reply = client.chat.completions.create(
                model=settings.model,
                messages=messages,
                tools=tools or [CALCULATOR_TOOL],  # type: ignore[arg-type]
            )
        except BadRequestError:  # the episode ended (a limit)
            break
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))  # type: ignore[union-attr]
            except Exception as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return answer


@register_agent_loop("http-calculator")
class CalculatorHttpAgent(HttpAgentLoop):
    """The demo's agent loop: :func:`solve` in a thread per episode. Runs on: the rollout's process."""

    def agent(self, task: str, settings: AgentSettings) -> str:
        """:func:`solve` ``task``. Runs on: an agent thread."""
        return solve(task, settings)


def main() -> None:
    """The agent as a program: the task from the command line, the server from the environment."""
    settings = AgentSettings(
        os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["LIGHTNING_RLHF_MODEL"]
    )
    print(solve(sys.argv[1], settings))


if __name__ == "__main__":
    main()
