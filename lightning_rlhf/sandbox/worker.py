"""The worker's program: what a sandbox worker process runs (``python -P lightning_rlhf/sandbox/worker.py FD PID``,
started by :func:`lightning_rlhf.sandbox.process.spawn_worker`). It loads what it serves (a reward function, a
mapping of tool names to functions, or of ``async def`` tools), then serves calls on its socket until the end of
input.

This file runs as a script in a fresh interpreter: it imports only the standard library (and, when it unpickles it,
what the function needs), never ``lightning_rlhf`` or torch, so that a worker starts in a fraction of a second. The
parent side imports it too, for the helpers that read a call's result the same way in either process
(:func:`as_scores`, :func:`tool_answer`, :func:`awaited`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import linecache
import math
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

__all__ = [
    "DYNAMIC_CODE",
    "Result",
    "ScoresError",
    "as_scores",
    "awaited",
    "raised_message",
    "tool_answer",
    "tool_result_text",
]

Result = tuple[str, list[float] | None, str, str]
"""What a worker sends back for one reward or plain-tool call: ``(kind, scores, message, traceback)``; kind: ok,
raised, invalid (and, made by the parent, timeout and crash)."""

DYNAMIC_CODE = "<dynamic-code>"
"""The file name cloudpickle (3.1.3 and later) gives the code of a function it pickles by value (a closure, a lambda,
a function of ``__main__`` or of a test module): the worker's traceback can then not read the source lines."""


class ScoresError(ValueError):
    """A reward function's return value is not one finite real number per completion."""


# ------------------------------------------------------------------------------------- return values
def as_scores(values: Any, *, name: str, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
    """``values`` as one finite float per completion, or a :class:`ScoresError` saying what is wrong. Runs on:
    wherever the reward function ran (the worker holding the samples, or a reward worker process).

    Accepted: any 1-D sequence of real numbers (lists, tuples, numpy arrays, torch tensors), whose elements may
    be Python, numpy or 0-d tensor scalars. Refused: strings, mappings, sets, generators, arrays of another
    dimension, a wrong length, strings or other non-numbers as elements, NaN and infinities."""
    n = len(prompts)
    kind = type(values).__name__
    ndim = getattr(values, "ndim", None)
    if isinstance(ndim, int) and callable(getattr(values, "tolist", None)):  # numpy array, torch tensor
        if ndim != 1:
            shape = tuple(getattr(values, "shape", ()))
            raise ScoresError(
                f"reward function `{name}` returned a {ndim}-D {kind} of shape {shape}; expected a 1-D sequence of "
                f"{n} floats, one per completion. HINT: return `scores.reshape(-1)` if it holds one score per "
                "completion."
            )
        values = values.tolist()
    elif not isinstance(values, Sequence) or isinstance(values, str | bytes | bytearray):
        raise ScoresError(
            f"reward function `{name}` returned {kind}; expected a list of {n} floats, one per completion."
        )
    if len(values) != n:
        raise ScoresError(
            f"reward function `{name}` returned {len(values)} values for {n} completions; "
            "expected exactly one float per completion."
        )
    out = []
    for i, v in enumerate(values):
        f = math.nan
        if not isinstance(v, str | bytes) and hasattr(type(v), "__float__") and getattr(v, "ndim", 0) == 0:
            with contextlib.suppress(TypeError, ValueError, OverflowError):
                f = float(v)
        if not math.isfinite(f):
            raise ScoresError(
                f"reward function `{name}` returned {v!r} for completion {i} "
                f"(prompt {prompts[i]!r}, completion {completions[i]!r}); expected a finite float. "
                "HINT: return 0.0 (or another fallback) for completions you cannot score."
            )
        out.append(f)
    return out


def raised_message(name: str, err: BaseException, prompts: list[str], columns: Mapping[str, Any]) -> str:
    """What a reward function's exception is reported as. Runs on: wherever the function ran."""
    return (
        f"reward function `{name}` raised {type(err).__name__}: {err} "
        f"(called on {len(prompts)} completions; dataset columns passed: {sorted(columns)})"
    )


def tool_result_text(value: Any, *, max_chars: int) -> str:
    """A tool's return value as the text of a ``tool`` message: a string as it is, JSON for numbers, booleans,
    None, lists and dicts, cut to ``max_chars`` characters. Runs on: the tool worker (or the rollout's process for
    an environment's in-process tools).

    Raises TypeError for anything else (an object with no text form the model could read).
    """
    import json

    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"it returned a {type(value).__name__}, which cannot be written into a message ({err}); a tool "
                "returns a string, a number, a boolean, None, or a list/dict of those (images: only a tool that runs "
                "in the rollout's process, an environment with in_process = True, returns PIL images)"
            ) from err
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [{len(text) - max_chars} characters cut]"
    return text


def tool_answer(value: Any, *, max_chars: int) -> tuple[str, str]:
    """``("ok", text)`` for a tool's return value (:func:`tool_result_text`), or ``("invalid", why it has no text
    form)``. Runs on: wherever the tool ran."""
    try:
        return "ok", tool_result_text(value, max_chars=max_chars)
    except TypeError as err:
        return "invalid", str(err)


