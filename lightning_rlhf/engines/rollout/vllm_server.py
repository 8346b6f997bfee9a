"""A vLLM engine in a process of its own: vLLM for a role on part of the ranks (a ``rollout`` pool, a placed actor).

The colocated engine's external launcher builds vLLM's groups over every rank of the world, so a role on part of
the ranks gets an **engine server** per rank instead (docs/hybrid-engine.md, "vLLM on part of the ranks"): a new
interpreter holding a ``VLLMRolloutEngine``, reached over an authenticated Unix socket, its weights crossing in a
mapped file one chunk at a time. It exits when its client closes the socket, when the trainer dies (Linux:
``PR_SET_PDEATHSIG``), or on ``close()``; one that dies surfaces as :class:`EngineServerError` with its log's tail.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_rlhf.config import VLLMConfig
from lightning_rlhf.data.vision import VisionInputs
from lightning_rlhf.engines.rollout.base import (
    EngineAbilities,
    RolloutOutput,
    RowRanges,
    SamplingParams,
    WeightSyncError,
)
from lightning_rlhf.engines.rollout.requests import BatchedRequestQueue, Completion, Request, RequestQueue
from lightning_rlhf.engines.rollout.vllm_requests import ServerRequestQueue

__all__ = ["EngineServerError", "VLLMServerEngine"]

_PARENT_ENV = "LIGHTNING_RLHF_ENGINE_PARENT"
_ADDRESS_ENV = "LIGHTNING_RLHF_ENGINE_SERVER"
_KEY_ENV = "LIGHTNING_RLHF_ENGINE_KEY"
_DROP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "NODE_RANK", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")  # fmt: skip
"""The trainer's process-group variables: a server has no part in the trainer's world."""
_ALIGN = 64
_RAISED_AS_IS = {"WeightSyncError": WeightSyncError, "ValueError": ValueError, "TypeError": TypeError}


class EngineServerError(RuntimeError):
    """A vLLM engine server failed to start, died, or raised: the message holds its traceback or its log's tail."""


def _log_tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


