"""How cost grows: our GRPO step vs TRL 1.16's as the prompts per step and the model grow (issue 11, deliverable 4).

    make bench-scaling                                  # this script with the defaults below
    python benchmarks/vs_trl/scaling.py --trl-python .venv-trl/bin/python [--config hf2] [--steps 4]
        [--png docs/img/scaling_vs_trl.png] [--quick]

Two sweeps of the workload of ``workload.py`` (float32, no KL reference), each point run once per side, TRL then
ours, alternated point by point, through ``bench.py``'s functions (same runners, allocator and thread settings,
background-load sampler and re-run of a disturbed run):

- (a) prompts per step P in 16, 32, 64, 128, 256 on the ``small`` model (P x 8 sequences per step, one update
  over all of them in micro-batches of 32);
- (b) the models ``tiny``, ``small``, ``m30``, ``m100`` (0.19M to 101M parameters) at 16 prompts per step.

``small`` at 16 prompts belongs to both sweeps and runs once. Our side is one configuration of ``bench.py``'s
(``--config``, default ``hf2``: 2 processes, transformers rollouts, the fastest in ``make bench-vs-trl`` since the
float32 linears moved to oneDNN; ``vllm2`` was before).

Steps: ``--steps 4``, every figure the median of the last ``--window 2`` (that is, the mean of steps 3 and 4).
Step 1 pays the one-off costs (vLLM's and transformers' first calls, AdamW allocating its state) and step 2 can
still carry some of them, so they are left out; the ``MALLOC_*`` settings of ``bench.py`` remove the slow start of
the first ~5 steps that its 10-step runs guard against (without them glibc needs that long to stop mmap'ing
large tensors). Enough, we expect, for the trend with P and with model size, and for ratios at points whose steps
last seconds (small and up); not verified on an idle machine yet, hence the spread below. Not enough: to tell apart
differences under ~10% on the tiny model
(0.4-0.5 s steps), or as a substitute for ``make bench-vs-trl`` at 16 prompts (10 steps, median of 6, 2 runs per
side): use that for the headline figures. Each run's spread (largest minus smallest step
time in the window, over the median) is in the JSON and a point whose spread passes 10% is starred in the table.

Before starting, the script prints an estimate of the sweep's time: per step 6 x parameters x tokens (update) plus
2 x parameters x tokens (generation) at ``--gflops`` (150 GFLOP/s, float32 on this 2-core machine), plus a fixed
start-up cost per run (imports, model load, vLLM engine). Generation of small models is latency-bound, not
FLOP-bound, so on tiny and small the estimate is low. The full sweep is estimated at 25 minutes of runs here
(plus the tokenizer checks, the waits for quiet and any run repeated for background load); ``--estimate-only``
prints the estimate and stops.

Outputs: the runs' logs and ``scaling.json`` (every run's per-step records and the summaries) under ``--out-dir``,
a markdown table (rows: sweep points; TRL step s, TRL tokens/s, ours step s, ours tokens/s, ratio = our tokens/s
over TRL's), a PNG with two panels (tokens/s vs prompts per step, tokens/s vs parameters, both sides, log x) at
``--png``, and as the last line one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench as B  # noqa: E402  (bench.py and workload.py sit next to this script)
import workload as W  # noqa: E402

PROMPT_SWEEP = (16, 32, 64, 128, 256)
"""Sweep (a): prompts per step."""
MODEL_SWEEP = ("tiny", "small", "m30", "m100")
"""Sweep (b): models, in order of size."""
SWEEP_MODEL = "small"
"""The model of sweep (a)."""
SWEEP_PROMPTS = W.PROMPTS_PER_STEP
"""The prompts per step of sweep (b)."""
STARTUP_S = {"trl": 10.0, "ours": 40.0}
"""Estimated fixed seconds per run outside its steps (imports, model load; ours: 2 processes and the vLLM engines;
measured 8 s and 35-48 s on the tiny model, on a loaded machine)."""
SPREAD_LIMIT = 0.10
"""A run whose window steps spread by more than this fraction of their median is starred in the table."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One sweep point: a model at a prompt count, and the sweeps it belongs to. Runs on: the driver."""

    model: str
    prompts: int
    sweeps: tuple[str, ...]


def plan(models: list[str], prompt_counts: list[int], sweep_model: str, sweep_prompts: int) -> list[Point]:
    """The points of both sweeps in run order, sweep (a) first, a point shared by both sweeps once.

    Runs on: the driver.
    """
    points: dict[tuple[str, int], set[str]] = {}
    for prompts in prompt_counts:
        points.setdefault((sweep_model, prompts), set()).add("prompts")
    for model in models:
        points.setdefault((model, sweep_prompts), set()).add("models")
    return [Point(m, p, tuple(sorted(s, reverse=True))) for (m, p), s in points.items()]


