"""Prompt datasets and loaders."""

from lightning_rlhf.data.prompts import PromptDataModule, PromptLoader

__all__ = ["PromptDataModule", "PromptLoader"]
