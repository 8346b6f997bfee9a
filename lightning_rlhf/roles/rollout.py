"""A generation-only role: rollout engines on a pool of their own, fed the actor's weights over collectives."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import RolloutConfig
from lightning_rlhf.controller.dispatch import Dispatch, role_method
from lightning_rlhf.engines.rollout import RolloutEngine
from lightning_rlhf.engines.rollout.bridge import WeightBridge, receive_weights
from lightning_rlhf.roles.actor import sample_rollout
from lightning_rlhf.roles.base import EpisodesMixin, Role, RolloutEngineRequest, load_model

__all__ = ["RolloutRole"]


class RolloutRole(EpisodesMixin, Role):
    """Samples rollouts on ranks that hold no training state: HybridFlow's split of generation from training, and
    the ground of asynchronous rollouts (``AlgorithmConfig.max_staleness``).

    ``RLHFModule`` adds it (as ``module.rollout``) when ``RLHFStrategy(placement=...)`` names a ``rollout`` pool.
    Each of its ranks holds one whole engine (the transformers one) built from the actor's configuration, with no
    weights of its own until the first hand-off: the actor's pool sends them over a process group made at set-up
    (``weights_from``). Each sample carries ``weight_version``, the number of actor updates behind the weights
    that generated it.

    Runs on: the ranks of its pool.

    Args:
        path: the actor's folder or hub id (its configuration; its weights come from the actor).
        tokenizer: the actor's tokenizer.
        rollout: the sampling settings (the actor's).
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
        self._engine: RolloutEngine | None = None  # not an nn.Module attribute: stays out of checkpoints
        self.weight_bridge: WeightBridge | None = None
        self.weight_version = -1
        """The number of actor updates behind the engine's weights (-1: none received yet)."""

    def load(self) -> None:
        """Build the actor's architecture (on the meta device inside the strategy's set-up: the weights arrive by
        hand-off). Runs on: the ranks of the pool."""
        from transformers import AutoModelForCausalLM

        if self.model is None and self._engine is None:
            model = load_model(AutoModelForCausalLM, self.path, setting="RolloutRole(path=...)", dtype=torch.float32)
            self.model = model  # held until the engine copies it (not via set_model: no training engine here)

    def rollout_engine_request(self) -> RolloutEngineRequest:
        """The actor's path, tokenizer and sampling settings. Runs on: every process, at set-up."""
        return RolloutEngineRequest(self.path, self.tokenizer, self.rollout)

    def attach_engine(self, engine: RolloutEngine) -> None:
        """Keep the engine and drop the model it was built from (the engine holds the only copy). Runs on: the
        ranks of the pool, at set-up."""
        self._engine = engine
        self.model = None

    def shard(self, mesh: DeviceMesh, *, param_dtype: torch.dtype | None) -> None:
        """Nothing to shard: each rank holds a whole engine. Runs on: the ranks of the pool, at set-up."""

    def materialize(self, device: torch.device) -> None:
        """Nothing to load: the weights come from the actor. Runs on: the ranks of the pool, at set-up."""

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (after set-up). Runs on: the ranks of the pool."""
        if self._engine is None:
            raise RuntimeError("RolloutRole has no engine yet: the strategy attaches one in setup().")
        return self._engine

    @role_method(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> dict[str, float]:
        """Take the actor's weights from the bridge (or the source's word that the current ones stay).

        Runs on: every rank of the pool, in the same ``concurrently()`` block as the actor's ``send_weights``.
        """
        if self.weight_bridge is None:
            raise RuntimeError("RolloutRole.receive_weights: no weight bridge (the strategy makes one at set-up).")
        t0 = time.perf_counter()
        header, tensors = receive_weights(self.weight_bridge, self.engine_device)
        received = self.engine.load_weights(tensors) if header.send else 0
        if header.send:
            self.weight_version = header.version
        return {"timing_s/receive_weights": time.perf_counter() - t0, "perf/weight_receive_bytes": float(received)}

    @property
    def engine_device(self) -> torch.device:
        """Where the engine computes. Runs on: the ranks of the pool."""
        return torch.device(getattr(self.engine, "device", "cpu"))

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
        """Sample like :meth:`ActorRole.generate`, with the weights last received; each sample's
        ``weight_version`` records them.

        Runs on: every rank of the pool, each on its share of the prompts. The engine stays on its device (nothing
        else on these ranks needs the memory).
        """
        if self.weight_version < 0 or self.engine.weights_discarded:
            raise RuntimeError(
                "RolloutRole.generate: the engine has no weights yet. HINT: hand the actor's weights over first "
                "(RLHFModule.sync_rollout_weights; RLHFModule.generate_rollout does it)."
            )
        rollout = sample_rollout(
            self.engine,
            batch,
            self.rollout,
            self.tokenizer,
            n=n,
            greedy=greedy,
            temperature=temperature,
            seed_offset=seed_offset,
            model_path=self.path,
            episodes=self.episode_runner,
        )
        rollout["weight_version"] = torch.full((len(rollout),), self.weight_version, dtype=torch.long)
        return rollout
