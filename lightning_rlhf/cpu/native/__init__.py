"""The CPU kernels of the decoding loop, the weight hand-off's cast and the training forward's token log-probs: one C
file (``kernels.c``) compiled on first use, called through ``ctypes`` (docs/architecture.md has the why-nots).

Why: on CPU a small model's decoding step spends most of its time outside the matmuls, in dozens of eager PyTorch
ops per layer, each a dispatch over tiny tensors; and the token log-probs of a training forward make about six
passes over the ``[tokens, vocab]`` logits. The kernels do the same arithmetic in one pass: a layer's decoding step
(:class:`DecodeStep`), the attention step alone (:func:`decode_attention`), RMS norms (:func:`rms_norm`) and SiLU-gated
products (:func:`silu_mul`), softmax and sums in float32 and bfloat16 rounded where the eager ops round; the float32 ->
bfloat16 cast of the hand-off (:class:`CastPlan`, rounded to nearest even as ``Tensor.copy_``); token log-probs,
entropies and their gradient (:func:`token_logprobs`, :func:`token_logprobs_backward`; sums of 64 entries in double).

How: the first call in a process compiles the source with ``$CC`` (else ``cc``/``gcc``; ``-O3 -march=native``, about
a second) into the project's cache folder (:func:`_build`). Where no compiler exists or the build fails, the callers
keep their eager ops and the log says so once; ``LIGHTNING_RLHF_NATIVE=0`` (or the CPU layer's switch) turns the
kernels off. The package imports nothing of the project but its cache folder's name.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CastPlan",
    "DecodeStep",
    "cpuinfo_line",
    "decode_attention",
    "native_attention_available",
    "rms_norm",
    "silu_mul",
    "token_logprobs",
    "token_logprobs_backward",
]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread", "-std=gnu11")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cache_dir() -> Path:
    from lightning_rlhf.config.models import embedded_cache_dir  # the project's one cache folder

    return Path(embedded_cache_dir()) / "kernels"


def cpuinfo_line(*keys: str) -> str:
    """The first line of ``/proc/cpuinfo`` that starts with one of ``keys``; empty where none is or the file is not
    readable. Runs on: any process."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(keys)), "")
    except OSError:
        return ""


