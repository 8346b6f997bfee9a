"""What each piece of the CPU speed layer (``lightning_rlhf/cpu``) saves of a training step, on the vs-TRL workload.

    python benchmarks/bench_cpu_layer.py                      # small model, fp32/bf16, without/with the reference
    python benchmarks/bench_cpu_layer.py --steps 6 --window 3 --combos small_fp32,small_bf16_ref

Each combination (model, precision, with or without the frozen reference) runs our ``hf2`` configuration of
``benchmarks/vs_trl`` (GRPO, the transformers engine, 2 processes; the same runner and environment as ``bench.py``)
with the whole layer on, with it off (``LIGHTNING_RLHF_CPU_KERNELS=0``), and once per piece with only that piece off
(``LIGHTNING_RLHF_CPU_OFF=<piece>``, read by every rank through ``lightning_rlhf.cpu.enabled``). A piece's saving is
``(step with it off - step with all on) / step with it off``: the share of the step it takes away (negative: the
step is faster without it). The step is the median ``timing_s/step`` of the last ``--window`` steps; with
``--repeat N`` the variants run round-robin N times and each keeps its fastest round.

The machine's other load moves single runs by several percent: ``bench.py`` runs a busy run again once (the quieter
kept), and each line prints the background load measured during it. Savings under ~3% are within that noise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "vs_trl"))
sys.path.insert(0, os.path.dirname(HERE))

import bench  # noqa: E402  # benchmarks/vs_trl/bench.py: the workload's runner

from lightning_rlhf import cpu  # noqa: E402

VARIANTS = ("on", "off", *cpu.PIECES)
"""``on``: the layer as the default on CPU; ``off``: all of it off; a piece's name: only that piece off."""


def variant_env(variant: str) -> dict[str, str]:
    """The environment variables that make ``variant``. Runs on: the driver."""
    if variant == "on":
        return {cpu.ENV: "1"}
    if variant == "off":
        return {cpu.ENV: "0"}
    return {cpu.ENV: "1", cpu.OFF_ENV: variant}


def one_variant(args: argparse.Namespace, model: str, precision: str, ref: bool, variant: str, folder: str) -> Any:
    """One ``hf2`` run of the combination with ``variant``'s environment (``bench.one_run``). Runs on: the driver."""
    saved = {k: os.environ.get(k) for k in (cpu.ENV, cpu.OFF_ENV)}
    os.environ.pop(cpu.OFF_ENV, None)
    os.environ.update(variant_env(variant))
    try:
        return bench.one_run(args, model, precision, ref, "hf2", folder)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    """Run every combination and variant, print the table. Runs on: the driver (one process; the runs are its
    children)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--combos", default="small_fp32,small_fp32_ref,small_bf16,small_bf16_ref")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=6, help="steps per run (the first ones warm up)")
    p.add_argument("--window", type=int, default=3, help="median over the last this many steps")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the variants; each keeps its fastest round")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "bench_cpu_layer_models"))
    p.add_argument("--quiet-wait", type=float, default=5.0, help="seconds to wait for a quiet machine before a run")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument(
        "--background-limit",
        type=float,
        default=bench.BACKGROUND_LIMIT,
        help="cores of other load above which a run is repeated once (bench.py's; raise it on a shared machine)",
    )
    args = p.parse_args()
    bench.BACKGROUND_LIMIT = args.background_limit
    args.trl_python = sys.executable  # unused: only our configuration runs
    combos = [c.split("_") for c in args.combos.split(",")]
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in VARIANTS:
            raise SystemExit(f"--variants: {variant!r} is not one of {list(VARIANTS)}")
    bench.build_models(args.cache, sorted({c[0] for c in combos}))
    steps: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="bench_cpu_layer_") as folder:
        for combo in combos:
            model, precision, ref = combo[0], combo[1], len(combo) > 2 and combo[2] == "ref"
            tag = "_".join(combo)
            for round_ in range(args.repeat):  # round-robin: a change of the machine's load hits every variant
                for variant in variants:
                    sub = os.path.join(folder, tag, f"{variant}-{round_}")
                    run = one_variant(args, model, precision, ref, variant, sub)
                    if run.error:
                        print(f"{tag} {variant}: FAILED {run.error}", flush=True)
                        continue
                    step = run.median("step", args.window)
                    steps[(tag, variant)] = min(step, steps.get((tag, variant), step))  # the least disturbed
                    print(f"{tag:16s} {variant:15s} {bench.run_line(run, args.window)}", flush=True)
    tags = ["_".join(c) for c in combos]
    print("\nShare of the step each piece saves: (step without it - step with all) / step without it")
    print("| piece off | " + " | ".join(tags) + " |")
    print("|---|" + "---|" * len(tags))
    for variant in variants:
        cells = []
        for tag in tags:
            step, base = steps.get((tag, variant)), steps.get((tag, "on"))
            if step is None or base is None:
                cells.append("n/a")
            elif variant == "on":
                cells.append(f"{base:.3f} s")
            else:
                cells.append(f"{step:.3f} s ({(step - base) / step:+.1%})")
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
