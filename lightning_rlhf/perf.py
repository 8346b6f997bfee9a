"""The performance figures users compare across frameworks: model FLOPs utilisation (MFU) and the device peaks
behind it, memory, and time per token.

The peak a FLOP count is divided by is the device's dense peak for the compute dtype:

- on a GPU, the published figure of its datasheet (:data:`GPU_PEAKS`, matched on ``torch.cuda.get_device_name``);
- on a CPU, this machine's measured matmul rate (:func:`cpu_matmul_peak`: the faster of ``torch.mm`` and, in
  float32, oneDNN's product, which the training engine's layers use), measured once per CPU model, thread count and
  dtype and kept in ``~/.cache/lightning_rlhf/cpu_matmul_peak.json`` (or ``$LIGHTNING_RLHF_CACHE``);
- anywhere, ``$LIGHTNING_RLHF_PEAK_TFLOPS`` (dense TFLOP/s of one device) when set, which overrides both.

The model FLOPs of a training pass are ``6 * trainable parameters * tokens`` (a forward's multiply-adds are
2 FLOPs per parameter and token, the backward's twice that; attention's ``seq^2`` term and recomputation are not
counted, as usual for MFU)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "GIB",
    "GPU_PEAKS",
    "PEAK_ENV",
    "GPUPeak",
    "available_cores",
    "call_memory_metrics",
    "counted_bytes",
    "cpu_matmul_peak",
    "cpu_memory_used_gb",
    "cpu_model_name",
    "device_peak_flops",
    "full_bytes",
    "gpu_peak",
    "gpu_peak_flops",
    "measure_matmul_flops",
    "memory_census",
    "memory_peaks",
    "memory_window",
    "mfu",
    "per_token_ms",
    "rank_memory_metrics",
    "read_json",
    "step_perf_metrics",
    "tf32_enabled",
    "threads_per_process",
    "trainable_parameters",
    "training_flops",
    "write_json",
]

GIB = 1024**3
"""Bytes per GiB: the memory metrics are in GiB, as verl's ``perf/*_gb``."""
PEAK_ENV = "LIGHTNING_RLHF_PEAK_TFLOPS"
"""Environment variable: the dense peak of one device in TFLOP/s, used instead of the table or the measurement."""
CPU_PEAK_FILE = "cpu_matmul_peak.json"
"""File name of the CPU peak cache inside the cache folder."""


# ------------------------------------------------------------------------------------------------ GPU peaks
@dataclass(frozen=True)
class GPUPeak:
    """Published dense peaks of one GPU model, in TFLOP/s (sparsity figures halved). None: not supported. Runs on: any
    process."""

    pattern: str
    """Regular expression matched (case-insensitively) against ``torch.cuda.get_device_name()``."""
    fp32: float | None
    """float32 without tensor cores (what a float32 matmul gets with TF32 off, PyTorch's default)."""
    tf32: float | None
    """float32 matmuls on TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32`` or
    ``torch.set_float32_matmul_precision("high")``)."""
    bf16: float | None
    """bfloat16 tensor cores, float32 accumulation."""
    fp16: float
    """float16 tensor cores, float32 accumulation."""