def _build(compiler: list[str]) -> Path:
    """Compile the kernels (or find them built) and return the shared library's path: in the cache folder, or, where
    that cannot be written, in a new private temporary folder. Named by a digest of the source, the flags, the
    compiler's version and the CPU's feature flags (one build per CPU kind on a shared home), written atomically (ranks
    that compile at once each write a whole file). Raises on a failed build."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=20, check=True).stdout
    digest = hashlib.sha256()
    cpu_flags = cpuinfo_line("flags", "Features")  # what -march=native compiles for
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), cpu_flags.encode()):
        digest.update(part)
    name = f"kernels-{digest.hexdigest()[:20]}.so"
    target = _cache_dir() / name
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    except OSError:  # a read-only home or cache folder: a folder of this process's own (mode 0700)
        target = Path(tempfile.mkdtemp(prefix="lightning_rlhf_kernels_")) / name
        fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        command = [*compiler, *FLAGS, "-o", partial, str(SOURCE), "-lm"]
        subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
        os.replace(partial, target)  # atomic: a rank that builds at the same moment replaces a whole file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


class _StepPlan(ctypes.Structure):
    """``StepPlan`` of ``kernels.c``: what a layer's decoding steps share over a sampling call."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("query", "out", "keys", "values", "prefix_keys", "prefix_values")),
        ("prefix_bias", ctypes.c_void_p),
        *((name, ctypes.c_long) for name in ("rows", "n", "kv", "group", "d", "width", "cap")),
        ("scale", ctypes.c_float),
        ("dtype", ctypes.c_int),
        ("threads", ctypes.c_int),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled library with its functions' signatures set, or None (turned off, no compiler, failed build:
    logged once)."""
    if os.environ.get("LIGHTNING_RLHF_NATIVE", "1") == "0":
        return None
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        log.warning(
            "No C compiler (cc, gcc or $CC): the CPU kernels (lightning_rlhf.cpu.native) run as eager PyTorch ops."
        )
        return None
    try:
        library = ctypes.CDLL(str(_build(shlex.split(found))))  # $CC may carry arguments ("ccache gcc")
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        log.warning(
            "The CPU kernels (lightning_rlhf.cpu.native) did not build (%s): eager PyTorch ops instead.", detail
        )
        return None
    pointer, size, f32, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
    signatures: dict[str, tuple[Any, list[Any]]] = {  # name: (restype, argtypes)
        "decode_attention": (i32, [pointer] * 7 + [size] * 8 + [f32, i32, i32]),
        "rms_norm": (None, [pointer] * 3 + [size] * 2 + [f32, i32]),
        "silu_mul": (None, [pointer] * 2 + [size] * 2 + [i32]),
        "token_logprobs": (size, [pointer] * 2 + [size] * 2 + [f32, i32] + [pointer] * 4 + [i32]),
        "token_logprobs_backward": (size, [pointer] * 6 + [size] * 2 + [f32, i32, pointer, i32]),
        "cast_bf16": (None, [pointer] * 3 + [size]),
        "decode_step": (i32, [ctypes.POINTER(_StepPlan)] + [pointer] * 3 + [size]),
    }
    for name, (restype, argtypes) in signatures.items():
        getattr(library, name).restype = restype
        getattr(library, name).argtypes = argtypes
    return library


def native_attention_available() -> bool:
    """Whether :func:`decode_attention` (and the other kernels) can run here (compiles them on the first call). Runs
    on: worker."""
    return _library() is not None


def decode_attention(
    query: Tensor,
    prefix_keys: Tensor,
    prefix_values: Tensor,
    prefix_bias: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    n: int,
    span: int,
    scaling: float,
) -> Tensor | None:
    """A decoding step's attention, ``[rows, kv_heads, group, d]`` like ``query``, or None where the kernel cannot
    take these tensors (not CPU, a dtype other than float32/bfloat16, mixed dtypes, a head size ``d`` that is not a
    multiple of 8 up to 256, no kernel). ``prefix_keys``/``prefix_values`` ``[prompts, kv_heads, width, d]`` (once
    for a prompt's ``n`` consecutive rows), ``prefix_bias`` float32 with ``prompts x width`` elements (0 or -inf),
    ``keys``/``values`` ``[rows, kv_heads, capacity, d]`` of which the first ``span`` slots are read. Raises
    ``ValueError`` for shapes that do not agree. Runs on: worker (the decoding loop).
    """
    code = _DTYPES.get(query.dtype)
    tensors = (query, prefix_keys, prefix_values, keys, values)
    if code is None or any(t.device.type != "cpu" or t.dtype != query.dtype for t in tensors):
        return None
    rows, kv_heads, group, d = query.shape
    if prefix_bias.dtype != torch.float32 or d % 8 or d > 256:  # the kernel's vectors: 8 floats, up to 32 a row
        return None
    prompts, width = rows // n, prefix_keys.shape[2]
    shapes_agree = (
        rows == prompts * n
        and prefix_keys.shape == prefix_values.shape == (prompts, kv_heads, width, d)
        and keys.shape == values.shape == (rows, kv_heads, keys.shape[2], d)
        and prefix_bias.numel() == prompts * width
        and 0 < span <= keys.shape[2]
    )
    if not shapes_agree:
        raise ValueError(
            f"decode_attention: shapes do not agree: query {tuple(query.shape)} (n={n}), prompt keys/values "
            f"{tuple(prefix_keys.shape)}/{tuple(prefix_values.shape)}, bias {tuple(prefix_bias.shape)}, keys/values "
            f"{tuple(keys.shape)}/{tuple(values.shape)}, span {span}. HINT: [rows, kv, group, d], [rows / n, kv, "
            "width, d], rows / n x width, [rows, kv, capacity, d], 0 < span <= capacity."
        )
    library = _library()
    if library is None:
        return None
    query, bias = query.contiguous(), prefix_bias.contiguous()
    prefix_keys, prefix_values, keys, values = (t.contiguous() for t in tensors[1:])
    out = torch.empty_like(query)
    pointers = (t.data_ptr() for t in (query, prefix_keys, prefix_values, bias, keys, values, out))
    sizes = (rows, n, kv_heads, group, d, prefix_keys.shape[2], keys.shape[2], span)
    failed = library.decode_attention(*pointers, *sizes, scaling, code, torch.get_num_threads())
    if failed == 1:
        raise MemoryError("decode_attention: the kernel could not allocate its scratch memory")
    return out if failed == 0 else None


def _cpu_code(*tensors: Tensor) -> int | None:
    """The kernels' dtype code for contiguous CPU tensors of one dtype they take, else None."""
    usable = all(t.device.type == "cpu" and t.dtype == tensors[0].dtype and t.is_contiguous() for t in tensors)
    return _DTYPES.get(tensors[0].dtype) if usable else None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """transformers' Llama-family RMS norm of ``x`` ``[..., width]`` (float32 statistics; the normalised value rounded
    to ``x``'s dtype, times ``weight``, rounded), or None where the kernel cannot take these tensors (see
    :func:`decode_attention`). Runs on: worker (the decoding loop)."""
    code = _cpu_code(x, weight)
    library = _library() if code is not None else None
    if library is None or code is None:
        return None
    out = torch.empty_like(x)
    library.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, code)
    return out


