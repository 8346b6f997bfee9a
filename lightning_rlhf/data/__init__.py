"""Prompt datasets and loaders, and supervised (SFT) examples."""

from lightning_rlhf.data.prompts import PromptDataModule, PromptLoader
from lightning_rlhf.data.sft import SFTDataModule

__all__ = ["PromptDataModule", "PromptLoader", "SFTDataModule"]