# Sources (dense figures; datasheets print the TF32/BF16/FP16 tensor-core figures with 2:4 sparsity, halved here):
#   H100 SXM / H100 NVL / H100 PCIe: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100);
#     H800 has the H100 SXM's compute figures.
#   H200 SXM / H200 NVL: NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200).
#   H20: NVIDIA H20 product brief (FP32 44, TF32 74, BF16/FP16 148 dense).
#   B200: NVIDIA Blackwell datasheet / HGX B200 specifications (nvidia.com/en-us/data-center/hgx): per GPU FP16/BF16
#     4.5 PFLOPS and TF32 2.2 PFLOPS sparse; no plain FP32 figure is published, so float32 without TF32 has none.
#   A100 (SXM and PCIe, 40 and 80 GB; A800 the same): NVIDIA A100 datasheet.
#   A10, L4, L40, L40S: their NVIDIA datasheets. V100 (SXM2 / PCIe), T4: their NVIDIA datasheets (no BF16/TF32).
#   RTX 4090: NVIDIA Ada GPU architecture whitepaper (FP16/BF16 tensor with FP32 accumulate).
#   RTX 3090: NVIDIA Ampere GA102 GPU architecture whitepaper (FP16/BF16 tensor with FP32 accumulate).
#   MI300X: AMD Instinct MI300X datasheet (FP32 vector 163.4, TF32 653.7, BF16/FP16 1307.4 dense).
# The more specific names come first: "H100 NVL" before "H100", "H200" before "H20", "L40S" before "L40" before "L4".
GPU_PEAKS: tuple[GPUPeak, ...] = (
    GPUPeak(r"\bH100\b.*\bNVL\b", fp32=60.0, tf32=417.5, bf16=835.5, fp16=835.5),
    GPUPeak(r"\bH100\b.*\bPCIe\b", fp32=51.0, tf32=378.0, bf16=756.5, fp16=756.5),
    GPUPeak(r"\bH100\b|\bH800\b", fp32=67.0, tf32=494.5, bf16=989.5, fp16=989.5),
    GPUPeak(r"\bH200\b.*\bNVL\b", fp32=60.0, tf32=417.5, bf16=835.5, fp16=835.5),
    GPUPeak(r"\bH200\b|\bGH200\b", fp32=67.0, tf32=494.5, bf16=989.5, fp16=989.5),
    GPUPeak(r"\bH20\b", fp32=44.0, tf32=74.0, bf16=148.0, fp16=148.0),
    GPUPeak(r"\bB200\b", fp32=None, tf32=1100.0, bf16=2250.0, fp16=2250.0),
    GPUPeak(r"\bA100\b|\bA800\b", fp32=19.5, tf32=156.0, bf16=312.0, fp16=312.0),
    GPUPeak(r"\bA10\b", fp32=31.2, tf32=62.5, bf16=125.0, fp16=125.0),
    GPUPeak(r"\bL40S\b", fp32=91.6, tf32=183.0, bf16=362.05, fp16=362.05),
    GPUPeak(r"\bL40\b", fp32=90.5, tf32=90.5, bf16=181.05, fp16=181.05),
    GPUPeak(r"\bL4\b", fp32=30.3, tf32=60.0, bf16=121.0, fp16=121.0),
    GPUPeak(r"\bV100\b.*\bPCIE\b", fp32=14.0, tf32=None, bf16=None, fp16=112.0),
    GPUPeak(r"\bV100\b", fp32=15.7, tf32=None, bf16=None, fp16=125.0),
    GPUPeak(r"\bT4\b", fp32=8.1, tf32=None, bf16=None, fp16=65.0),
    GPUPeak(r"\bRTX 4090\b", fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2),
    GPUPeak(r"\bRTX 3090\b", fp32=35.6, tf32=35.6, bf16=71.0, fp16=71.0),
    GPUPeak(r"\bMI300X\b", fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4),
)
"""Dense peaks by GPU model, most specific names first (see the sources in the comment above)."""


def gpu_peak(name: str) -> GPUPeak | None:
    """The table row whose pattern matches the device name ``name`` (None: not in the table). Runs on: any process."""
    for row in GPU_PEAKS:
        if re.search(row.pattern, name, flags=re.IGNORECASE):
            return row
    return None


def tf32_enabled() -> bool:
    """Whether float32 matmuls on CUDA run on TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``, a float32
    matmul precision other than ``"highest"``, or ``fp32_precision="tf32"``); a setting torch refuses to read (after
    the other API set one) counts as no. Runs on: any process."""
    checks = (
        lambda: torch.get_float32_matmul_precision() != "highest",
        lambda: getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee") == "tf32",
        lambda: bool(torch.backends.cuda.matmul.allow_tf32),
    )
    for check in checks:
        try:
            if check():
                return True
        except RuntimeError:
            continue
    return False


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """Published dense peak FLOP/s of the GPU called ``name`` (``torch.cuda.get_device_name``) computing in
    ``dtype``; float32 counts TF32 tensor cores when :func:`tf32_enabled`. None when the GPU or the dtype is not
    in :data:`GPU_PEAKS`. Runs on: any process."""
    row = gpu_peak(name)
    if row is None:
        return None
    if dtype == torch.float32:
        tflops = row.tf32 if tf32_enabled() and row.tf32 is not None else row.fp32
    else:
        tflops = {torch.bfloat16: row.bf16, torch.float16: row.fp16}.get(dtype)
    return tflops * 1e12 if tflops is not None else None


