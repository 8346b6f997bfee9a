"""``MetricPlots``: PNG curves of the reward, response length, KL and entropy, written into the run folder."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence

import lightning as L
from typing_extensions import override

from lightning_rlhf.callbacks.history import MetricHistory, first_last, run_folder, step_of
from lightning_rlhf.callbacks.summary import REWARD_KEYS

__all__ = ["DEFAULT_PANELS", "MetricPlots", "plot_curve"]

#: file stem -> candidate metrics, the first one logged is plotted (see docs/metrics.md)
DEFAULT_PANELS: dict[str, tuple[str, ...]] = {
    "reward": REWARD_KEYS,
    "response_length": ("response_length/mean",),
    "kl": ("actor/kl_loss", "actor/reward_kl_penalty"),
    "entropy": ("actor/entropy",),
}


def plot_curve(steps: Sequence[int], values: Sequence[float], out_png: str, *, metric: str, title: str) -> None:
    """Plot ``values`` per RL step into ``out_png`` (with a moving average from 20 points on). Runs on: rank 0
    (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, values, lw=1.0, alpha=0.5 if len(values) >= 20 else 1.0, marker="" if len(values) > 1 else "o")
    if len(values) >= 20:
        window = max(2, len(values) // 20)
        ax.plot(steps, _moving_average(values, window), lw=1.8, label=f"moving average ({window} steps)")
        ax.legend(loc="best", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("RL step")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    sums = [0.0, *itertools.accumulate(values)]
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


class MetricPlots(MetricHistory):
    """Write one PNG per panel (``reward.png``, ``response_length.png``, ``kl.png``, ``entropy.png``) into the
    run folder at the end of ``fit``, and every ``every_n_steps`` steps if set; a panel without a logged metric (e.g.
    ``kl`` without a KL term) is skipped. Runs on: every rank; rank 0 records (``trainer.callback_metrics``) and draws.

    Args:
        panels: file stem -> candidate metric names; the first one logged is plotted.
        every_n_steps: also redraw after every n-th step (None: only at the end).
        dirpath: where the PNGs go; None: the run folder (the first logger's ``log_dir``).
    """

    def __init__(
        self,
        panels: Mapping[str, Sequence[str]] | None = None,
        every_n_steps: int | None = None,
        dirpath: str | None = None,
    ) -> None:
        self.panels = {name: tuple(keys) for name, keys in (panels or DEFAULT_PANELS).items()}
        super().__init__([k for keys in self.panels.values() for k in keys])
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"MetricPlots(every_n_steps={every_n_steps}) must be >= 1, or None (only at the end).")
        self.every_n_steps = every_n_steps
        self.dirpath = dirpath
        self.written: dict[str, str] = {}

    def draw(self, folder: str) -> dict[str, str]:
        """Write every panel that has values into ``folder``; returns panel -> PNG path. Runs on: rank 0."""
        os.makedirs(folder, exist_ok=True)
        for name, candidates in self.panels.items():
            key = self.first_present(candidates)
            if key is None:
                continue
            steps, values = self.values(key)
            first, last = first_last(values)
            path = os.path.join(folder, f"{name}.png")
            plot_curve(steps, values, path, metric=key, title=f"{name}: {first:.3g} -> {last:.3g} (first/last 10%)")
            self.written[name] = path
        return dict(self.written)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        """Record the step; redraw every ``every_n_steps``. Runs on: every rank; rank 0 records and draws."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.is_global_zero and self.every_n_steps and (step_of(trainer) + 1) % self.every_n_steps == 0:
            self.draw(self.dirpath or run_folder(trainer))

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Draw the final curves. Runs on: every rank; rank 0 draws."""
        if trainer.is_global_zero:
            self.draw(self.dirpath or run_folder(trainer))