def silu_mul(gate_up: Tensor) -> Tensor | None:
    """``silu(gate) * up`` for a fused gate/up projection's output ``[..., 2 * inter]`` (gate first), as transformers'
    Llama-family MLP computes it (the SiLU rounded to the dtype, then the product), or None where the kernel cannot
    take it. Runs on: worker (the decoding loop)."""
    code = _cpu_code(gate_up)
    library = _library() if code is not None else None
    if library is None or code is None:
        return None
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    library.silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // gate_up.shape[-1], inter, code)
    return out


class DecodeStep:
    """One layer's decoding steps from its fused query/key/value projection, as one compiled call a step: the rotary
    embedding of the queries and keys, the keys and values written into generated slot ``step`` of the caches, and
    :func:`decode_attention` over the prompt's keys and slots ``0..step``. Built with :meth:`make` once per sampling
    call and layer (shapes checked, addresses set), a step costs one ``ctypes`` call with five arguments (the eager
    ops took ~15 dispatches and ~85 us a layer-step on the benchmark's small model). The result is a buffer of this
    object, overwritten by the next step. Runs on: worker (the decoding loop).
    """

    def __init__(
        self, function: Any, plan: _StepPlan, query: Tensor, out: Tensor, keep: tuple[Tensor, ...], width: int
    ) -> None:
        self._function, self._plan, self._pointer = function, plan, ctypes.pointer(plan)
        self._query, self._out, self._keep = query, out, keep  # the addresses in the plan stay valid
        self._width = width  # of a row of the fused projection's output

    @classmethod
    def make(
        cls,
        prefix_keys: Tensor,
        prefix_values: Tensor,
        prefix_bias: Tensor,
        keys: Tensor,
        values: Tensor,
        *,
        n: int,
        group: int,
        scaling: float,
    ) -> DecodeStep | None:
        """The steps of one layer over these caches (shapes as :func:`decode_attention`'s, ``group`` queries per
        key/value head), or None where the kernel cannot take them (not CPU, another dtype, a head size that is not a
        multiple of 16 up to 256, no kernel). Runs on: worker, once per sampling call and layer."""
        code = _cpu_code(prefix_keys, prefix_values, keys, values)
        rows, kv, cap, d = keys.shape
        if code is None or d % 16 or d > 256 or prefix_bias.dtype != torch.float32 or not prefix_bias.is_contiguous():
            return None
        prompts, width = rows // n, prefix_keys.shape[2]
        shapes_agree = (
            rows == prompts * n
            and prefix_keys.shape == prefix_values.shape == (prompts, kv, width, d)
            and values.shape == keys.shape
            and prefix_bias.numel() == prompts * width
        )
        if not shapes_agree:
            raise ValueError(
                f"DecodeStep: shapes do not agree: prompt keys/values {tuple(prefix_keys.shape)}/"
                f"{tuple(prefix_values.shape)}, bias {tuple(prefix_bias.shape)}, keys/values {tuple(keys.shape)}/"
                f"{tuple(values.shape)}, n={n}. HINT: [rows / n, kv, width, d], rows / n x width and [rows, kv, "
                "capacity, d]."
            )
        library = _library()
        if library is None:
            return None
        heads = kv * group
        query = keys.new_empty((rows, 1, heads * d))
        out = keys.new_empty((rows, 1, heads * d))
        plan = _StepPlan(
            query.data_ptr(), out.data_ptr(), keys.data_ptr(), values.data_ptr(), prefix_keys.data_ptr(),
            prefix_values.data_ptr(), prefix_bias.data_ptr(), rows, n, kv, group, d, width, cap, scaling, code,
            torch.get_num_threads(),
        )  # fmt: skip
        keep = (prefix_keys, prefix_values, prefix_bias, keys, values)
        return cls(library.decode_step, plan, query, out, keep, (heads + 2 * kv) * d)

    def __call__(self, qkv: Tensor, cos: Tensor, sin: Tensor, step: int) -> Tensor:
        """Decoding step ``step`` (< the caches' capacity): ``qkv`` ``[rows, 1, (heads + 2 kv) * d]`` (contiguous, the
        caches' dtype), ``cos``/``sin`` ``[rows, 1, d]`` (the rotary embedding's, same dtype); returns the attention's
        output ``[rows, 1, heads * d]``. Runs on: worker."""
        plan = self._plan
        rows, d = plan.rows, plan.d
        if (
            qkv.shape != (rows, 1, self._width)
            or cos.shape != (rows, 1, d)
            or sin.shape != cos.shape
            or not (qkv.dtype == cos.dtype == sin.dtype == self._out.dtype)
            or not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())
            or not (qkv.device.type == cos.device.type == sin.device.type == "cpu")
            or not 0 <= step < plan.cap
        ):
            raise ValueError(
                f"DecodeStep: qkv {tuple(qkv.shape)} {qkv.dtype}, cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} "
                f"{cos.dtype}, step {step}; expected [{rows}, 1, {self._width}] and [{rows}, 1, {d}] contiguous "
                f"{self._out.dtype} CPU tensors, 0 <= step < {plan.cap}."
            )
        failed = self._function(self._pointer, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), step)
        if failed == 1:
            raise MemoryError("DecodeStep: the kernel could not allocate its scratch memory")
        if failed:
            raise RuntimeError(f"DecodeStep: the kernel refused head size {d}")
        return self._out