# ------------------------------------------------------------------------------------------------ CPU peak
def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``, else ``platform.processor()``). Runs on: any
    process."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


def _affinity_cores() -> int:
    """Cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cgroup_cpu_limit(root: str) -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``); None when there is none or it cannot be read."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cores(*, cgroup_root: str = "/sys/fs/cgroup") -> float:
    """The cores this process and the processes it starts share: the CPUs of its affinity mask
    (``os.sched_getaffinity``: what ``taskset`` or a container's cpuset allows), or fewer when its cgroup has a
    CPU quota (``docker --cpus``, Kubernetes limits; may be fractional). Runs on: any process (the planning
    process: ``plan --device-type cpu`` and ``placement="auto"``)."""
    cores = float(_affinity_cores())
    quota = _cgroup_cpu_limit(cgroup_root)
    return min(cores, quota) if quota is not None and quota > 0 else cores


def threads_per_process(processes: int) -> int:
    """The torch threads each of ``processes`` CPU processes on this machine computes with, as Lightning sets them
    when it starts the ranks: ``$OMP_NUM_THREADS`` when set, else the affinity's cores divided among the processes
    (at least 1). Runs on: any process (the planning process, for the run it plans)."""
    if processes < 1:
        raise ValueError(f"threads_per_process(processes={processes}): expected at least 1 process.")
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, _affinity_cores() // processes)


def _cpu_products(dtype: torch.dtype) -> list[Callable[[Tensor, Tensor], Tensor]]:
    """The CPU matmuls a model's layers may use for ``dtype``: ``torch.mm`` and, in float32 where oneDNN is
    available, oneDNN's (:func:`lightning_rlhf.cpu.matmul_product`, which the training engine's linear layers use
    where the CPU speed layer is on: on AMD CPUs MKL's float32 ``sgemm`` runs below half of what the cores do)."""
    import lightning_rlhf.cpu as cpu

    products: list[Callable[[Tensor, Tensor], Tensor]] = [torch.mm]
    onednn = cpu.matmul_product(dtype)
    if onednn is not None:
        products.append(onednn)
    return products


def measure_matmul_flops(dtype: torch.dtype, *, budget_s: float = 1.0, max_size: int = 4096) -> float:
    """This process's best CPU matmul rate in FLOP/s (``2 n^3`` per ``n x n`` product), with the current
    ``torch.get_num_threads()``: the faster of ``torch.mm`` and, in float32, oneDNN's product (``_cpu_products``).
    For each, grows ``n`` from 256 by doubling until one product takes 50 ms (or ``max_size``), then repeats that
    size while its share of ``budget_s`` lasts (at most 8 times) and keeps the fastest. Runs on: any process (it
    uses every thread torch has for about ``budget_s`` seconds)."""
    products = _cpu_products(dtype)
    return max(_best_rate(mm, dtype, budget_s / len(products), max_size) for mm in products)


def _best_rate(mm: Callable[[Tensor, Tensor], Tensor], dtype: torch.dtype, budget_s: float, max_size: int) -> float:
    """The fastest ``mm(a, b)`` of ``n x n`` matrices in FLOP/s (see :func:`measure_matmul_flops`)."""
    deadline = time.perf_counter() + budget_s
    gen = torch.Generator().manual_seed(0)
    best, n = 0.0, 256
    while True:
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        mm(a, b)  # warm-up: the first call of a size/dtype pays for kernel selection and page faults
        t0 = time.perf_counter()
        mm(a, b)
        took = max(time.perf_counter() - t0, 1e-9)
        best = max(best, 2.0 * n**3 / took)
        if took >= 0.05 or n >= max_size or time.perf_counter() + 16 * took > deadline:
            break
        n *= 2
    for _ in range(8):
        if time.perf_counter() + took > deadline:
            break
        t0 = time.perf_counter()
        mm(a, b)
        took = max(time.perf_counter() - t0, 1e-9)
        best = max(best, 2.0 * n**3 / took)
    return best


_CPU_PEAKS: dict[str, float] = {}
_PEAK_METHOD = "best of mm, onednn"
"""Part of the cache key: how the peak was measured (peaks cached before oneDNN's product was measured too are
measured again)."""


def _cpu_peak_key(dtype: torch.dtype, threads: int) -> str:
    """The cache key: CPU model, thread count and dtype."""
    return f"{cpu_model_name()} | threads={threads} | {str(dtype).removeprefix('torch.')} | {_PEAK_METHOD}"


def cpu_matmul_peak(dtype: torch.dtype, *, cache_dir: str | None = None) -> float:
    """This machine's matmul peak in FLOP/s for ``dtype`` with the current thread count: measured once
    (:func:`measure_matmul_flops`, about a second) and cached, in this process and on disk in
    ``<cache_dir>/cpu_matmul_peak.json`` (default: the module docstring's folder) under the key "CPU model |
    threads=T | dtype | method". Delete the file to measure again (e.g. after measuring on a loaded machine,
    which gives a low peak and a high MFU). Runs on: any process (the controller, for ``perf/mfu/*``)."""
    from lightning_rlhf.config.models import embedded_cache_dir

    key = _cpu_peak_key(dtype, torch.get_num_threads())
    folder = cache_dir or embedded_cache_dir()
    path = os.path.join(folder, CPU_PEAK_FILE)
    memo = f"{path}::{key}"
    if memo in _CPU_PEAKS:
        return _CPU_PEAKS[memo]
    table = read_json(path)
    value = table.get(key)
    if not isinstance(value, int | float) or value <= 0:
        value = measure_matmul_flops(dtype)
        table = read_json(path)  # another process may have added a key meanwhile
        table[key] = value
        write_json(path, table)
    _CPU_PEAKS[memo] = float(value)
    return float(value)


def read_json(path: str) -> dict[str, object]:
    """The JSON object in ``path``, or {} when it is missing or unreadable (the measurement caches' reader: this
    module's and the planner's). Runs on: any process."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: str, data: Mapping[str, object]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it); a read-only folder is skipped.
    Runs on: any process."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".cpu_peak.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(dict(data), f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------- the peak
_warned: set[str] = set()


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of one ``device`` computing in ``dtype``, as the module docstring says; None, with a
    warning once, for a GPU or dtype the table lacks and for other devices. Runs on: controller (any process).

    Raises:
        ValueError: ``$LIGHTNING_RLHF_PEAK_TFLOPS`` is set but not a positive number.
    """
    override = os.environ.get(PEAK_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(
                f"{PEAK_ENV}={override!r} is not a positive number. HINT: set it to the dense peak of one device in "
                "TFLOP/s for the compute dtype (e.g. 989.5 for an H100 SXM in bfloat16), or unset it."
            )
        return value * 1e12
    if device.type == "cpu":
        return cpu_matmul_peak(dtype)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, dtype)
        if peak is not None:
            return peak
        reason = f"no published {dtype} peak for {name!r} in lightning_rlhf.perf.GPU_PEAKS"
    else:
        reason = f"no peak for device type {device.type!r}"
    if reason not in _warned:
        _warned.add(reason)
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            f"perf/mfu/* is not logged: {reason}. HINT: set {PEAK_ENV} to the device's dense peak in TFLOP/s.",
            category=UserWarning,
        )
    return None


