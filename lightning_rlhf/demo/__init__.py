"""Embedded demo job: a tiny local causal LM that learns single-digit addition by RL on CPU.

The names below load on first use (PEP 562): importing a light part of the demo (the task's reward, the
``calculator`` tool) in a reward or tool worker does not import torch and transformers with the warm start."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_rlhf.lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_rlhf.demo.task import addition_cost, addition_dataset, addition_reward
    from lightning_rlhf.demo.tiny import build_tiny_classifier, build_tiny_model, build_tiny_tokenizer, save_tiny
    from lightning_rlhf.demo.warmstart import greedy_accuracy, prepare_demo_model, sampled_accuracy, warm_start

__all__ = [
    "addition_cost",
    "addition_dataset",
    "addition_reward",
    "build_tiny_classifier",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "greedy_accuracy",
    "prepare_demo_model",
    "sampled_accuracy",
    "save_tiny",
    "warm_start",
]

__getattr__, __dir__ = lazy_exports(__name__, __file__)