def tokens_per_step(cache: str, model: str, prompts: int, steps: int) -> float:
    """Mean prompt + completion tokens per step of a run (prompt tokens counted with the model's tokenizer).

    Runs on: the driver (after the models are built).
    """
    ids = W.prompt_ids(os.path.join(cache, model), steps, prompts)
    prompt_tokens = sum(len(x) for x in ids) / steps * W.SAMPLES_PER_PROMPT
    return prompt_tokens + prompts * W.SAMPLES_PER_PROMPT * W.NEW_TOKENS


def estimate_s(params: int, tokens: float, steps: int, gflops: float) -> dict[str, float]:
    """Estimated seconds of one point: per side, ``steps`` x (6 + 2) x params x tokens at ``gflops``, plus the
    side's start-up (:data:`STARTUP_S`). Runs on: the driver."""
    step = 8.0 * params * tokens / (gflops * 1e9)
    return {side: steps * step + start for side, start in STARTUP_S.items()}


def summary(run: B.Run, window: int) -> dict[str, Any]:
    """A run's figures over the last ``window`` steps: step, generate and update seconds (medians), tokens per
    step and per second, spread, peak RSS, background load. Runs on: the driver."""
    if run.error is not None:
        return {"error": run.error}
    step = run.median("step", window)
    times = [float(s["step"]) for s in run.steps[-window:]]
    tokens = run.tokens_per_step(window)
    return {
        "step": step,
        "gen": run.median("gen", window),
        "update": run.median("update", window),
        "tokens": tokens,
        "tok_s": tokens / step,
        "spread": (max(times) - min(times)) / step,
        "rss_gib": run.peak_rss / 2**30,
        "background": run.background,
        "seconds": run.seconds,
        "startup_s": run.seconds - sum(float(s["step"]) for s in run.steps),
    }


def ratio(trl: dict[str, Any], ours: dict[str, Any]) -> float | None:
    """Our tokens/s over TRL's, or None when either run failed. Runs on: the driver."""
    if "tok_s" not in trl or "tok_s" not in ours:
        return None
    return round(ours["tok_s"] / trl["tok_s"], 3)


def label(point: Point, sweep: str) -> str:
    """Row label of a point in one sweep's part of the table. Runs on: the driver."""
    params = W.MODELS[point.model].num_params() / 1e6
    if sweep == "prompts":
        return f"P={point.prompts} ({point.model})"
    return f"{point.model} ({params:.2f}M, P={point.prompts})"