# ------------------------------------------------------------------------------------------- the formulas
def trainable_parameters(model: nn.Module | None) -> int:
    """Number of trainable parameters of ``model`` (0 for None). On an FSDP2-sharded model each parameter is a
    DTensor whose ``numel()`` is the full tensor's, so this is the whole model's count on any rank, without a
    collective; parameters shared between modules (tied embeddings) count once. Runs on: any process."""
    if model is None:
        return 0
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def training_flops(params: int, tokens: float, *, epochs: int = 1) -> float:
    """Model FLOPs of training on ``tokens`` tokens ``epochs`` times: ``6 * params * tokens * epochs`` (forward
    2, backward 4 FLOPs per parameter and token). Runs on: any process."""
    return 6.0 * params * tokens * epochs


def mfu(flops: float, seconds: float, peak_flops: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: ``flops / seconds`` over the peak of ``devices`` devices of ``peak_flops`` each.
    Runs on: any process."""
    if seconds <= 0 or peak_flops <= 0 or devices < 1:
        raise ValueError(
            f"mfu(seconds={seconds}, peak_flops={peak_flops}, devices={devices}): all must be positive. "
            "HINT: pass the timed seconds of the phase, the per-device peak (device_peak_flops) and the world size."
        )
    return flops / seconds / (peak_flops * devices)


def per_token_ms(seconds: float, tokens: float) -> float | None:
    """Milliseconds per token (``seconds * 1000 / tokens``); None when there are no tokens. Runs on: any process."""
    return seconds * 1000.0 / tokens if tokens > 0 else None


def cpu_memory_used_gb() -> float:
    """This process's resident memory (RSS) in GiB: ``/proc/self/statm`` on Linux, else the peak RSS of
    ``resource.getrusage``. Runs on: any process (the controller logs its own)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / GIB
    except (OSError, ValueError, IndexError):
        return _rusage_peak_gb()


def _rusage_peak_gb() -> float:
    """The peak RSS of ``resource.getrusage`` (where ``/proc`` is not there), GiB."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB


def device_wait() -> None:
    """Wait until the accelerator has run the work queued so far (nothing on a CPU): a timer read after it counts
    that work, e.g. a weight hand-off's asynchronous device copies. Runs on: any process."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def counted_bytes(stream: Iterator[tuple[str, Tensor]], count: list[int]) -> Iterator[tuple[str, Tensor]]:
    """``stream`` unchanged, adding each tensor's bytes to ``count[0]`` as it passes (what a weight hand-off hands
    an engine: ``perf/weight_sync_bytes``; a resharded weight counts the slice it holds, its ``held_bytes``). Runs
    on: every worker rank."""
    for name, tensor in stream:
        held = getattr(tensor, "held_bytes", None)  # a tensor-parallel slice holder supports narrow() only
        count[0] += held if held is not None else tensor.numel() * tensor.element_size()
        yield name, tensor


def full_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``model``'s full parameters (a sharded parameter counts whole; a tied one once), in ``dtype`` (None:
    their own). Runs on: any process (no collective)."""
    fixed = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    return sum(p.numel() * (fixed or p.element_size()) for p in model.parameters())


_EARLIER_PEAKS = {"cpu": 0.0, "cuda": 0.0}
"""GiB: this process's peaks before the current :func:`memory_window` reset them (the since-start peak is the larger
of this and the current window's)."""