def _token_inputs(logits: Tensor, labels: Tensor) -> tuple[ctypes.CDLL, int, Tensor] | None:
    """The library, the logits' dtype code and the labels as contiguous int64, where the token kernels take these
    tensors (CPU, float32/bfloat16 logits ``[..., vocab]`` contiguous); else None."""
    code = _cpu_code(logits)
    library = _library() if code is not None else None
    if library is None or code is None or labels.device.type != "cpu" or labels.shape != logits.shape[:-1]:
        return None
    return library, code, labels.contiguous().long()


def token_logprobs(
    logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None:
    """``(logp, lse, entropy, mean)`` of each position of ``logits`` ``[B, T, V]`` at ``temperature`` (float32:
    ``logp`` and ``entropy`` ``[B, T]``, ``lse`` and ``mean`` ``[B, T, 1]``; the last two None without
    ``with_entropy``), or None where the kernel cannot take the tensors. One compiled pass per position, reading its
    ``V`` logits twice while they are in the core's cache (the eager block-wise ops make about six passes over
    blocks of 4 MB), positions split over ``torch.get_num_threads()`` threads. Raises ``IndexError`` for a label
    outside ``[0, V)``. Runs on: worker or controller (``logprobs_and_entropy``).
    """
    found = _token_inputs(logits, labels)
    if found is None:
        return None
    library, code, labels = found
    batch, length, vocab = logits.shape
    logp = torch.empty((batch, length), dtype=torch.float32)
    lse = torch.empty((batch, length, 1), dtype=torch.float32)
    entropy = torch.empty((batch, length), dtype=torch.float32) if with_entropy else None
    mean = torch.empty((batch, length, 1), dtype=torch.float32) if with_entropy else None
    bad = library.token_logprobs(
        logits.data_ptr(), labels.data_ptr(), batch * length, vocab, temperature, code, logp.data_ptr(),
        lse.data_ptr(), entropy.data_ptr() if entropy is not None else None,
        mean.data_ptr() if mean is not None else None, torch.get_num_threads(),
    )  # fmt: skip
    if bad:
        raise IndexError(f"token_logprobs: {bad} label(s) outside [0, {vocab}) (the logits' vocabulary)")
    return logp, lse, entropy, mean


def token_logprobs_backward(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    mean: Tensor | None,
    grad_logp: Tensor,
    grad_entropy: Tensor | None,
    temperature: float,
) -> Tensor | None:
    """The gradient with respect to ``logits`` of ``sum(grad_logp * logp + grad_entropy * entropy)`` (the outputs
    of :func:`token_logprobs`; ``grad_entropy`` and ``mean`` None without an entropy term), in the logits' dtype
    (rounded once), or None where the kernel cannot take the tensors; one compiled pass per position. Raises
    ``IndexError`` for a label outside ``[0, V)``. Runs on: worker or controller (``logprobs_and_entropy``'s backward).
    """
    found = _token_inputs(logits, labels)
    if found is None:
        return None
    library, code, labels = found
    batch, length, vocab = logits.shape
    grad = torch.empty_like(logits)
    stats = [None if t is None else t.contiguous().float() for t in (lse, mean, grad_logp, grad_entropy)]
    bad = library.token_logprobs_backward(
        logits.data_ptr(), labels.data_ptr(), *(None if t is None else t.data_ptr() for t in stats), batch * length,
        vocab, temperature, code, grad.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if bad:
        raise IndexError(f"token_logprobs_backward: {bad} label(s) outside [0, {vocab}) (the logits' vocabulary)")
    return grad


class CastPlan:
    """Fixed pairs of contiguous CPU tensors, float32 sources into bfloat16 destinations of the same sizes, cast in
    one call (:meth:`__call__`: ``dst.copy_(src)`` for each pair, the same values; NaN stays NaN, its bits may differ).
    Build it with :meth:`make`; it keeps the tensors alive. Runs on: worker (a colocated engine's weight hand-off).
    """

    def __init__(self, function: Any, arrays: tuple[Any, Any, Any], count: int, keep: list[Tensor]) -> None:
        self._function, self._arrays, self._count, self._keep = function, arrays, count, keep

    @classmethod
    def make(cls, dsts: list[Tensor], srcs: list[Tensor]) -> CastPlan | None:
        """The plan for these pairs, or None where the kernel cannot take them (not float32 into bfloat16 on CPU,
        not contiguous, sizes that differ, no kernel)."""
        fits = all(
            d.dtype == torch.bfloat16 and s.dtype == torch.float32 and d.numel() == s.numel()
            and d.device.type == s.device.type == "cpu" and d.is_contiguous() and s.is_contiguous()
            for d, s in zip(dsts, srcs, strict=True)
        )  # fmt: skip
        library = _library() if fits and dsts else None
        if library is None:
            return None
        count = len(dsts)
        arrays = (
            (ctypes.c_void_p * count)(*(s.data_ptr() for s in srcs)),
            (ctypes.c_void_p * count)(*(d.data_ptr() for d in dsts)),
            (ctypes.c_long * count)(*(d.numel() for d in dsts)),
        )
        return cls(library.cast_bf16, arrays, count, [*dsts, *srcs])

    def __call__(self) -> None:
        """Cast every source into its destination."""
        self._function(*self._arrays, self._count)
