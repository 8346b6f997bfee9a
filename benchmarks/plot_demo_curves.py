"""Overlay the reward curves of several demo runs (e.g. float32 vs bfloat16 compute) in one PNG.

    python -m lightning_rlhf.demo --out /tmp/fp32
    python -m lightning_rlhf.demo --out /tmp/bf16 --precision bf16
    python benchmarks/plot_demo_curves.py fp32=/tmp/fp32 bf16=/tmp/bf16 --png docs/img/demo_precision.png

Each ``LABEL=FOLDER`` names a demo run's ``--out`` folder (its newest ``demo/version_*/metrics.csv`` is read). The
plot shows the training reward (``critic/score/mean``, a 10-step moving average) per step; the table printed
gives, per run, the mean reward of the first and last 10 steps, the held-out score before and after, and the
median step time.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import statistics


def read_run(folder: str) -> dict[str, list[float]]:
    """Per metric, its values in step order, from the newest run under ``folder``. Runs on: the caller."""
    files = sorted(glob.glob(os.path.join(folder, "demo", "version_*", "metrics.csv")), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"{folder}: no demo/version_*/metrics.csv. HINT: pass a demo run's --out folder.")
    series: dict[str, list[float]] = {}
    with open(files[-1]) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value not in ("", None) and key != "step":
                    series.setdefault(key, []).append(float(value))
    return series


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values. Runs on: the caller."""
    return [statistics.mean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def main() -> None:
    """Print the table and write the PNG. Runs on: the caller."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="LABEL=FOLDER (the last = splits)")
    p.add_argument("--png", default="docs/img/demo_curves.png")
    p.add_argument("--title", default="Demo task (GRPO, 2 processes): training reward")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    print("| run | reward, first 10 steps | reward, last 10 steps | held-out score before -> after | step s (median) |")
    print("| --- | ---: | ---: | --- | ---: |")
    for spec in args.runs:
        label, _, folder = spec.rpartition("=")
        s = read_run(folder)
        reward, val = s["critic/score/mean"], s.get("val/score/mean", [float("nan")])
        ax.plot(range(1, len(reward) + 1), moving_average(reward, 10), label=label)
        print(
            f"| {label} | {statistics.mean(reward[:10]):.3f} | {statistics.mean(reward[-10:]):.3f} | "
            f"{val[0]:.2f} -> {val[-1]:.2f} | {statistics.median(s['timing_s/step']):.3f} |"
        )
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward (10-step moving average)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