def _status_gb() -> tuple[float, float] | None:
    """``(VmRSS, VmHWM)`` of ``/proc/self/status`` (the resident size, and its peak since start or the last reset),
    GiB; None off Linux. One raw read (tens of microseconds): it runs around every role call."""
    try:
        fd = os.open("/proc/self/status", os.O_RDONLY)
        try:
            text = os.read(fd, 8192)
        finally:
            os.close(fd)
        rss, hwm = (
            int(text[text.index(key) + 6 : text.index(b"kB", text.index(key))]) for key in (b"VmRSS:", b"VmHWM:")
        )
        return rss * 1024 / GIB, hwm * 1024 / GIB
    except (OSError, ValueError):
        return None


def peak_rss_gb() -> float:
    """This process's peak resident memory since it started (``VmHWM`` of ``/proc/self/status`` on Linux, which a
    process started by exec does not inherit, and the peaks before any :func:`memory_window` reset it; else
    ``resource.getrusage``'s ``ru_maxrss``), GiB. Runs on: any process."""
    status = _status_gb()
    return max(_EARLIER_PEAKS["cpu"], status[1]) if status is not None else _rusage_peak_gb()


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextlib.contextmanager
def memory_window() -> Iterator[dict[str, float]]:
    """Measure the memory of the block: the dict it yields holds afterwards ``before`` (RSS at the start, GiB) and
    ``peak`` (the process's peak RSS within the block: the kernel's peak counter is reset at the start by writing 5
    to ``/proc/self/clear_refs``; :func:`peak_rss_gb` keeps the since-start peak), and on CUDA ``cuda_before`` and
    ``cuda_peak`` (allocated bytes). Off Linux (no reset) the CPU keys stay out. Runs on: any process (a worker
    around each role call)."""
    out: dict[str, float] = {}
    status = _status_gb()
    reset = status is not None
    if status is not None:
        _EARLIER_PEAKS["cpu"] = max(_EARLIER_PEAKS["cpu"], status[1])
        try:
            fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
            try:
                os.write(fd, b"5")
            finally:
                os.close(fd)
        except OSError:
            reset = False
    cuda = _cuda_in_use()
    if cuda:
        cuda_before = torch.cuda.memory_allocated() / GIB
        _EARLIER_PEAKS["cuda"] = max(_EARLIER_PEAKS["cuda"], torch.cuda.max_memory_allocated() / GIB)
        torch.cuda.reset_peak_memory_stats()
    try:
        yield out
    finally:
        after = _status_gb() if reset else None
        if status is not None and after is not None:
            out |= {"before": status[0], "peak": after[1]}
        if cuda:
            out |= {"cuda_before": cuda_before, "cuda_peak": torch.cuda.max_memory_allocated() / GIB}


