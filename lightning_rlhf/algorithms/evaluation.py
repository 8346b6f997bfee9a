"""Validation metrics over N samples per prompt: mean@N and the unbiased pass@k (Chen et al., 2021, "Evaluating
Large Language Models Trained on Code", arXiv 2107.03374).

Runs on: any process (pure functions; the controller calls them on a validation batch's scores).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mean_at_n", "pass_at_k"]


def mean_at_n(scores: Tensor) -> Tensor:
    """``[P]`` float32 mean score of each prompt's N samples (``scores`` ``[P, N]``)."""
    return scores.float().mean(-1)


def pass_at_k(passed: Tensor, *, k: int) -> Tensor:
    """Unbiased estimate, per prompt, of the chance that at least one of k samples drawn (without replacement)
    from its N passes: ``1 - C(N - c, k) / C(N, k)`` with c passing samples, computed as Chen et al.'s stable
    product ``1 - prod_{i = N-c+1}^{N} (1 - k / i)`` (exactly 1 when ``N - c < k``). ``passed``: ``[P, N]`` bool;
    returns ``[P]`` float32 (``k=1``: the share of passing samples).

    Raises:
        ValueError: If ``k`` is not in ``1..N``.
    """
    n = passed.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in 1..N={n} (samples per prompt).")
    c = passed.long().sum(-1, keepdim=True)  # [P, 1]
    i = torch.arange(1, n + 1, device=passed.device, dtype=torch.float64)  # [N]
    factors = torch.where(i > n - c, 1.0 - k / i, torch.ones_like(i))  # [P, N]: the product's terms, else 1
    return (1.0 - factors.prod(-1)).float()
