"""An OpenAI-compatible chat-completions endpoint for agent programs (:class:`ChatProxy`): during a rollout, each rank
that runs episodes serves ``POST /v1/chat/completions`` (and ``GET /v1/models``) on 127.0.0.1, one session per
episode (the session is the request's API key). Each completion an agent asks for is the episode's next turn: the
messages it added since the last one (tool results, user turns) are appended as observation ids by the chat template,
the engine samples the turn, and its tool calls go back in OpenAI's ``tool_calls`` format, so an agent written against
the ``openai`` client runs unchanged and its session becomes a trainable episode (token ids, log-probs, masks). FastAPI
and uvicorn serve it (both come with vLLM); docs/agents.md, "Any agent over HTTP".
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

from lightning_rlhf.agents.context import EpisodeContext
from lightning_rlhf.agents.env import Message
from lightning_rlhf.agents.tokens import check_chat_template, render_chat

__all__ = ["LOCAL_HOSTS", "ChatProxy"]

LOCAL_HOSTS = ("127.0.0.1", "::1", "localhost")
"""Where requests may come from: this machine only."""


class _Session:
    """One episode as its agent sees it: the messages it knows (its own requests' and the replies')."""

    def __init__(self, episode: EpisodeContext) -> None:
        self.episode = episode
        self.known: list[Message] = []  # the conversation so far, as the agent sent it and as we replied
        self.tools: list[dict[str, Any]] = []
        self.calls: dict[str, str] = {}  # tool call id -> the tool's name (tool results carry the id)
        self.ended = False


class ChatProxy:
    """The endpoint of one rollout on this rank (see the module). ``model``: the name agents must ask for (the
    actor's path); ``tokenizer``: the actor's. Made by the first HTTP episode of a rollout (:meth:`start`), closed when
    the rollout ends (:meth:`aclose`). Runs on: the rollout's process, in its event loop."""

    def __init__(self, model: str, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.port = 0
        self.diverged = 0  # requests whose conversation was not the session's
        self._sessions: dict[str, _Session] = {}
        self._server: Any = None
        self._serving: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        """What an ``openai`` client takes as ``base_url``."""
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> ChatProxy:
        """Serve on a free port of 127.0.0.1; returns once it listens. Runs on: the rollout's event loop."""
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        async def chat(request: Any) -> JSONResponse:  # a starlette route: the request is passed, not injected
            host = request.client.host if request.client else ""
            status, body = await self.complete(host, request.headers, await request.json())
            return JSONResponse(body, status_code=status)

        async def models(request: Any) -> JSONResponse:
            listed = [{"id": self.model, "object": "model", "owned_by": "lightning_rlhf"}]
            return JSONResponse({"object": "list", "data": listed})

        app = FastAPI()
        app.add_route("/v1/chat/completions", chat, methods=["POST"])
        app.add_route("/v1/models", models, methods=["GET"])
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._serving = asyncio.get_running_loop().create_task(self._server.serve())
        while not self._server.started:
            if self._serving.done():  # it could not start: its error
                self._serving.result()
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        """Stop serving. Runs on: the rollout's event loop, when the rollout ends."""
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await asyncio.gather(self._serving, return_exceptions=True)

    def open(self, episode: EpisodeContext) -> str:
        """A new session for ``episode``; returns its key (the agent's API key). Runs on: the rollout's event loop."""
        key = f"lrlhf-{secrets.token_hex(12)}"
        self._sessions[key] = _Session(episode)
        return key

    def close(self, key: str) -> None:
        """End session ``key``: later requests with it are refused. Runs on: the rollout's event loop."""
        self._sessions.pop(key, None)

    async def complete(self, host: str, headers: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """One chat completion: ``(HTTP status, JSON body)``. Refused: a request from another machine (403), an
        unknown session (401), another model than the one being trained (404), ``stream=true`` or a conversation that
        is not the session's (400). Runs on: the rollout's event loop."""
        if host not in LOCAL_HOSTS:
            return _error(403, f"requests come from this machine only, not {host}", "permission_denied")
        token = str(headers.get("authorization", "")).removeprefix("Bearer ").strip()
        session = self._sessions.get(token)
        if session is None:
            return _error(
                401, "no such session: the API key is the one the episode's agent was given", "invalid_api_key"
            )
        if body.get("model") != self.model:
            return _error(
                404,
                f"the model {body.get('model')!r} is not served here; the model being trained is {self.model!r} "
                "(the agent was given it as LIGHTNING_RLHF_MODEL)",
                "model_not_found",
            )
        if body.get("stream"):
            return _error(400, "stream=true is not served: ask for whole completions (stream=false)", "invalid_request")
        if session.ended:
            return _error(400, "the episode has ended (a limit was reached); end the session", "episode_ended")
        episode = session.episode
        messages = [dict(m) for m in body.get("messages") or []]
        if any(_has_image(m) for m in messages):
            return _error(
                400,
                "a message holds an image (image_url): agents over HTTP are served text only; an environment's "
                "messages carry images (docs/vision.md)",
                "invalid_request",
            )
        try:
            if not session.known:
                self._first(session, messages, body.get("tools") or [])
            elif not self._follow(session, messages):
                return _error(400, "the conversation is not the session's: send its messages as they were", "diverged")
        except ValueError as err:
            return _error(400, str(err), "invalid_request")
        if session.ended or episode.last_turn or episode.room <= 0:
            session.ended = True
            episode.truncate()
            return _error(
                400, f"the episode has ended: max_turns={episode.info.turns} or its token budget", "episode_ended"
            )
        turn = await episode.generate()
        calls = episode.tool_calls(turn) if session.tools else []
        ids = [f"call_{episode.info.turns}_{k}" for k in range(len(calls))]
        tool_calls = [
            {"id": i, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for i, c in zip(ids, calls, strict=True)
        ]
        session.calls |= {i: c.name for i, c in zip(ids, calls, strict=True)}
        reply: dict[str, Any] = {"role": "assistant", "content": turn.text}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        session.known = [*messages, reply]
        if turn.truncated:
            session.ended = True
        episode.driver.waits_on_its_own(episode.key)  # the agent thinks now: the engine goes on with the others
        reason = "length" if turn.truncated else "tool_calls" if tool_calls else "stop"
        return 200, {
            "id": f"chatcmpl-{secrets.token_hex(8)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": reply, "finish_reason": reason, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(episode.prompt) + len(episode.ids) - len(turn.ids),
                "completion_tokens": len(turn.ids),
                "total_tokens": len(episode.prompt) + len(episode.ids),
            },
        }

    def _first(self, session: _Session, messages: list[Message], tools: list[dict[str, Any]]) -> None:
        """The session's first request: its messages (and tools) rendered by the chat template are the prompt."""
        if not messages:
            raise ValueError("messages is empty: send at least the user's first turn")
        episode = session.episode
        session.tools = [dict(t) for t in tools]  # OpenAI's format, as chat templates take them
        kwargs = dict(episode.runner.chat_template_kwargs) | ({"tools": session.tools} if session.tools else {})
        episode.prompt = render_chat(self.tokenizer, messages, generation=True, **kwargs)
        episode.delta = check_chat_template(self.tokenizer, tool_turns=bool(session.tools), **kwargs)
        episode.info.messages = [dict(m) for m in messages]
        session.known = list(messages)

    def _follow(self, session: _Session, messages: list[Message]) -> bool:
        """A later request: the session's conversation, then what the agent added (appended as observation ids).
        False (counted) for a conversation that is not the session's."""
        known = session.known
        same = len(messages) > len(known) and all(
            m.get("role") == k.get("role") and (m.get("content") or "") == (k.get("content") or "")
            for m, k in zip(messages, known, strict=False)
        )
        if not same:
            self.diverged += 1
            session.episode.problem("http_diverged", f"a request's {len(messages)} messages were not the session's")
            return False
        new = [dict(m) for m in messages[len(known) :]]
        for message in new:  # a tool result names its tool, as chat templates expect
            if message.get("role") == "tool" and "name" not in message:
                message["name"] = session.calls.get(str(message.get("tool_call_id")), "tool")
        if not session.episode.observe(new):
            session.ended = True
        return True


def _error(status: int, message: str, code: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "code": code}}


def _has_image(message: dict[str, Any]) -> bool:
    """Whether a chat message's content holds an image item (OpenAI's ``image_url``, or ``image``)."""
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(item, dict) and item.get("type") in ("image_url", "image", "input_image") for item in content
    )
