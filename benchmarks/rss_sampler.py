"""Sample a training run's memory from outside its processes, and say how much each rank held in each phase.

    python benchmarks/rss_sampler.py --out runs/rss -- python -m lightning_rlhf.demo --max-steps 5

Runs the command (its own session), and every ``--every`` seconds reads the resident size (``VmRSS`` of
``/proc/<pid>/status``) of the command and of every process below it; a process is named by its ``RANK``
(``LOCAL_RANK``) environment variable, the command itself without one as rank 0, others by pid. The command's ranks
append one line per role call to ``$LIGHTNING_RLHF_CALL_LOG`` (set here): its rank, name, start and end time and the
library's own measurement of it.
At the end, ``<out>/rss.json`` and a table on stdout: per rank and role call (``actor.generate``,
``actor.update``, ...), the highest sampled RSS while the call ran, next to the library's
``perf/memory_peak_gb`` figure of the same call (the kernel's peak counter, which sees peaks between samples).
Linux only (``/proc``). Runs on: its own process (not a rank).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

GIB = 1024**3
CALL = re.compile(r"rank (\d+) ran (\S+) from ([\d.]+) to ([\d.]+) (\{.*\})")


def _children() -> dict[int, list[int]]:
    """Each pid's child pids, from ``/proc/<pid>/stat``."""
    out: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                out[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _below(root: int) -> list[int]:
    kids, todo, seen = _children(), [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += kids.get(pid, [])
    return seen


def _rss_gb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError):
        return None
    return None


def _name(pid: int, root: int) -> str:
    """``rank<r>`` from the process's ``RANK``/``LOCAL_RANK`` at exec; the command itself without one is rank 0 (a
    Lightning launch: the first process is rank 0 and starts the others with ``LOCAL_RANK`` set)."""
    try:
        env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    except OSError:
        return f"pid{pid}"
    rank = env.get("RANK") or env.get("LOCAL_RANK")
    return f"rank{rank}" if rank is not None else "rank0" if pid == root else f"pid{pid}"


def sample(cmd: list[str], out: Path, every: float) -> tuple[int, list[tuple[float, dict[str, float]]]]:
    """Run ``cmd`` and sample its processes' RSS; its exit status and the samples (time, name -> GiB)."""
    env = {**os.environ, "LIGHTNING_RLHF_CALL_LOG": str(out / "calls.log")}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    samples: list[tuple[float, dict[str, float]]] = []
    names: dict[int, str] = {}
    while proc.poll() is None:
        now: dict[str, float] = {}
        for pid in _below(proc.pid):
            names.setdefault(pid, _name(pid, proc.pid))
            rss = _rss_gb(pid)
            if rss is not None:  # two processes of one name (a rank's helpers without RANK): the largest
                now[names[pid]] = max(now.get(names[pid], 0.0), rss)
        samples.append((time.time(), now))
        time.sleep(every)
    return proc.returncode, samples


def phases(out: Path, samples: list[tuple[float, dict[str, float]]]) -> list[dict[str, object]]:
    """Per rank and role call: calls seen, the highest sampled RSS while one ran, the library's peak."""
    table: dict[tuple[int, str], dict[str, float]] = {}
    log = out / "calls.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        match = CALL.search(line)
        if match is None:
            continue
        rank, where, start, end = int(match[1]), match[2], float(match[3]), float(match[4])
        own = ast.literal_eval(match[5])
        seen = [s.get(f"rank{rank}", 0.0) for t, s in samples if start <= t <= end]
        row = table.setdefault((rank, where), {"calls": 0, "sampled_peak_gb": 0.0, "library_peak_gb": 0.0})
        row["calls"] += 1
        row["sampled_peak_gb"] = max(row["sampled_peak_gb"], max(seen, default=0.0))
        row["library_peak_gb"] = max(row["library_peak_gb"], float(own.get("peak", 0.0)))
    return [{"rank": rank, "call": where, **row} for (rank, where), row in sorted(table.items())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--every", type=float, default=0.05, help="seconds between samples")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command to run after --")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calls.log").unlink(missing_ok=True)
    code, samples = sample(cmd, args.out, args.every)
    peaks: dict[str, float] = {}
    for _, now in samples:
        for name, rss in now.items():
            peaks[name] = max(peaks.get(name, 0.0), rss)
    rows = phases(args.out, samples)
    (args.out / "rss.json").write_text(json.dumps({"returncode": code, "peaks_gb": peaks, "phases": rows}, indent=1))
    print(f"exit status {code}; sampled peak RSS per process (GiB): { {k: round(v, 2) for k, v in peaks.items()} }")
    print("| rank | call | calls | sampled peak GiB | library peak GiB |\n| --- | --- | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['rank']} | {row['call']} | {row['calls']} | {row['sampled_peak_gb']:.2f} | "
            f"{row['library_peak_gb']:.2f} |"
        )
    sys.exit(code)


if __name__ == "__main__":
    main()
