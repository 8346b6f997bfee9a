"""One model family through the vLLM matrix (docs/models.md), each stage in processes of its own.

Usage: python tests/scripts/family_step.py --family NAME --work DIR [--tp 1] [--stages logprob,grpo,export,lora]
    [--layers N]

Builds the family (lightning_rlhf.demo.families, random weights) in DIR/model once, then runs: ``logprob``, the
vLLM engine's log-probs against the trainer's in one process (logprob_agreement.py, TP 1); ``grpo``, one GRPO step
colocated with vLLM at TP ``--tp`` on ``--tp`` processes (train.py), saving a checkpoint; ``export``, the
``lightning-rlhf export`` of that checkpoint loaded by vLLM (export_vllm.py, greedy tokens against transformers');
``lora``, one GRPO step of a LoRA adapter with vLLM. Writes DIR/family_tpN.json: per stage its exit code, seconds,
the peak summed RSS of its process tree (sampled every 0.2 s: the parent, ranks and vLLM's), and its figures.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parents[1]


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    with contextlib.suppress(psutil.Error):  # the command ended meanwhile
        for p in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # a process of it ended meanwhile
                total += p.memory_info().rss
    return total


def run(cmd: list[str], timeout: float) -> dict[str, object]:
    """``cmd`` to the end: exit code, seconds, peak summed RSS of its process tree (GB), the end of its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, ps = [0], psutil.Process(proc.pid)

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(ps))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    sampler.join()
    return {"rc": proc.returncode, "s": round(time.monotonic() - start, 1), "peak_rss_gb": round(peak[0] / 1e9, 2),
            "tail": out[-3000:]}  # fmt: skip


def _last_metrics(out: Path) -> dict[str, str]:
    (path,) = out.rglob("metrics.csv")
    with open(path) as f:
        return list(csv.DictReader(f))[-1]


def _train(model: str, out: Path, tp: int, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / "train.py"), "--model", model, "--out", str(out), "--devices", str(tp),
            "--tp", str(tp), "--rollout", "vllm", "--steps", "1", "--prompts", "2", "--n", "4",
            "--micro-batch-size", "2", "--reward", "chars", *extra]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--stages", default="logprob,grpo,export,lora")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--logprob-dtypes", default="float32,bfloat16")
    args = p.parse_args()
    work = Path(args.work)
    model = work / "model"
    report: dict[str, dict[str, object]] = {}
    if not (model / "config.json").exists():
        build = ("from lightning_rlhf.demo.families import build_family; "
                 f"build_family({args.family!r}, {str(model)!r}, layers={args.layers!r})")  # fmt: skip
        report["build"] = run([sys.executable, "-c", build], args.timeout)
    for stage in args.stages.split(","):
        out = work / f"{stage}_tp{args.tp}"
        out.mkdir(parents=True, exist_ok=True)
        if stage == "logprob":
            cmd = [sys.executable, str(SCRIPTS / "logprob_agreement.py"), "--model", str(model), "--engine", "vllm",
                   "--out", str(out), "--dtypes", args.logprob_dtypes]  # fmt: skip
        elif stage == "grpo":
            cmd = _train(str(model), out, args.tp, "--save-ckpt", str(work / f"ckpt_tp{args.tp}"))
        elif stage == "lora":
            cmd = _train(str(model), out, args.tp, "--lora-rank", "8")
        elif stage == "export":
            cli = Path(sys.executable).with_name("lightning-rlhf")
            exported = work / f"exported_tp{args.tp}"
            ckpt = work / f"ckpt_tp{args.tp}"
            done = run([str(cli), "export", str(ckpt), str(exported), "--base", str(model)], args.timeout)
            if done["rc"] != 0:
                report[stage] = done
                continue
            cmd = [sys.executable, str(SCRIPTS / "export_vllm.py"), "--model", str(exported), "--out",
                   str(out / "greedy.json")]  # fmt: skip
        else:
            raise SystemExit(f"unknown stage {stage!r}")
        report[stage] = run(cmd, args.timeout)
        if report[stage]["rc"] == 0:
            if stage == "logprob":
                report[stage]["agreement"] = json.loads((out / "agreement.json").read_text())
            elif stage in ("grpo", "lora"):
                report[stage]["metrics"] = _last_metrics(out)
            else:
                report[stage]["greedy"] = json.loads((out / "greedy.json").read_text())
        print(stage, {k: v for k, v in report[stage].items() if k != "tail"}, flush=True)
    (work / f"family_tp{args.tp}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