class VLLMServerEngine:
    """The client of one engine server: a :class:`~lightning_rlhf.engines.rollout.base.RolloutEngine` whose vLLM
    engine (built from ``model_path`` and ``engine_kwargs``, the ``VLLMRolloutEngine`` arguments) runs in a process of
    its own. ``pool_group`` (None: a pool of one rank) and ``pool_rank``: the role's pool and this rank's index in it;
    ``start_timeout_s``: how long the server may take to build its engine. Runs on: every rank of the role's pool
    (all together: at TP > 1 they exchange the servers' rendezvous)."""

    def __init__(
        self,
        model_path: str,
        *,
        engine_kwargs: dict[str, Any],
        pool_group: Any = None,
        pool_rank: int = 0,
        start_timeout_s: float = 900.0,
    ) -> None:
        config: VLLMConfig = engine_kwargs["config"]
        self.device: torch.device = engine_kwargs["device"]
        self.dtype: torch.dtype = engine_kwargs["dtype"]
        self.tp_size: int = config.tensor_parallel_size
        self.context_length: int = engine_kwargs["max_model_len"]
        self.requests: RequestQueue = ServerRequestQueue(self) if self.tp_size == 1 else BatchedRequestQueue(self)
        self.slicer = None  # full tensors: each server's vLLM loaders keep their own TP slices
        tied = engine_kwargs.get("tied_names") or {}
        self.param_names: list[str] = [n for n in engine_kwargs["param_names"] if n not in tied]
        self.offload_optimizer = bool(config.offload_optimizer and self.device.type == "cuda")
        self.bucket_bytes = max(1, int(config.weight_bucket_mb * (1 << 20)))
        self._discarded = True
        self.tp_rank = pool_rank % self.tp_size  # the pool's ranks, not the world's, make the TP groups
        self._folder = Path(tempfile.mkdtemp(prefix="lightning_rlhf_vllm_"))
        self.log_path = self._folder / "server.log"
        address = str(self._folder / "socket")
        key = secrets.token_bytes(32)
        env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
        env |= {_ADDRESS_ENV: address, _KEY_ENV: key.hex(), _PARENT_ENV: str(os.getpid())}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        device_ids = self._gather(self.device.index if self.device.type == "cuda" else None, pool_group)
        if self.device.type == "cuda":  # the server sees its TP group's devices, its own as LOCAL_RANK
            first = pool_rank - self.tp_rank
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in device_ids[first : first + self.tp_size])
            engine_kwargs = engine_kwargs | {"device": torch.device("cuda", self.tp_rank)}
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "lightning_rlhf.engines.rollout.vllm_server"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._conn: Connection | None = None
        self._buffer: Tensor | None = None  # the shared bytes the server has mapped
        self._held: dict[str, Any] = {"conn": None}
        self._closer = weakref.finalize(self, _shut_down, self._proc, self._held, self._folder)
        try:
            self._conn = self._held["conn"] = self._connect(address, key, start_timeout_s)
            self._send(("init", model_path, engine_kwargs, self.tp_rank, self.tp_size, torch.get_num_threads()))
            if self.tp_size > 1:  # the first server of each TP group hosts the group's store; the others join it
                port = self._receive(start_timeout_s) if self.tp_rank == 0 else None
                ports = self._gather(port, pool_group)
                self._send(("store", ports[pool_rank - self.tp_rank]))
            self.fingerprint_rtol: float = self._receive(start_timeout_s)  # the engine is built; its tolerance
        except BaseException:
            self._closer()
            raise

    # ------------------------------------------------------------------------------------ plumbing
    @staticmethod
    def _gather(value: Any, group: Any) -> list[Any]:
        """Every pool rank's ``value`` in pool order (one rank: its own)."""
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return [value]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, value, group=group)
        return out

    def _connect(self, address: str, key: bytes, timeout_s: float) -> Connection:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive("while starting")
            try:
                return Client(address, family="AF_UNIX", authkey=key)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise self._failure(f"did not connect within {timeout_s:.0f} s") from None
                time.sleep(0.05)

    def _check_alive(self, when: str) -> None:
        code = self._proc.poll()
        if code is not None:
            raise self._failure(f"exited with code {code} {when}")

    def _failure(self, what: str) -> EngineServerError:
        return EngineServerError(
            f"The vLLM engine server (pid {self._proc.pid}) {what}. Its log ({self.log_path}) ends with:\n"
            f"{_log_tail(self.log_path)}\nHINT: the log names vLLM's own error; RLHFStrategy(rollout='hf') "
            "generates with transformers instead."
        )

    def _send(self, message: tuple[Any, ...]) -> None:
        assert self._conn is not None
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._check_alive(f"before {message[0]!r}")
            raise

    def _receive(self, timeout_s: float | None = None) -> Any:
        """The server's next reply; raises its exception, or :class:`EngineServerError` if it died."""
        assert self._conn is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            self._check_alive("while serving a request")
            if deadline is not None and time.monotonic() > deadline:
                raise self._failure(f"did not answer within {timeout_s:.0f} s")
        try:
            reply = self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            time.sleep(0.5)  # let the exit code arrive
            self._check_alive("while serving a request")
            raise self._failure("closed its socket") from None
        kind, value, discarded = reply
        self._discarded = discarded
        if kind == "error":
            type_name, message, trace = value
            raised = _RAISED_AS_IS.get(type_name, EngineServerError)
            raise raised(f"{message}\n(in the vLLM engine server, pid {self._proc.pid}:)\n{trace}")
        return value

    @property
    def weights_discarded(self) -> bool:
        """Whether the server's engine holds no valid weights (as its last reply said). Runs on: every rank of the
        pool."""
        return self._discarded

    @weights_discarded.setter
    def weights_discarded(self, value: bool) -> None:
        """Set by the caller (a failed fingerprint check): True is passed on, so that the server's engine refuses to
        generate until a complete hand-off, as a colocated engine does. Runs on: every rank of the pool."""
        if value and not self._discarded:
            self._call("discard")
        self._discarded = value

    def _call(self, op: str, *args: Any) -> Any:
        self._send((op, *args))
        return self._receive()

    # ------------------------------------------------------------------------------------- engine
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, vision: Sequence[VisionInputs | None] | None = None
    ) -> RolloutOutput:
        """Sample ``params.n`` responses per prompt in the server (see ``VLLMRolloutEngine.generate``; the images
        cross the pipe as pickled PIL images, without the processor's tensors: vLLM makes its own). Runs on: every
        rank of the pool together (the servers of a TP group gather their prompts)."""
        images = None if vision is None else [None if v is None else list(v.images) for v in vision]
        return self._call("generate", prompts, params, images)  # type: ignore[no-any-return]

    @property
    def abilities(self) -> EngineAbilities:
        """Each weight is copied into shared memory as it arrives; adapters are not forwarded. At TP 1 requests join
        the server's running ones at each scheduling step and can be interrupted
        (:class:`~lightning_rlhf.engines.rollout.vllm_requests.ServerRequestQueue`); a TP group serves them in rounds
        of ``generate`` calls (:class:`~lightning_rlhf.engines.rollout.requests.BatchedRequestQueue`). Runs on: the
        pool."""
        return EngineAbilities(copies_each_weight=True, interrupts=self.tp_size == 1)

    def step_requests(self, new: list[Request], aborts: list[str], interrupt: bool, most: int) -> list[Completion]:
        """Up to ``most`` scheduling steps of the server's request queue (``ServerRequestQueue``'s round trip). Runs on:
        the rollout's process (TP 1). A request's images cross as PIL images (the server's vLLM runs its own
        processor on them; a tensor would cross as a handle to shared memory)."""
        new = [
            r if r.vision is None else dataclasses.replace(r, vision=VisionInputs.of_images(r.vision.images))
            for r in new
        ]
        return self._call("requests", new, aborts, interrupt, most)  # type: ignore[no-any-return]

    def agree(self, calls: int, busy: bool) -> tuple[int, bool]:
        """``RolloutEngine.agree``, by the servers of the TP group (one rank: its own). Runs on: every rank of the
        pool's TP group together."""
        return self._call("agree", calls, busy) if self.tp_size > 1 else (calls, busy)  # type: ignore[no-any-return]

    def fingerprint(self, ranges: Mapping[str, RowRanges]) -> dict[str, Tensor]:
        """The server's engine's ``fingerprint`` (``VLLMRolloutEngine.fingerprint``: at TP > 1 of its slice), its sums
        crossing the socket as numbers. Runs on: every rank of the pool (no collective)."""
        sums: dict[str, list[float]] = self._call("fingerprint", dict(ranges))
        return {name: torch.tensor(values, dtype=torch.float64) for name, values in sums.items()}

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """Stream a complete hand-off to the server through shared memory; returns the bytes handed in. Runs on:
        every rank of the pool. Raises :class:`WeightSyncError` (the server's check: an unknown, repeated or missing
        name), and leaves ``weights_discarded`` True, as the colocated engine does."""
        self._discarded = True
        self._send(("load_begin",))
        specs: list[tuple[str, str, tuple[int, ...], int]] = []
        used = 0
        try:
            for name, tensor in weights:
                t = tensor.detach().to(self.dtype)
                nbytes = t.numel() * t.element_size()
                if specs and used + nbytes > (0 if self._buffer is None else self._buffer.numel()):
                    self._call("chunk", specs)
                    specs, used = [], 0
                buffer = self._ensure(nbytes)
                buffer[used : used + nbytes].view(t.dtype).view(t.shape).copy_(t)
                specs.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), used))
                used += -(-nbytes // _ALIGN) * _ALIGN
            if specs:
                self._call("chunk", specs)
        except BaseException:  # the stream failed on this side: end the server's stream, drop its reply
            with contextlib.suppress(Exception):
                self._call("load_end")
            self._discarded = True
            raise
        return self._call("load_end")  # type: ignore[no-any-return]

    def _ensure(self, nbytes: int) -> Tensor:
        """The shared buffer, (re)made to hold at least ``nbytes``; the server maps it before the file goes."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            size = max(self.bucket_bytes, -(-nbytes // _ALIGN) * _ALIGN)
            path = Path(_shared_folder()) / f"lightning_rlhf_{os.getpid()}_{secrets.token_hex(6)}"
            buffer = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
            try:
                self._call("map", str(path), size)
            finally:
                path.unlink(missing_ok=True)  # both sides map it: nothing left behind if either dies
            self._buffer = buffer
        return self._buffer

    def sleep(self, *args: Any, **kwargs: Any) -> None:
        """Put the server's engine to sleep (what the colocated engine's ``sleep`` does). Runs on: the pool."""
        self._call("sleep", args, kwargs)

    def wake_up(self, *args: Any, **kwargs: Any) -> None:
        """Wake the server's engine (what the colocated engine's ``wake_up`` does). Runs on: the pool."""
        self._call("wake_up", args, kwargs)

    def close(self) -> None:
        """Stop the server and remove its folder. Runs on: the rank that started it."""
        self._closer()


def _shared_folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _shut_down(proc: subprocess.Popen[bytes], held: dict[str, Any], folder: Path) -> None:
    """Ask the server to exit, then make sure it did; remove its folder."""
    conn = held.get("conn")
    if conn is not None:
        with contextlib.suppress(Exception):
            conn.send(("close",))
        with contextlib.suppress(Exception):
            conn.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------- server side
def _die_with_parent() -> None:
    """Linux: get SIGKILL when the process that started this one dies (a killed trainer leaves no server); exit at
    once if it died before this line ran."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(os.environ.pop(_PARENT_ENV, os.getppid())):
        os._exit(1)


