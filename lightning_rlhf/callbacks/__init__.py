"""What a user sees while a run trains: the progress bar, a summary at the end, metric plots, sample rollouts, with
any logger or none (docs/quickstart.md). Their files go into the run folder, written on rank 0."""

from lightning_rlhf.callbacks.export import ExportActor
from lightning_rlhf.callbacks.history import MetricHistory, run_folder
from lightning_rlhf.callbacks.plots import MetricPlots
from lightning_rlhf.callbacks.progress import RLHFProgressBar
from lightning_rlhf.callbacks.samples import RolloutSamples
from lightning_rlhf.callbacks.summary import RunSummary

__all__ = [
    "ExportActor",
    "MetricHistory",
    "MetricPlots",
    "RLHFProgressBar",
    "RolloutSamples",
    "RunSummary",
    "run_folder",
]