def table(results: list[dict[str, Any]], config: str) -> str:
    """The markdown table: one row per point and sweep (the shared point in both parts). Runs on: the driver."""

    def cell(side: dict[str, Any], key: str, fmt: str) -> str:
        if key not in side:
            return "failed"
        star = "*" if key == "step" and side["spread"] > SPREAD_LIMIT else ""
        return format(side[key], fmt) + star

    lines = [
        f"| sweep point | TRL step s | TRL tokens/s | ours ({config}) step s | ours tokens/s | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for sweep in ("prompts", "models"):
        for res in results:
            point: Point = res["point"]
            if sweep not in point.sweeps:
                continue
            trl, ours = res["trl"], res["ours"]
            r = res["ratio"]
            lines.append(
                f"| {label(point, sweep)} | {cell(trl, 'step', '.3f')} | {cell(trl, 'tok_s', ',.0f')} | "
                f"{cell(ours, 'step', '.3f')} | {cell(ours, 'tok_s', ',.0f')} | "
                + ("n/a" if r is None else f"{r:.2f}x")
                + " |"
            )
    return "\n".join(lines)


def plot(
    results: list[dict[str, Any]], config: str, path: str, title: str, sweep_model: str, sweep_prompts: int
) -> None:
    """Two panels: tokens/s vs prompts per step (sweep a) and vs parameters (sweep b), TRL and ours, log x, the
    ratio written next to each of our points. Runs on: the driver."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (
        (
            "prompts",
            lambda p: p.prompts,
            f"prompts per step ({sweep_model} model, {W.SAMPLES_PER_PROMPT} samples each)",
        ),
        ("models", lambda p: W.MODELS[p.model].num_params(), f"parameters ({sweep_prompts} prompts per step)"),
    )
    for ax, (sweep, xof, xlabel) in zip(axes, panels, strict=True):
        rows = sorted((r for r in results if sweep in r["point"].sweeps), key=lambda r: xof(r["point"]))
        for side, name, style in (("trl", "TRL 1.16", "o--"), ("ours", f"ours ({config})", "s-")):
            pts = [(xof(r["point"]), r[side]["tok_s"]) for r in rows if "tok_s" in r[side]]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=name)
        for r in rows:
            if r["ratio"] is not None:
                ax.annotate(
                    f"{r['ratio']:.2f}x",
                    (xof(r["point"]), r["ours"]["tok_s"]),
                    textcoords="offset points",
                    xytext=(0, 7),
                    ha="center",
                    fontsize=8,
                )
        ax.set_xscale("log", base=2 if sweep == "prompts" else 10)
        ax.margins(x=0.1, y=0.15)  # room for the ratio labels
        if sweep == "models":
            ax.set_yscale("log")  # ~100x between tiny and m100
        else:
            ax.set_ylim(bottom=0)
        if sweep == "prompts":
            ax.set_xticks([r["point"].prompts for r in rows], [str(r["point"].prompts) for r in rows])
        else:
            ax.set_xticks(
                [W.MODELS[r["point"].model].num_params() for r in rows],
                [f"{r['point'].model}\n{W.MODELS[r['point'].model].num_params() / 1e6:.2g}M" for r in rows],
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens/s (prompt + completion)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_list(setting: str, text: str, valid: list[str] | None, cast: type = str) -> list[Any]:
    """A comma-separated flag's values, checked (a SystemExit naming the setting otherwise). Runs on: the driver."""
    values = [x for x in text.split(",") if x]
    try:
        out = [cast(x) for x in values]
    except ValueError:
        raise SystemExit(f"{setting}={text!r}: not a list of {cast.__name__}. HINT: e.g. {setting} 16,32") from None
    wrong = [v for v in values if valid is not None and v not in valid]
    if wrong or not out:
        hint = ",".join(valid) if valid else "a comma-separated list"
        raise SystemExit(f"{setting}={text!r}: {wrong or 'empty'} not valid. HINT: use {hint}")
    return out


def main() -> None:
    """Build, check, estimate, run both sweeps alternately, write JSON, table and PNG, print the ratios.

    Runs on: the driver (project venv).
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trl-python", default=os.path.join(ROOT, ".venv-trl", "bin", "python"))
    p.add_argument("--config", default="hf2", choices=list(B.OUR_CONFIGS), help="our configuration")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny only, prompts 16 and 32, 3 steps")
    p.add_argument("--prompts", default=",".join(map(str, PROMPT_SWEEP)), help="sweep (a): prompts per step")
    p.add_argument("--sweep-model", default=SWEEP_MODEL, help="sweep (a): the model")
    p.add_argument("--models", default=",".join(MODEL_SWEEP), help="sweep (b): of " + ",".join(W.MODELS))
    p.add_argument("--sweep-prompts", type=int, default=SWEEP_PROMPTS, help="sweep (b): prompts per step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--window", type=int, default=2, help="figures are medians of the last WINDOW steps")
    p.add_argument("--gflops", type=float, default=150.0, help="float32 GFLOP/s assumed by the time estimate")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument(
        "--quiet-wait", type=float, default=180.0, help="seconds to wait, before a run, for other load to stop"
    )
    p.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "lightning_rlhf", "vs_trl"))
    p.add_argument(
        "--out-dir", default=None, help="folder of logs and scaling.json (default runs/scaling_vs_trl/<time>)"
    )
    p.add_argument("--png", default=os.path.join(ROOT, "docs", "img", "scaling_vs_trl.png"))
    p.add_argument("--estimate-only", action="store_true", help="build the models, print the estimate, stop")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.sweep_model, args.models, args.steps = "16,32", "tiny", "tiny", 3
    prompt_counts = parse_list("--prompts", args.prompts, None, int)
    models = parse_list("--models", args.models, list(W.MODELS))
    parse_list("--sweep-model", args.sweep_model, list(W.MODELS))
    for setting, value in [("--prompts", c) for c in prompt_counts] + [("--sweep-prompts", args.sweep_prompts)]:
        try:
            W.check_prompts(value)
        except ValueError as err:
            raise SystemExit(f"{setting}: {err}") from None
    if not 1 <= args.window < args.steps:
        raise SystemExit(
            f"--steps={args.steps} / --window={args.window}: the window must leave step 1 out (1 <= window < "
            "steps). HINT: --steps 4 --window 2."
        )
    if not os.access(args.trl_python, os.X_OK):
        raise SystemExit(
            f"--trl-python={args.trl_python!r} is not an executable. HINT: `make bench-vs-trl` creates .venv-trl "
            "with TRL 1.16 (outside the project's dependencies)."
        )
    from lightning_rlhf.engines.rollout.vllm import vllm_available

    if B.OUR_CONFIGS[args.config][0] == "vllm" and not vllm_available():
        raise SystemExit(f"--config={args.config}: vLLM is not installed in the project venv. HINT: --config hf2.")
    points = plan(models, prompt_counts, args.sweep_model, args.sweep_prompts)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or os.path.join(ROOT, "runs", "scaling_vs_trl", stamp)
    os.makedirs(out_dir, exist_ok=True)
    started = time.monotonic()

    used = sorted({pt.model for pt in points}, key=list(W.MODELS).index)
    B.build_models(args.cache, used)
    estimates = {}
    for pt in points:
        estimates[pt] = estimate_s(
            W.MODELS[pt.model].num_params(),
            tokens_per_step(args.cache, pt.model, pt.prompts, args.steps),
            args.steps,
            args.gflops,
        )
    total = sum(sum(e.values()) for e in estimates.values())
    print(
        f"estimate: {total / 60:.1f} min for {2 * len(points)} runs ({args.steps} steps each; 8 x params x tokens "
        f"per step at {args.gflops:.0f} GFLOP/s + start-up {STARTUP_S['trl']:.0f} s TRL / {STARTUP_S['ours']:.0f} s "
        "ours per run; low for tiny and small, whose generation is latency-bound)"
    )
    for pt in points:
        e = estimates[pt]
        print(f"  {pt.model:<6} P={pt.prompts:<4} TRL ~{e['trl']:.0f} s, ours ~{e['ours']:.0f} s", flush=True)
    if args.estimate_only:
        return
    for model in used:  # rows are one stream: the largest P of a model covers its smaller ones
        B.check_tokenizers(
            args.cache, [model], args.trl_python, args.steps, max(pt.prompts for pt in points if pt.model == model)
        )
    B.wait_for_quiet(args.quiet_wait)
    peaks = B.machine_peaks()
    cores = os.cpu_count() or 1
    print(
        f"machine: {cores} CPU cores; matmul peak fp32 {peaks['matmul_gflops_fp32']:.1f} GFLOP/s; memcpy "
        f"{peaks['memcpy_gbs']:.1f} GB/s; ours = {args.config}; {args.steps} steps per run, median of the last "
        f"{args.window}; logs in {out_dir}",
        flush=True,
    )

    results: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for pt in points:
        res: dict[str, Any] = {"point": pt}
        for side, config in (("trl", "trl"), ("ours", args.config)):
            name = f"{pt.model}-p{pt.prompts}-{config}"
            run = B.one_run(args, pt.model, "fp32", False, config, os.path.join(out_dir, name), pt.prompts)
            res[side] = summary(run, args.window)
            runs.append({**dataclasses.asdict(run), "name": name})
            if run.error:
                print(f"  {name}: FAILED ({run.seconds:.0f} s): {run.error}", flush=True)
            else:
                print(
                    f"  {name}: {B.run_line(run, args.window)}; {res[side]['tok_s']:,.0f} tok/s "
                    f"(estimate was {estimates[pt][side]:.0f} s)",
                    flush=True,
                )
        res["ratio"] = ratio(res["trl"], res["ours"])
        results.append(res)
    elapsed = time.monotonic() - started

    title = (
        f"GRPO step, TRL 1.16 vs lightning_rlhf ({args.config}), float32, {cores} CPU cores, "
        f"{args.steps} steps per run, median of the last {args.window}"
    )
    print()
    print(table(results, args.config))
    print(
        f"\nstep s = median of the last {args.window} of {args.steps} steps (* = the window's steps spread by more "
        f"than {SPREAD_LIMIT:.0%}); tokens/s = (prompt + completion tokens) / step s; ratio = ours / TRL tokens/s; "
        f"sweep took {elapsed / 60:.1f} min (estimate {total / 60:.1f} min)"
    )
    plot(results, args.config, args.png, title, args.sweep_model, args.sweep_prompts)
    final: dict[str, Any] = {
        "config": args.config,
        "prompts_sweep_model": args.sweep_model,
        "models_sweep_prompts": args.sweep_prompts,
        "prompts_ratio": {str(r["point"].prompts): r["ratio"] for r in results if "prompts" in r["point"].sweeps},
        "models_ratio": {r["point"].model: r["ratio"] for r in results if "models" in r["point"].sweeps},
        "minutes": round(elapsed / 60, 1),
        "estimate_minutes": round(total / 60, 1),
        "png": args.png,
        "json": os.path.join(out_dir, "scaling.json"),
    }
    with open(final["json"], "w") as f:
        json.dump(
            {
                "settings": {k: v for k, v in vars(args).items() if k != "trl_python"},
                "machine": peaks,
                "threads_trl": cores,
                "results": [
                    {
                        **{k: v for k, v in r.items() if k != "point"},
                        **dataclasses.asdict(r["point"]),
                        "params": W.MODELS[r["point"].model].num_params(),
                        "estimate_s": estimates[r["point"]],
                    }
                    for r in results
                ],
                "runs": runs,
                "final": final,
            },
            f,
            indent=1,
        )
    print(f"wrote {final['json']} and {args.png}")
    print(json.dumps(final))


if __name__ == "__main__":
    main()
