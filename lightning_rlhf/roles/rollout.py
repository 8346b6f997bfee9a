"""A generation-only role: rollout engines on a pool of their own, fed the actor's weights over collectives."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import RolloutConfig
from lightning_rlhf.controller.dispatch import Dispatch, role_method
from lightning_rlhf.engines.hybrid import HybridEngine, prompt_ids, rollout_params
from lightning_rlhf.engines.rollout import RolloutEngine
from lightning_rlhf.engines.rollout.bridge import WeightBridge
from lightning_rlhf.engines.stream import RolloutStream
from lightning_rlhf.roles.base import EpisodesMixin, Role, RolloutEngineRequest, load_model

__all__ = ["RolloutRole"]


class RolloutRole(EpisodesMixin, Role):
    """Samples rollouts on ranks that hold no training state: HybridFlow's split of generation from training, and
    the ground of asynchronous rollouts (``AlgorithmConfig.asynchronous.max_staleness``).

    ``RLHFModule`` adds it (as ``module.rollout``) when ``RLHFStrategy(placement=...)`` names a ``rollout`` pool.
    Each of its ranks holds one whole engine (the transformers one) built from the actor's configuration, with no
    weights of its own until the first hand-off: the actor's pool sends them over a process group made at set-up
    (``weights_from``). Each sample carries ``weight_version``, the number of actor updates behind the weights
    that generated it.

    ``path``, ``tokenizer`` and ``rollout`` are the actor's.

    Runs on: the ranks of its pool.
    """

    name = "rollout"
    needs_rollout_engine = True
    weights_from = "actor"
    """The role whose weights this one receives (the strategy joins the two pools with a :class:`WeightBridge`)."""

    def __init__(self, path: str, *, tokenizer: Any, rollout: RolloutConfig) -> None:
        super().__init__(setting="RolloutRole")
        self.path = path
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.hybrid = HybridEngine(rollout=rollout, tokenizer=tokenizer, model_path=path)
        """The engine and the version of the weights it holds (not an nn.Module attribute: stays out of checkpoints)."""
        self.weight_bridge: WeightBridge | None = None
        self._stream: RolloutStream | None = None  # streamed rollouts (AsyncConfig.stream / partial_rollouts)

    @property
    def weight_version(self) -> int:
        """The number of actor updates behind the engine's weights (-1: none received yet)."""
        return self.hybrid.engine_version

    def load(self) -> None:
        """Build the actor's architecture (on the meta device inside the strategy's set-up: the weights arrive by
        hand-off). Runs on: the ranks of the pool."""
        from transformers import AutoModelForCausalLM

        if self.model is None and self.hybrid.engine is None:
            model = load_model(AutoModelForCausalLM, self.path, setting="RolloutRole(path=...)", dtype=torch.float32)
            self.model = model  # held until the engine copies it (not via set_model: no training engine here)

    def rollout_engine_request(self) -> RolloutEngineRequest:
        """The actor's path, tokenizer and sampling settings. Runs on: every process, at set-up."""
        return RolloutEngineRequest(self.path, self.tokenizer, self.rollout)

    def attach_engine(self, engine: RolloutEngine) -> None:
        """Keep the engine and drop the model it was built from (the engine holds the only copy). Runs on: the
        ranks of the pool, at set-up."""
        self.hybrid.engine = engine
        self.model = None

    def shard(self, mesh: DeviceMesh, *, param_dtype: torch.dtype | None) -> None:
        """Nothing to shard: each rank holds a whole engine. Runs on: the ranks of the pool, at set-up."""

    def materialize(self, device: torch.device) -> None:
        """Nothing to load: the weights come from the actor. Runs on: the ranks of the pool, at set-up."""

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (after set-up). Runs on: the ranks of the pool."""
        return self.hybrid.rollout_engine  # type: ignore[no-any-return]

    @role_method(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> dict[str, float]:
        """Take the actor's weights from the bridge (or the source's word that the current ones stay), checked
        against the fingerprints the actor sent (:meth:`HybridEngine.receive
        <lightning_rlhf.engines.hybrid.HybridEngine.receive>`).

        Runs on: every rank of the pool, in the same ``concurrently()`` block as the actor's ``send_weights``.
        """
        if self.weight_bridge is None:
            raise RuntimeError("RolloutRole.receive_weights: no weight bridge (the strategy makes one at set-up).")
        with self._stream_paused() as paused:
            figures = self.hybrid.receive(self.weight_bridge)
        return figures | paused

    @role_method(Dispatch.DP_SPLIT)
    def generate(
        self,
        batch: Batch,
        *,
        n: int | None = None,
        greedy: bool = False,
        temperature: float | None = None,
        seed_offset: int = 0,
    ) -> Batch:
        """``EpisodesMixin.generate`` (validation, a synchronous step), the stream paused meanwhile when there is one
        (the engine serves one caller at a time). Runs on: every rank of the pool, on its share of the prompts."""
        sampling = {"n": n, "greedy": greedy, "temperature": temperature, "seed_offset": seed_offset}
        with self._stream_paused():
            return self.hybrid.generate(batch, episodes=self.episode_runner, **sampling)

    @contextlib.contextmanager
    def _stream_paused(self) -> Iterator[dict[str, float]]:
        """The stream (if any) paused around the block, the engine idle (its running requests interrupted, with
        partial rollouts); resumed with the weights the engine then holds. Yields the pause's wait
        (``timing_s/stream_pause``; nothing without a stream)."""
        if self._stream is None:
            yield {}
            return
        t0 = time.perf_counter()
        self._stream.pause()
        try:
            yield {"timing_s/stream_pause": time.perf_counter() - t0}
        finally:
            self._stream.resume(self.weight_version)

    @role_method(Dispatch.DP_SPLIT)
    def stream(self, batch: Batch, *, take: bool, interrupt: bool, max_staleness: int) -> Batch:
        """Admit ``batch``'s prompts to the pool's stream (:class:`~lightning_rlhf.engines.stream.RolloutStream`, made
        on first use) and, with ``take``, return as many of its oldest complete groups (``rollout.n`` samples each),
        the stream's figures in ``meta["stream"]``; without, an empty batch. ``interrupt``: hand-offs interrupt the
        running requests (partial rollouts). Runs on: every rank of the pool, on its share of the prompts."""
        if self._stream is None:
            if self.weight_version < 0:
                raise RuntimeError("RolloutRole.stream: no weights yet. HINT: RLHFModule.sync_rollout_weights first.")
            self._stream = RolloutStream(
                self.engine,
                interrupt=interrupt,
                max_staleness=max_staleness,
                pad_id=self.tokenizer.pad_token_id,
                episodes=self.episode_runner,
            )
            self._stream.resume(self.weight_version)
        params = rollout_params(batch, self.rollout, self.tokenizer, model_path=self.path)
        self._stream.submit(batch, prompt_ids(batch), params)
        if not take:
            return batch.select([])
        t0 = time.perf_counter()
        rows, figures = self._stream.take(len(batch), version=self.weight_version)
        rows.meta |= {"gen_s": time.perf_counter() - t0, "stream": figures}
        return rows

    def close(self) -> None:
        """End the stream's thread and the environment's tool workers (idempotent). Runs on: every rank of the pool,
        at teardown."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        super().close()