CENSUS_PREFIX = "held/"
"""Prefix of :func:`memory_census`'s parts in a rank's reply statistics."""


def memory_census(roles: Mapping[str, Any]) -> dict[str, float]:
    """GiB of tensors this process holds for each role, by part: ``held/<role>/params`` (its model's local parameter
    shards, or whole parameters while FSDP keeps them gathered, e.g. the root's after a forward), ``<role>/grads``
    and ``<role>/optimizer`` (the optimizer's state), each tensor counted once (a reference that borrows the
    actor's model counts nothing again). What the RSS holds beyond these is the rollout
    engine (weights, KV cache), the libraries and the allocator's slack. Runs on: every rank (with its replies, when
    ``RLHFStrategy(memory_census=True)``)."""
    seen: set[int] = set()

    def held(tensors: Iterator[Tensor]) -> float:
        total = 0
        for t in tensors:
            local = getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank
            if local.data_ptr() not in seen:  # a tied or borrowed weight once (shards may share one buffer)
                seen.add(local.data_ptr())
                total += local.numel() * local.element_size()
        return total / GIB

    out: dict[str, float] = {}
    for name, role in roles.items():
        model = getattr(role, "model", None)
        if isinstance(model, nn.Module):
            params = list(model.parameters())
            out[f"{name}/params"] = held(iter(params))
            out[f"{name}/grads"] = held(p.grad for p in params if p.grad is not None)
        optimizer = getattr(role, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer):
            state = (v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor))
            out[f"{name}/optimizer"] = held(state)
    return {CENSUS_PREFIX + k: v for k, v in out.items() if v > 0}


def memory_peaks() -> dict[str, float]:
    """This process's memory peaks since it started, GiB: ``cpu`` (:func:`peak_rss_gb`) and, where CUDA is in use,
    ``cuda`` (``torch.cuda.max_memory_allocated`` of the current device). A few microseconds: the controller's
    exchanges carry every rank's. Runs on: every rank (with each reply to the controller)."""
    peaks = {"cpu": peak_rss_gb()}
    if _cuda_in_use():
        peaks["cuda"] = max(_EARLIER_PEAKS["cuda"], torch.cuda.max_memory_allocated() / GIB)
    return peaks


