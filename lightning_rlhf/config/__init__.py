"""Settings, as frozen keyword-only dataclasses validated when they are made (:mod:`.settings`), and model settings
resolved to what ``from_pretrained`` loads (:mod:`.models`, standard library only, imported on its own)."""

from lightning_rlhf.config import settings
from lightning_rlhf.config.settings import *  # noqa: F403

__all__ = settings.__all__
