"""Embedded demo job: a tiny local causal LM that learns single-digit addition by RL on CPU."""

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
