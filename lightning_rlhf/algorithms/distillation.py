"""On-policy distillation's signal: the per-token reverse KL between the student that sampled a response and a frozen
teacher, estimated on the sampled token (Agarwal et al., 2024, "On-Policy Distillation of Language Models"; Lu and
Thinking Machines Lab, 2025, "On-Policy Distillation").

Runs on: controller or worker (pure functions).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_rlhf.algorithms.functional import masked_mean

__all__ = ["reverse_kl_advantages"]


def reverse_kl_advantages(student: Tensor, teacher: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token advantages ``A_t = log pi_teacher(y_t) - log pi_student(y_t)`` on the sampled tokens (``mask``), 0
    elsewhere, and ``{"reverse_kl": ...}``, their negated mean: the single-sample estimate of ``KL(student ||
    teacher)`` per token. ``student``, ``teacher``: ``[B, R]`` log-probs of the sampled tokens (the student's as it
    sampled them). With a policy-gradient loss each token is pushed toward what the teacher would sample there, and
    only that token's own term counts (no reward-to-go: the discount is 0, as the references use).

    Runs on: controller or worker (pure function).
    """
    with torch.no_grad():
        keep = mask.bool()
        gap = teacher.to(torch.float32) - student.to(torch.float32)
        advantages = torch.where(keep, gap, torch.zeros_like(gap))
        return advantages, {"reverse_kl": -masked_mean(gap, keep)}
