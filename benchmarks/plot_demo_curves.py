"""Overlay the reward curves of several demo runs (e.g. float32 vs bfloat16 compute) in one PNG.

    python -m lightning_rlhf.demo --out /tmp/fp32
    python -m lightning_rlhf.demo --out /tmp/bf16 --precision bf16
    python benchmarks/plot_demo_curves.py fp32=/tmp/fp32 bf16=/tmp/bf16 --png docs/img/demo_precision.png

Each ``LABEL=FOLDER`` names a demo run's ``--out`` folder (its newest ``demo/version_*/metrics.csv`` is read). The
plot shows the training reward (``critic/score/mean``, a 10-step moving average) per step, or with ``--x wall`` over
the training's wall time (the sum of ``timing_s/step`` up to each step: synchronous against asynchronous rollouts);
the table printed gives, per run, the mean reward of the first and last 10 steps, the held-out score before and
after, the median step time and the total training time.

    python -m lightning_rlhf.demo --placement rollout --steps 120 --out /tmp/sync
    python -m lightning_rlhf.demo --placement rollout --max-staleness 1 --steps 120 --out /tmp/async
    python benchmarks/plot_demo_curves.py sync=/tmp/sync async=/tmp/async --x wall --png docs/img/async_rollouts.png
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import statistics


def read_run(folder: str) -> dict[str, list[float]]:
    """Per metric, its values in step order, from the newest run under ``folder``; ``wall_s``: the training time
    (sum of ``timing_s/step``) at each step that logged a reward. Runs on: the caller."""
    files = sorted(glob.glob(os.path.join(folder, "demo", "version_*", "metrics.csv")), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"{folder}: no demo/version_*/metrics.csv. HINT: pass a demo run's --out folder.")
    series: dict[str, list[float]] = {}
    clock = 0.0
    with open(files[-1]) as f:
        for row in csv.DictReader(f):
            clock += float(row.get("timing_s/step") or 0.0)
            if row.get("critic/score/mean"):
                series.setdefault("wall_s", []).append(clock)
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
    p.add_argument("--x", choices=["step", "wall"], default="step", help="x axis: RL step or training wall time")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    print(
        "| run | reward, first 10 steps | reward, last 10 steps | held-out score before -> after | step s (median) "
        "| training s |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for spec in args.runs:
        label, _, folder = spec.rpartition("=")
        s = read_run(folder)
        reward, val = s["critic/score/mean"], s.get("val/score/mean", [float("nan")])
        xs = s["wall_s"] if args.x == "wall" else list(range(1, len(reward) + 1))
        ax.plot(xs, moving_average(reward, 10), label=label)
        print(
            f"| {label} | {statistics.mean(reward[:10]):.3f} | {statistics.mean(reward[-10:]):.3f} | "
            f"{val[0]:.2f} -> {val[-1]:.2f} | {statistics.median(s['timing_s/step']):.3f} | "
            f"{sum(s['timing_s/step']):.1f} |"
        )
    ax.set_xlabel("training wall time, s" if args.x == "wall" else "RL step")
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
