"""The weight hand-off check's share of the step, read from run folders' metrics.csv (issue 44: under 2%).

Usage: python benchmarks/verify_share.py RUN/metrics.csv [...]. Prints, per file: steps, the median seconds of the
check (``perf/weight_verify_s``) and of the step (``timing_s/step``), the check's share of the step, the engine/trainer
log-prob agreement (``training/rollout_logprob_diff_*``) and the score of the first and last 10% of steps."""

from __future__ import annotations

import csv
import statistics
import sys

from lightning_rlhf.callbacks.history import first_last


def summary(path: str) -> str:
    """One line about the run whose metrics are at ``path``."""
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("timing_s/step")]
    if not rows:
        return f"{path}: no steps"

    def col(name: str) -> list[float]:
        return [float(r[name]) for r in rows if r.get(name)]

    verify, step = statistics.median(col("perf/weight_verify_s")), statistics.median(col("timing_s/step"))
    first, last = first_last(col("critic/score/mean"))
    return (
        f"{path}: {len(rows)} steps, check {verify * 1e3:.2f} ms of a {step * 1e3:.1f} ms step ({verify / step:.1%}); "
        f"log-prob diff mean {max(col('training/rollout_logprob_diff_mean')):.2e} (worst step), "
        f"max {max(col('training/rollout_logprob_diff_max')):.2e}; "
        f"score {first:.3f} -> {last:.3f}"
    )


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(summary(arg))