class _Server:
    """The server's side: one engine, one client, requests answered in order."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.engine: Any = None
        self.buffer = torch.empty(0, dtype=torch.uint8)  # the shared bytes of the current hand-off chunks

    def reply(self, kind: str, value: Any) -> None:
        discarded = True if self.engine is None else bool(self.engine.weights_discarded)
        self.conn.send((kind, value, discarded))

    def error(self, exc: BaseException) -> None:
        self.reply("error", (type(exc).__name__, str(exc), traceback.format_exc()))

    def start(self, message: tuple[Any, ...]) -> None:
        _, model_path, kwargs, tp_rank, tp_size, threads = message
        torch.set_num_threads(max(1, int(threads)))
        if tp_size > 1:
            store = None
            if tp_rank == 0:
                store = dist.TCPStore("127.0.0.1", 0, world_size=tp_size, is_master=True, wait_for_workers=False)
                self.reply("ok", store.port)
            op, port = self.conn.recv()
            assert op == "store", op
            if store is None:
                store = dist.TCPStore("127.0.0.1", int(port), world_size=tp_size, is_master=False)
            dist.init_process_group("gloo", store=store, rank=tp_rank, world_size=tp_size)
        from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine

        self.engine = VLLMRolloutEngine(model_path, **kwargs)
        self.reply("ok", self.engine.fingerprint_rtol)

    def stream(self) -> Iterator[tuple[str, Tensor]]:
        """The hand-off's tensors, chunk by chunk, each copied out of shared memory before the chunk is acknowledged
        (the client then reuses the buffer)."""
        while True:
            message = self.conn.recv()
            if message[0] == "load_end":
                return
            if message[0] == "map":
                self.map(message)
                continue
            assert message[0] == "chunk", message[0]
            tensors = []
            for name, dtype, shape, offset in message[1]:
                kind = getattr(torch, dtype)
                raw = self.buffer[offset : offset + int(torch.Size(shape).numel()) * kind.itemsize]
                tensors.append((name, raw.view(kind).view(shape).clone()))
            self.reply("ok", None)
            yield from tensors

    def map(self, message: tuple[Any, ...]) -> None:
        _, path, size = message
        self.buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.reply("ok", None)

    def load(self) -> None:
        stream = self.stream()
        try:
            handed = self.engine.load_weights(stream)
        except Exception as exc:  # reported to the client after the stream is drained
            for _ in stream:  # keep the protocol in step: acknowledge the chunks still coming, up to load_end
                pass
            self.error(exc)
            return
        for _ in stream:  # a well-formed hand-off ends here; a longer one was refused by the engine's check
            pass
        self.reply("ok", handed)

    def step_requests(self, new: list[Any], aborts: list[str], interrupt: bool, most: int) -> list[Any]:
        """Up to ``most`` steps of the engine's request queue for the client's ``ServerRequestQueue`` (fewer when none
        is left running)."""
        queue = self.engine.requests
        queue.abort(aborts)
        queue.add(new)
        if interrupt:
            queue.interrupt()
        ended: list[Any] = []
        for _ in range(max(1, most)):
            queue.step(ended.append, True)
            if not queue.pending():
                break
        return ended

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, ConnectionResetError, OSError):
                return  # the client is gone
            op = message[0]
            if op == "close":
                return
            try:
                if op == "init":
                    self.start(message)
                elif op == "generate":
                    prompts, params, images = message[1:]
                    vision = (
                        None if images is None else [None if i is None else VisionInputs.of_images(i) for i in images]
                    )
                    self.reply("ok", self.engine.generate(prompts, params, vision))
                elif op == "requests":
                    self.reply("ok", self.step_requests(*message[1:]))
                elif op == "load_begin":
                    self.load()
                elif op == "agree":
                    self.reply("ok", self.engine.agree(*message[1:]))
                elif op == "discard":
                    self.engine.weights_discarded = True
                    self.reply("ok", None)
                elif op == "fingerprint":  # plain numbers: a tensor would cross as a handle to shared memory
                    sums = self.engine.fingerprint(*message[1:])
                    self.reply("ok", {name: values.tolist() for name, values in sums.items()})
                elif op == "sleep":
                    args, kwargs = message[1:]
                    self.reply("ok", self.engine.sleep(*args, **kwargs))
                elif op == "wake_up":
                    args, kwargs = message[1:]
                    self.reply("ok", self.engine.wake_up(*args, **kwargs))
                else:
                    raise ValueError(f"unknown request {op!r}")
            except Exception as exc:  # every failure goes back to the client with its traceback
                self.error(exc)
                if op == "init":
                    return


def main() -> None:
    """The server process. Runs on: a process of its own, started by :class:`VLLMServerEngine`."""
    _die_with_parent()
    address, key = os.environ.pop(_ADDRESS_ENV), bytes.fromhex(os.environ.pop(_KEY_ENV))
    with Listener(address, family="AF_UNIX", authkey=key) as listener, listener.accept() as conn:
        server = _Server(conn)
        try:
            server.serve()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    main()
