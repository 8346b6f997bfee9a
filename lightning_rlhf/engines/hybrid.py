"""The hybrid engine: one generating role's rollout engine, its memory phases, its weight hand-offs and its version.

A generating role (the actor; a generation-only rollout pool) keeps one :class:`HybridEngine`: it drives the memory
phases of a colocated rollout, decides how weights reach the engine, verifies every hand-off and counts the policy
versions (docs/hybrid-engine.md). It sits above the rollout engines and the agents, below the roles.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import lightning_rlhf.perf as perf
from lightning_rlhf.agents.rollout import EpisodeRunner, sample_episodes
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import RolloutConfig
from lightning_rlhf.engines.device_layer import WeightStore
from lightning_rlhf.engines.rollout import RolloutEngine, SamplingParams
from lightning_rlhf.engines.rollout.base import (
    KV_CACHE,
    WEIGHTS,
    Fingerprint,
    WeightSyncError,
    as_rows,
    check_fingerprints,
    fingerprint_ranges,
    generation_eos_ids,
    part_sums,
    range_pieces,
)
from lightning_rlhf.engines.rollout.bridge import WeightBridge, WeightHeader, receive_weights, send_weights
from lightning_rlhf.engines.rollout.reshard import Slicer, shard_fingerprints, tp_slicer, weights_for
from lightning_rlhf.engines.train import full_tensors, world
from lightning_rlhf.engines.train.lora import (
    adapter_tensors,
    base_weights,
    has_lora,
    merged_specs,
    merged_weights,
    write_adapter,
)
from lightning_rlhf.engines.train.vision import batch_vision, placeholder_ids

__all__ = ["HybridEngine", "Trainer", "prompt_ids", "rollout_params", "sample_rollout"]


class Trainer(Protocol):
    """The training side a colocated hybrid engine feeds from (the actor role)."""

    model: nn.Module | None
    train_engine: Any
    lora: Any


class HybridEngine:
    """A generating role's rollout engine with its memory phases, weight hand-offs and policy versions.

    Runs on: every rank of the role's pool (each holds its engine, or its share of a TP engine).

    Args:
        model_path: the policy's folder or hub id (its ``generation_config.json`` EOS ids; the adapter's base).
        trainer: the training side it is colocated with (the actor); None for a generation-only pool, whose weights
            come over a bridge (:meth:`receive`).
    """

    def __init__(
        self, *, rollout: RolloutConfig, tokenizer: Any, model_path: str, trainer: Trainer | None = None
    ) -> None:
        self.rollout = rollout
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.trainer = trainer
        self.engine: RolloutEngine | None = None  # attached by the strategy at set-up
        self.weights_version = 0  # bumped whenever the trainer's weights change (mark_changed)
        self.engine_version = 0 if trainer is not None else -1
        """The version the engine holds (a pool's: the number of updates behind it, -1 before the first)."""
        self.sent_version: int | None = None  # the version the generation-only pool holds (None: nothing valid)
        self.wait_s = 0.0  # seconds the last hand-off waited for the other ranks (the shared store's entry barrier)
        self.engine_bytes = 0  # bytes this rank's engine took in the last hand-off (perf/weight_sync_bytes)
        self.verify_s = 0.0  # seconds the last hand-off's check took (perf/weight_verify_s; 0: not checked)
        self._hand_offs = 0
        self._adapter_root: str | None = None
        self._shared: tuple[Any, Any, WeightStore | None] | None = None
        """``(engine, model, store)`` once decided for this engine and model (store None: the hand-off streams)."""

    def mark_changed(self) -> None:
        """The trainer's weights changed: the next rollout hands them over first. Runs on: every rank."""
        self.weights_version += 1

    def generate(self, batch: Batch, *, episodes: EpisodeRunner | None = None, **sampling: Any) -> Batch:
        """Sample ``batch`` (:func:`sample_rollout`'s arguments in ``sampling``): colocated, through the memory
        phases around the hand-off (:meth:`awake`), the hand-off's metrics in the rollout's ``meta``; on a
        generation-only pool, with the weights last received, each sample's ``weight_version`` recording them.

        Runs on: every rank of the role's pool, each on its share of the prompts.
        """
        engine = self.rollout_engine
        pool = self.trainer is None
        if pool and (self.engine_version < 0 or engine.weights_discarded):
            raise RuntimeError(
                "RolloutRole.generate: the engine has no weights yet. HINT: hand the actor's weights over first "
                "(RLHFModule.sync_rollout_weights; RLHFModule.generate_rollout does it)."
            )
        phases: contextlib.AbstractContextManager[dict[str, Any]] = contextlib.nullcontext({}) if pool else self.awake()
        with phases as handoff:
            rollout = sample_rollout(
                engine, batch, self.rollout, self.tokenizer, model_path=self.model_path, episodes=episodes, **sampling
            )
        rollout.meta.update(handoff)
        if pool:
            rollout["weight_version"] = torch.full((len(rollout),), self.engine_version, dtype=torch.long)
        return rollout

    @contextlib.contextmanager
    def awake(self) -> Iterator[dict[str, float]]:
        """The colocated engine awake around the block, in the order that never holds two full copies of the weights
        beside the trainer's shards (docs/hybrid-engine.md, "Memory phases"); after the block the engine sleeps and
        the optimizer state comes back. Yields the hand-off's metrics.

        Runs on: every worker rank of the trainer.
        """
        engine, trainer = self.rollout_engine, self._trainer()
        if engine.offload_optimizer:
            trainer.train_engine.offload_optimizer()
        self.release_device_memory()  # the offloaded state and the update's leftovers, before the weights wake
        engine.wake_up(tags=[WEIGHTS])
        sync_s, sync_bytes = self.sync()
        self.release_device_memory()  # the hand-off's gathered tensors, before the KV cache takes its memory
        engine.wake_up(tags=[KV_CACHE])
        yield {
            "timing_s/update_weights": sync_s,
            "timing_s/update_weights_wait": self.wait_s,
            "perf/weight_sync_bytes": self.engine_bytes,
            "perf/weight_sync_gathered_bytes": sync_bytes,
            "perf/weight_verify_s": self.verify_s,
        }
        engine.sleep()
        trainer.train_engine.onload_optimizer()

    def release_device_memory(self) -> None:
        """Give the device memory the trainer does not need while the engine generates back to the device: FSDP
        units left unsharded (the root, after a forward without backward) are resharded, and on a GPU
        ``empty_cache()`` returns PyTorch's cached blocks, which vLLM's sleep-mode allocator could not otherwise use.
        Runs on: every worker rank (no collective: resharding frees the local copy only)."""
        trainer = self._trainer()
        if trainer.model is None:
            return
        for module in trainer.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        if trainer.train_engine.device.type == "cuda":
            torch.cuda.empty_cache()

    def sync(self) -> tuple[float, int]:
        """Hand the trainer's latest weights to the colocated engine (if they changed, or the engine lost its own),
        then check them when due (:meth:`verify`). The one place that decides how: the LoRA adapters alone
        (``VLLMConfig.lora_handoff="adapter"``); the device layer's shared store (one copy per host); else a stream
        out of the FSDP shards (:func:`~lightning_rlhf.engines.rollout.reshard.weights_for`).

        Runs on: every worker rank (the gathers are collectives). Returns ``(seconds, bytes this rank received from
        the other ranks)``; the seconds leave out the wait at the shared store (:attr:`wait_s`) and the check.
        """
        engine, model = self.rollout_engine, self._trainer().model
        layer = self._trainer().train_engine.layer  # the device layer the strategy chose (the CPU's shared store)
        self.wait_s, self.engine_bytes, self.verify_s = 0.0, 0, 0.0
        if self.engine_version == self.weights_version and not engine.weights_discarded:
            return 0.0, 0
        assert model is not None
        t0 = time.perf_counter()
        received, taken = [0], [0]  # taken: what the engine takes, perf/weight_sync_bytes
        lora = self._trainer().lora is not None
        due = self._due()
        if self._shared is None or self._shared[0] is not engine or self._shared[1] is not model:
            # LoRA streams merged weights (the base's names): no store shares the trainer's own tensors then.
            self._shared = (engine, model, None if lora else layer.weight_store(engine, model))
        store = self._shared[2]
        # LoRA: the fingerprints of what the stream carries, taken on the way only when this hand-off is checked
        expected: dict[str, Fingerprint] | None = {} if lora and due else None
        if lora and engine.abilities.takes_adapters:
            self._hand_off_adapters(engine, model, received, taken, expected)
        elif store is not None:
            self.wait_s = store.hand_off(received)
            taken[0] = perf.full_bytes(model, engine.dtype)
        else:
            stream = weights_for(engine, model, received, into_engine=True, layer=layer)
            if expected is not None:
                stream = _tapped(stream, expected, _slicer(engine, model), engine.tp_rank)
            engine.load_weights(perf.counted_bytes(stream, taken))
        self.engine_bytes = taken[0]
        self.engine_version = self.weights_version
        perf.device_wait()  # the hand-off's device copies count as its own seconds, not the check's
        seconds = time.perf_counter() - t0 - self.wait_s
        if due:
            self.verify(expected)
        return seconds, received[0]

    def _due(self) -> bool:
        """Count a hand-off; whether ``RolloutConfig.verify_every`` has it checked (the first, then every k-th)."""
        every = self.rollout.verify_every
        self._hand_offs += 1
        return bool(every) and (self._hand_offs - 1) % every == 0

    def _hand_off_adapters(
        self,
        engine: Any,
        model: nn.Module,
        received: list[int],
        taken: list[int],
        expected: dict[str, Fingerprint] | None,
    ) -> None:
        """``VLLMConfig.lora_handoff="adapter"``: the base weights once (while the engine holds none), then the
        adapters only, written as a peft folder that the engine loads. ``expected`` (a dict, or None when this
        hand-off is not checked) gets the base weights' fingerprints when they are sent. Runs on: every worker rank
        (the gathers are collectives over the trainer's ranks)."""
        if engine.weights_discarded:
            base = base_weights(full_tensors(model, received, layer=self._trainer().train_engine.layer), engine.dtype)
            if expected is not None:
                base = _tapped(base, expected, None, 0)
            engine.load_weights(perf.counted_bytes(base, taken))
        state = adapter_tensors(model, received)
        taken[0] += sum(t.numel() * t.element_size() for t in state.values())
        if self._adapter_root is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._adapter_root = tempfile.mkdtemp(prefix="lightning_rlhf-adapter-", dir=shm)
            atexit.register(shutil.rmtree, self._adapter_root, True)
        folder = os.path.join(self._adapter_root, f"v{self.weights_version}")
        config = self._trainer().lora.to_dict() | {"base_model_name_or_path": self.model_path}
        write_adapter(folder, config, state)
        engine.load_adapter(folder, self.weights_version)
        for old in os.listdir(self._adapter_root):  # vLLM has read it: the older versions go
            if old != f"v{self.weights_version}":
                shutil.rmtree(os.path.join(self._adapter_root, old), ignore_errors=True)

    def verify(self, expected: dict[str, Fingerprint] | None = None) -> None:
        """Check the hand-off just made (:meth:`sync` calls it when ``RolloutConfig.verify_every`` says it is due):
        the engine's ``fingerprint`` against ``expected`` (of a stream the trainer made: merged LoRA weights), else
        against :func:`~lightning_rlhf.engines.rollout.reshard.shard_fingerprints` of the rows this rank trains.

        Runs on: every worker rank of the trainer (no collective where the model is row-sharded).

        Raises:
            WeightSyncError: naming the first tensor whose weights differ (and the TP rank).
        """
        t0 = time.perf_counter()
        engine = self.rollout_engine
        if expected == {}:
            return  # only adapters were sent
        model = self._trainer().model
        assert model is not None
        slicer = _slicer(engine, model)
        if engine.tp_size > 1 and slicer is None:
            return  # an architecture whose TP slices are not known here: nothing to compare with
        if expected is None:
            expected = shard_fingerprints(
                model, dtype=engine.dtype, slicer=slicer, tp_size=engine.tp_size, tp_rank=engine.tp_rank
            )
        _check(engine, expected, tp_rank=engine.tp_rank)
        self.verify_s = time.perf_counter() - t0

    def send(self, bridge: WeightBridge, *, version: int, lag: int, max_staleness: int) -> dict[str, float]:
        """Hand the trainer's weights to a generation-only pool over ``bridge``, unless the staleness bound allows
        it to keep the ones it has: samples it generates now are trained on ``lag`` updates later, and must then be
        at most ``max_staleness`` updates old. A hand-off that is due to be checked carries the fingerprints of every
        rank's rows in its header (gathered to the source; :meth:`receive` compares).

        Runs on: every rank of the trainer's pool (the FSDP gathers); the pool's first rank broadcasts. Every rank
        decides the same way, from the same counters. Returns the hand-off's metrics.
        """
        from torch import distributed as dist

        trainer = self._trainer()
        model = trainer.model
        assert model is not None
        send = self.sent_version is None or version + lag - self.sent_version > max_staleness
        t0 = time.perf_counter()
        received = [0]
        dtype, layer = trainer.train_engine.param_dtype or torch.float32, trainer.train_engine.layer
        lora = has_lora(model)  # LoRA: the pool's engine takes the merged weights, by the base's names
        check = send and self._due() and not lora
        prints = _gathered(shard_fingerprints(model, dtype=dtype), model, bridge.src) if check else {}
        if lora:
            tensors = merged_weights(model, full_tensors(model, received, layer=layer), dtype) if send else iter(())
        else:
            tensors = full_tensors(model, received, dtype=dtype, layer=layer) if send else iter(())
        if dist.get_rank() == bridge.src:
            named = merged_specs(model) if lora else [(n, tuple(p.shape)) for n, p in model.named_parameters()]
            header = WeightHeader(
                send=send,
                version=version,
                specs=tuple(named) if send else (),
                dtype=str(dtype).removeprefix("torch."),
                fingerprints=prints,
            )
            sent = send_weights(bridge, header, tensors)
        else:
            sent = 0
            for _ in tensors:  # the gathers are collectives over the trainer's pool: every rank takes part
                pass
        if send:
            self.sent_version = version
        return {
            "timing_s/update_weights": time.perf_counter() - t0,
            "perf/weight_sync_bytes": float(sent),
            "perf/weight_sync_gathered_bytes": float(received[0]),
            "rollout/weight_version": float(self.sent_version if self.sent_version is not None else -1),
        }

    def receive(self, bridge: WeightBridge) -> dict[str, float]:
        """Take the trainer's weights from ``bridge`` (or the source's word that the current ones stay) into the
        engine, and check them against the fingerprints the header carries; returns the hand-off's metrics.

        Runs on: every rank of a generation-only pool, in the same ``concurrently()`` block as :meth:`send`.
        """
        engine = self.rollout_engine
        t0 = time.perf_counter()
        header, tensors = receive_weights(bridge, torch.device(engine.device))
        received = engine.load_weights(tensors) if header.send else 0
        self.verify_s = 0.0
        if header.send:
            self.engine_version = header.version
        if header.fingerprints and engine.tp_size == 1:  # the header's are of full tensors, not of TP slices
            perf.device_wait()
            start = time.perf_counter()
            _check(engine, header.fingerprints)
            self.verify_s = time.perf_counter() - start
        return {
            "timing_s/receive_weights": time.perf_counter() - t0,
            "perf/weight_receive_bytes": float(received),
            "perf/weight_verify_s": self.verify_s,
        }

    @property
    def rollout_engine(self) -> Any:
        """The attached engine. Runs on: every rank of the role's pool, after set-up."""
        if self.engine is None:
            raise RuntimeError("The role has no rollout engine yet: the strategy attaches one in setup().")
        return self.engine

    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError("A generation-only pool's hybrid engine has no trainer: its weights come by receive().")
        return self.trainer


def _check(engine: Any, expected: dict[str, Fingerprint], *, tp_rank: int = 0) -> None:
    """:func:`~lightning_rlhf.engines.rollout.base.check_fingerprints` of ``engine`` against ``expected``; a mismatch
    leaves the engine ``weights_discarded`` (it refuses to generate until a complete hand-off). Runs on: worker."""
    held = engine.fingerprint({name: rows for name, (rows, _) in expected.items()})
    try:
        check_fingerprints(type(engine).__name__, expected, held, rtol=engine.fingerprint_rtol, tp_rank=tp_rank)
    except WeightSyncError:
        engine.weights_discarded = True
        raise


def _slicer(engine: Any, model: nn.Module) -> Slicer | None:
    """Which slice of each tensor a tensor-parallel ``engine`` holds (its own ``slicer``, or vLLM's rules where it
    takes full tensors and cuts them itself); None at TP 1, or for an architecture whose rules are not known."""
    return engine.slicer or tp_slicer(model.config, engine.tp_size)


def _tapped(
    stream: Iterator[tuple[str, Tensor]], prints: dict[str, Fingerprint], slicer: Slicer | None, tp_rank: int
) -> Iterator[tuple[str, Tensor]]:
    """``stream`` (full tensors) unchanged, the fingerprint of each (with a ``slicer``: of the slice TP rank ``tp_rank``
    holds) put in ``prints`` as it passes: the trainer's side of a hand-off computed on the way. Runs on: every worker
    rank."""
    for name, tensor in stream:
        region = slicer(name, tuple(tensor.shape), tp_rank) if slicer is not None else None
        held = tensor if region is None else tensor.narrow(region.dim, region.start, region.length)
        rows = as_rows(held.detach())
        ranges = fingerprint_ranges(0, len(rows), one_dim=rows.shape[1] == 1)
        prints[name] = (ranges, part_sums(*range_pieces(rows, ranges), with_scale=True))
        yield name, tensor


def _gathered(prints: dict[str, Fingerprint], model: nn.Module, dst: int) -> dict[str, Fingerprint]:
    """Every rank's :func:`~lightning_rlhf.engines.rollout.reshard.shard_fingerprints` of ``model``, merged on rank
    ``dst`` (together, the fingerprints of the full tensors); ``{}`` elsewhere. Runs on: every rank of the mesh."""
    from torch import distributed as dist

    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is None:
        return prints
    everyone: list[Any] = [None] * mesh.size() if dist.get_rank() == dst else []
    dist.gather_object(prints, everyone if everyone else None, dst=dst, group=mesh.get_group())
    if not everyone:
        return {}
    merged: dict[str, Fingerprint] = {}
    for name in prints:
        parts = [p[name] for p in everyone]  # each rank's (rows, its sums then its scales)
        values = [sums[: len(rows)] for rows, sums in parts]
        scales = [sums[len(rows) :] for rows, sums in parts]
        merged[name] = ([r for rows, _ in parts for r in rows], torch.cat(values + scales))
    return merged


def rollout_params(
    batch: Batch,
    cfg: RolloutConfig,
    tokenizer: Any,
    *,
    n: int | None = None,
    greedy: bool = False,
    temperature: float | None = None,
    seed_offset: int = 0,
    model_path: str | None = None,
) -> SamplingParams:
    """The sampling settings of a rollout of ``batch`` (see :func:`sample_rollout`): its stop ids (EOS, the
    configured ones, the model's ``generation_config.json``'s) and a seed from the step, the rank in the calling role's
    pool, the sampling round and ``seed_offset``. Runs on: a worker rank holding a rollout engine."""
    stops = {tokenizer.eos_token_id, *cfg.stop_token_ids, *(generation_eos_ids(model_path) if model_path else ())}
    if model_path and batch_vision(batch) is not None:  # a sampled image placeholder ends the response
        stops.update(placeholder_ids(model_path))
    stops.discard(None)
    step = int(batch.meta.get("step", 0))
    sampling_round = int(batch.meta.get("sampling_round", 0))
    return SamplingParams(
        n=1 if greedy else (n or cfg.n),
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens,
        min_new_tokens=cfg.min_new_tokens,
        stop_token_ids=tuple(sorted(stops)),
        seed=cfg.seed * 1_000_003 + step * 7919 + world()[0] + sampling_round * 104_729 + seed_offset,
        greedy=greedy,
    )


def prompt_ids(batch: Batch) -> list[list[int]]:
    """Each row's prompt ids, without its padding. Runs on: any process."""
    return [row[m.bool()].tolist() for row, m in zip(batch["prompts"], batch["prompt_mask"], strict=True)]


def sample_rollout(
    engine: RolloutEngine,
    batch: Batch,
    cfg: RolloutConfig,
    tokenizer: Any,
    *,
    n: int | None = None,
    greedy: bool = False,
    temperature: float | None = None,
    seed_offset: int = 0,
    model_path: str | None = None,
    episodes: EpisodeRunner | None = None,
) -> Batch:
    """Sample with ``engine`` for this rank's prompts: one row per sample with ``responses``, ``response_mask``,
    ``response_truncated``, ``rollout_logprobs`` (when the engine reports them) and the input columns repeated.
    ``model_path`` adds its ``generation_config.json``'s EOS ids to the ids that end a response, as transformers'
    ``generate`` and vLLM do. ``episodes``: run multi-turn episodes with the module's environment instead
    (:func:`~lightning_rlhf.agents.rollout.sample_episodes`).

    Runs on: a worker rank holding a rollout engine (the actor's colocated one, or a rollout pool's). The seeds
    depend on the step, the rank in the calling role's pool, the sampling round and ``seed_offset`` only.
    """
    params = rollout_params(
        batch,
        cfg,
        tokenizer,
        n=n,
        greedy=greedy,
        temperature=temperature,
        seed_offset=seed_offset,
        model_path=model_path,
    )
    n, stops = params.n, set(params.stop_token_ids)
    if episodes is not None:  # multi-turn episodes with the module's environment (lightning_rlhf.agents)
        return sample_episodes(engine, batch, episodes, params, n=n, pad_id=tokenizer.pad_token_id)
    prompts = prompt_ids(batch)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params, batch_vision(batch))
    gen_s = time.perf_counter() - t0
    width = max(1, max(len(r) for r in out.responses))
    responses = torch.full((len(out.responses), width), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(out.responses), width), dtype=torch.long)
    for i, r in enumerate(out.responses):
        responses[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, : len(r)] = 1
    rollout = batch.select(torch.arange(len(batch)).repeat_interleave(n))
    rollout["responses"] = responses
    rollout["response_mask"] = response_mask
    rollout["response_truncated"] = torch.tensor([not r or r[-1] not in stops for r in out.responses])
    if out.logprobs is not None:
        lp = torch.zeros((len(out.responses), width))
        for i, row in enumerate(out.logprobs):
            lp[i, : len(row)] = torch.tensor(row)
        rollout["rollout_logprobs"] = lp
    rollout.meta["gen_s"] = gen_s
    rollout.meta["group_size"] = n  # consecutive rows share a prompt: training forwards may compute it once
    return rollout
