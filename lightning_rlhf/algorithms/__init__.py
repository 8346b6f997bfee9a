"""Pure tensor functions for RLHF algorithms: advantages, KL estimators, losses, helpers.

Every public name of the submodules is importable from here (their ``__all__``).

Runs on: controller or worker (pure functions, no config objects, no host syncs).
"""

from lightning_rlhf.algorithms import (
    advantages,
    constrained,
    distillation,
    evaluation,
    functional,
    kl,
    losses,
    mismatch,
    registry,
)
from lightning_rlhf.algorithms.advantages import *  # noqa: F403
from lightning_rlhf.algorithms.constrained import *  # noqa: F403
from lightning_rlhf.algorithms.distillation import *  # noqa: F403
from lightning_rlhf.algorithms.evaluation import *  # noqa: F403
from lightning_rlhf.algorithms.functional import *  # noqa: F403
from lightning_rlhf.algorithms.kl import *  # noqa: F403
from lightning_rlhf.algorithms.losses import *  # noqa: F403
from lightning_rlhf.algorithms.mismatch import *  # noqa: F403
from lightning_rlhf.algorithms.registry import *  # noqa: F403

__all__ = sorted(
    {
        *advantages.__all__,
        *constrained.__all__,
        *distillation.__all__,
        *evaluation.__all__,
        *functional.__all__,
        *kl.__all__,
        *losses.__all__,
        *mismatch.__all__,
        *registry.__all__,
    }
)