def rank_memory_metrics(peaks: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
    """The memory metrics from every rank's :func:`memory_peaks` (by rank): ``perf/cpu_memory_peak_gb`` (the largest
    peak RSS of any rank) and ``perf/cpu_memory_peak_gb/rank<r>`` (each rank's), and on CUDA
    ``perf/max_memory_allocated_gb`` (the largest over ranks) and ``perf/max_memory_allocated_gb/rank<r>``. Runs
    on: controller."""
    out: dict[str, float] = {}
    for kind, name in (("cpu", "perf/cpu_memory_peak_gb"), ("cuda", "perf/max_memory_allocated_gb")):
        by_rank = {rank: float(p[kind]) for rank, p in sorted(peaks.items()) if kind in p}
        if by_rank:
            out[name] = max(by_rank.values())
            out |= {f"{name}/rank{rank}": value for rank, value in by_rank.items()}
    for p in peaks.values():  # memory_census() parts (RLHFStrategy(memory_census=True)): the largest over ranks
        for key, value in p.items():
            if key.startswith(CENSUS_PREFIX):
                name = f"perf/memory_held_gb/{key.removeprefix(CENSUS_PREFIX)}"
                out[name] = max(out.get(name, 0.0), float(value))
    return out


def call_memory_metrics(calls: Mapping[str, Mapping[int, Mapping[str, float]]]) -> dict[str, float]:
    """Each role call's memory (the controller's record of every rank's :func:`memory_window` around it), the
    largest over ranks: ``perf/memory_peak_gb/<role>.<method>`` (peak RSS during the call) and
    ``perf/memory_added_gb/<role>.<method>`` (that peak over the RSS at its start: what the call's own work took,
    e.g. activations, gathered parameters, logits), and on CUDA ``perf/cuda_memory_peak_gb/<role>.<method>``
    (allocated bytes). Runs on: controller."""
    out: dict[str, float] = {}
    for where, ranks in calls.items():
        for memory in ranks.values():
            figures = {}
            if "peak" in memory:
                figures = {"memory_peak_gb": memory["peak"], "memory_added_gb": memory["peak"] - memory["before"]}
            if "cuda_peak" in memory:
                figures["cuda_memory_peak_gb"] = memory["cuda_peak"]
            for kind, value in figures.items():
                name = f"perf/{kind}/{where}"
                out[name] = max(out.get(name, float("-inf")), float(value))
    return out


# ------------------------------------------------------------------------------------------- per step
PER_TOKEN_STAGES: dict[str, str] = {
    "gen": "response",
    "old_log_prob": "all",
    "ref": "all",
    "values": "all",
    "update_critic": "all",
    "update_actor": "all",
}
"""The stages with a ``timing_per_token_ms/<stage>`` (verl's set and names) and the tokens each is divided by:
the generated (response) tokens, or all tokens (prompt + response) of the step's rows."""
MFU_STAGES: dict[str, str] = {"actor": "update_actor", "critic": "update_critic"}
"""``perf/mfu/<role>`` and the timing (``timing_s/<stage>``) whose seconds it divides by."""


def step_perf_metrics(
    *,
    prompt_tokens: float,
    response_tokens: float,
    timings: Mapping[str, float],
    params: Mapping[str, int],
    epochs: int,
    device: torch.device,
    dtype: torch.dtype,
    world_size: int,
    rank_peaks: Mapping[int, Mapping[str, float]] | None = None,
    call_memory: Mapping[str, Mapping[int, Mapping[str, float]]] | None = None,
) -> dict[str, float]:
    """One step's performance metrics from what the controller already holds (no collective), as docs/metrics.md defines
    them: ``timing_per_token_ms/<stage>`` (:data:`PER_TOKEN_STAGES`), ``perf/mfu/<role>`` for each role of ``params``
    (trainable parameter counts, e.g. ``{"actor": N}``) whose update was timed, every rank's memory peaks
    (:func:`rank_memory_metrics` of ``rank_peaks``, the controller's latest :func:`memory_peaks` of each rank), each
    role call's (:func:`call_memory_metrics` of ``call_memory``) and ``perf/cpu_memory_used_gb``. Runs on:
    controller."""
    tokens = {"response": response_tokens, "all": prompt_tokens + response_tokens}
    out: dict[str, float] = {}
    for stage, counted in PER_TOKEN_STAGES.items():
        seconds = timings.get(f"timing_s/{stage}")
        value = per_token_ms(seconds, tokens[counted]) if seconds is not None else None
        if value is not None:
            out[f"timing_per_token_ms/{stage}"] = value
    timed = {role: timings.get(f"timing_s/{stage}", 0.0) for role, stage in MFU_STAGES.items()}
    if any(timed[role] > 0 and params.get(role, 0) > 0 for role in timed):
        peak = device_peak_flops(device, dtype)
        for role, seconds in timed.items():
            if peak is not None and seconds > 0 and params.get(role, 0) > 0:
                flops = training_flops(params[role], tokens["all"], epochs=epochs)
                out[f"perf/mfu/{role}"] = mfu(flops, seconds, peak, max(1, world_size))
    out |= rank_memory_metrics({**(rank_peaks or {}), 0: {**(rank_peaks or {}).get(0, {}), **memory_peaks()}})
    out |= call_memory_metrics(call_memory or {})
    out["perf/cpu_memory_used_gb"] = cpu_memory_used_gb()
    return out