def awaited(value: Any) -> Any:
    """``value``, or what it gives once awaited when it is awaitable (an ``async def`` reward function's or
    environment's result), run to its end in an event loop of its own. Runs on: whichever process called the function
    (a worker, or the rollout's process when the call runs there)."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


# ----------------------------------------------------------------------------------- the worker side
def _worker_main(fd: int, parent: int) -> None:
    """Main program of a worker: load the function (or tools), then serve calls until the end of input. Runs on: a
    worker process (spawned by ``spawn_worker``)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())  # a mask inherited from the spawning thread
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)  # killed means killed, whatever the trainer ignores or handles
    _die_with_parent(parent)
    os.set_inheritable(fd, False)  # the function's own subprocesses do not hold the pool's socket open
    conn = Connection(fd)
    with contextlib.suppress(EOFError, OSError):  # the pool closed (or the trainer died): exit quietly
        kind, sys_path, fn_bytes, source = pickle.loads(conn.recv_bytes())
        sys.path[:] = sys_path
        if source:  # tracebacks of a function pickled by value quote their lines (cloudpickle names its file so)
            linecache.cache[DYNAMIC_CODE] = (sum(map(len, source)), None, source, DYNAMIC_CODE)
        try:
            fn = pickle.loads(fn_bytes)
        except Exception as err:
            conn.send_bytes(pickle.dumps(("load_error", f"{type(err).__name__}: {err}", traceback.format_exc())))
            return
        conn.send_bytes(pickle.dumps(("ready",)))
        if kind == "async-tool":
            asyncio.run(_serve_coroutines(conn, fn))
            return
        while True:
            request = pickle.loads(conn.recv_bytes())
            result = _call(fn, *request) if kind == "reward" else _call_tool(fn, *request)
            with contextlib.suppress(Exception):  # before sending: the pool may kill this process once it has it
                sys.stdout.flush()
                sys.stderr.flush()
            conn.send_bytes(pickle.dumps(result))


def _call(
    fn: Callable[..., Any], name: str, prompts: list[str], completions: list[str], columns: Mapping[str, Any]
) -> Result:
    """One reward call in a reward worker: the scores, or why there are none."""
    try:
        values = awaited(fn(prompts, completions, **columns))
    except Exception as err:
        tb = traceback.format_exc()
        message = raised_message(name, err, prompts, columns)
        return ("raised", None, f"{message}\n--- traceback of `{name}` (in its reward process) ---\n{tb}", tb)
    try:
        return ("ok", as_scores(values, name=name, prompts=prompts, completions=completions), "", "")
    except ScoresError as err:
        return ("invalid", None, str(err), "")
    except Exception as err:  # a sequence-like object whose len() or tolist() fails
        message = f"reward function `{name}` returned a {type(values).__name__} that cannot be read: {err!r}"
        return ("invalid", None, message, traceback.format_exc())


def _call_tool(
    functions: Mapping[str, Callable[..., Any]], name: str, arguments: dict[str, Any], max_chars: int
) -> Result:
    """One tool call in a tool worker: ``("ok", text)``, or ``raised`` (the tool raised; the message is what the
    model sees) or ``invalid`` (its value has no text form)."""
    try:
        value = functions[name](**arguments)
    except Exception as err:
        return ("raised", None, f"{type(err).__name__}: {err}", traceback.format_exc())
    kind, text = tool_answer(value, max_chars=max_chars)
    return (kind, [] if kind == "ok" else None, text, "")


async def _serve_coroutines(conn: Connection, functions: Mapping[str, Callable[..., Any]]) -> None:
    """Main loop of a worker serving ``async def`` tools: each call, ``(number, name, arguments, max_chars,
    timeout_s)``, runs at once as a task of this event loop (cancelled past ``timeout_s``); its answer, ``(number,
    kind, text)``, goes back as soon as it ends. Runs on: an asynchronous tool worker (one thread reads requests)."""
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue[Any] = asyncio.Queue()

    def read() -> None:  # a thread: Connection.recv_bytes blocks until a whole message is in
        message = None
        with contextlib.suppress(EOFError, OSError, RuntimeError):  # RuntimeError: the loop has ended already
            while (message := pickle.loads(conn.recv_bytes())) is not None:
                loop.call_soon_threadsafe(requests.put_nowait, message)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(requests.put_nowait, None)  # None, or the end of input: the loop ends

    async def one(number: int, name: str, arguments: dict[str, Any], max_chars: int, timeout_s: float) -> None:
        try:
            value = await asyncio.wait_for(functions[name](**arguments), timeout_s)
        except TimeoutError:
            answer = ("timeout", f"timed out after {timeout_s:g} s")
        except (Exception, asyncio.CancelledError) as err:  # a tool may cancel what it awaits, and itself with it
            answer = ("raised", f"{type(err).__name__}: {err}")
        else:
            answer = tool_answer(value, max_chars=max_chars)
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps((number, *answer)))

    threading.Thread(target=read, name="lightning-rlhf-tool-reader", daemon=True).start()
    tasks: set[asyncio.Task[None]] = set()
    while (request := await requests.get()) is not None:
        task = asyncio.create_task(one(*request))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when the trainer (the thread that started it) ends."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the trainer died before prctl took effect
        os._exit(1)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), int(sys.argv[2]))
