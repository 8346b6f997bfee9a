"""The single controller: strategy, transfer protocols, and the worker loop."""

from lightning_rlhf.controller.controller import ControllerError, WorkerError
from lightning_rlhf.controller.dispatch import Dispatch, role_method
from lightning_rlhf.controller.liveness import RankDiedError
from lightning_rlhf.strategy.strategy import RLHFStrategy

__all__ = ["ControllerError", "Dispatch", "RLHFStrategy", "RankDiedError", "WorkerError", "role_method"]
