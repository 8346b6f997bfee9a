"""Calibration of the cost model (:mod:`.cost_model`) on this machine: the memory bandwidth, the host time per
layer and per role call, what a model's own shapes reach of the matmul peak, and the per-call costs a calibration
run measured (kept in the embedded models' cache). ``lightning-rlhf plan --device-type cpu`` and
``RLHFStrategy(placement="auto")`` on CPUs use :func:`calibrated_cpu_hardware`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning_rlhf.placement.cost_model import (
    Hardware,
    ModelShape,
    Workload,
    attention_flops,
    core_share,
    cpu_hardware,
    forward_seconds,
    train_seconds,
)

__all__ = [
    "CALL_COSTS_FILE",
    "calibrate_for_shape",
    "calibrated_cpu_hardware",
    "fit_call_costs",
    "measure_call_overhead",
    "measure_host_overheads",
    "measure_memcpy_bw",
    "save_call_costs",
    "with_saved_call_costs",
]


def _best_of(fn: Any, repeats: int, timer: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn``, after one untimed warm-up call."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = timer()
        fn()
        best = min(best, timer() - t0)
    return best


def measure_memcpy_bw(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """This process's memory copy bandwidth, bytes/s (read + write of a ``nbytes`` buffer, best of ``repeats``).
    Runs on: the ``plan`` command's process."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_of(lambda: dst.copy_(src), repeats)


def measure_host_overheads(repeats: int = 5, *, timer: Callable[[], float] = time.thread_time) -> tuple[float, float]:
    """``(layer_step_s, layer_micro_s)`` of this machine: the host time per decoder layer of one decoding step
    (the transformers engine's own loop) and of one training micro-batch (forward and backward), from the
    difference between a 1-layer and a 5-layer random Qwen2 of width 32, where the arithmetic is negligible.

    Runs on: the calling process (about 2 s). ``timer`` defaults to the thread's CPU time, so time other jobs take
    is not counted (the cost model wants a process with a core to itself). Each size is timed ``repeats`` times, the
    two in turn (a burst of load falls on both alike), keeping its fastest time; a negative cost is taken as 0 with
    a warning. Raises ``ValueError`` for ``repeats`` below 1.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.engines.rollout.base import SamplingParams

    if repeats < 1:
        raise ValueError(f"measure_host_overheads(repeats={repeats}): expected at least 1.")
    steps = 32
    params = SamplingParams(n=1, max_new_tokens=steps, min_new_tokens=steps)
    prompts = [[3, 4, 5, 6]] * 8
    ids = torch.randint(2, 64, (4, 16))
    cpu = torch.device("cpu")

    def decode(model: Any) -> None:
        CPULayer().decode_loop().sample_loop(model.eval(), prompts, params, stops={1}, pad_token_id=0, device=cpu)

    def train(model: Any) -> None:
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()

    models = {}
    for layers in (1, 5):
        config = Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64,
        )  # fmt: skip
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        models[layers] = Qwen2ForCausalLM(config)
        decode(models[layers])  # warm-up, untimed
        train(models[layers])
    best = {(layers, kind): math.inf for layers in models for kind in ("decode", "train")}
    for _ in range(repeats):
        for layers, model in models.items():
            for kind, fn in (("decode", decode), ("train", train)):
                t0 = timer()
                fn(model)
                best[layers, kind] = min(best[layers, kind], timer() - t0)
    step_s = (best[5, "decode"] - best[1, "decode"]) / 4 / steps
    micro_s = (best[5, "train"] - best[1, "train"]) / 4
    return _not_negative("layer_step_s", step_s), _not_negative("layer_micro_s", micro_s)


def _not_negative(name: str, value: float) -> float:
    """``value``, or 0 with a warning when it is negative: a measured cost below 0 would predict faster steps for
    more work."""
    if value >= 0:
        return value
    import warnings

    warnings.warn(
        f"measure_host_overheads: {name} came out {value:.3g} s (the 5-layer model timed faster than the 1-layer "
        "one: the machine was busy while it measured); taken as 0. HINT: plan on an idle machine for this figure.",
        RuntimeWarning,
        stacklevel=3,
    )
    return 0.0


def calibrate_for_shape(hw: Hardware, model: ModelShape, wl: Workload, repeats: int = 2) -> Hardware:
    """``hw`` with its efficiency factors measured on this process for ``model``'s width: a training micro-batch,
    a no-grad forward and a decoding step of a 2-layer random Qwen2 of the same hidden size, MLP, heads and
    vocabulary, timed (best of ``repeats``), the per-layer host time subtracted, and divided by their FLOPs at
    ``hw.flops``.

    Runs on: the calling process, on CPUs, with its thread count (seconds). These factors correct what the
    large-matmul peak overstates of a small model's shapes. Returns a new :class:`Hardware`.
    """

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.engines.rollout.base import SamplingParams

    layers = 2
    # Sized to take seconds whatever the model and workload: at most 512 positions, 1,024 tokens per micro-batch and
    # a 32,768-entry vocabulary (the factors are rates; the attention's share at longer lengths, and the head's at
    # larger vocabularies, are the cost model's own arithmetic).
    shape = dataclasses.replace(model, layers=layers, vocab=min(model.vocab, 32768))
    prompt_len = max(1, min(wl.prompt_len, 256))
    response_len = max(1, min(wl.response_len, 512 - prompt_len))
    wl = Workload(
        prompts=wl.prompts, n=wl.n, prompt_len=prompt_len, response_len=response_len,
        micro_tokens=min(wl.micro_tokens, 1024),
    )  # fmt: skip
    config = Qwen2Config(
        vocab_size=shape.vocab, hidden_size=model.hidden, intermediate_size=model.intermediate,
        num_hidden_layers=layers, num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
        max_position_embeddings=wl.prompt_len + wl.response_len + 1, tie_word_embeddings=model.tied,
    )  # fmt: skip
    config.head_dim = model.dim
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    net = Qwen2ForCausalLM(config)
    length = wl.prompt_len + wl.response_len
    rows = max(1, wl.micro_tokens // length)
    ids = torch.randint(0, shape.vocab, (rows, length))
    sub = Workload(prompts=rows, n=1, prompt_len=wl.prompt_len, response_len=wl.response_len)

    def train() -> None:
        net.train()
        net(input_ids=ids, labels=ids).loss.backward()
        net.zero_grad(set_to_none=True)

    def forward() -> None:
        with torch.no_grad():
            net.eval()(input_ids=ids)

    batch = max(1, min(64, wl.sequences))
    steps = min(16, wl.response_len)
    params = SamplingParams(n=1, max_new_tokens=steps, min_new_tokens=steps)
    prompts = [[int(t) for t in ids[0, : min(8, wl.prompt_len)]]] * batch  # a short context: the weights dominate

    def decode() -> None:
        CPULayer().decode_loop().sample_loop(
            net.eval(), prompts, params, stops=set(), pad_token_id=0, device=torch.device("cpu")
        )

    # One thread: its CPU time is what the work takes with a core to itself, whatever else runs on the machine.
    # Several: wall time (CPU time would count every thread's share, and their waits).
    timer = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    t_train = _best_of(train, repeats, timer) - layers * hw.layer_micro_s
    t_forward = _best_of(forward, repeats, timer) - layers * hw.layer_micro_s / 3
    t_step = _best_of(decode, repeats, timer) / steps - layers * hw.layer_step_s
    train_flops = 6.0 * shape.matmul_params * sub.tokens + 3 * attention_flops(shape, sub)
    forward_flops = 2.0 * shape.matmul_params * sub.tokens + attention_flops(shape, sub)
    step_flops = 2.0 * shape.matmul_params * batch
    return dataclasses.replace(
        hw,
        train_eff=min(1.0, train_flops / (max(t_train, 1e-9) * hw.flops)),
        forward_eff=min(1.0, forward_flops / (max(t_forward, 1e-9) * hw.flops)),
        decode_eff=min(1.0, step_flops / (max(t_step, 1e-9) * hw.flops)),
    )


def fit_call_costs(
    hw: Hardware,
    model: ModelShape,
    wl: Workload,
    devices: int,
    *,
    forward_s: Sequence[float],
    train_s: Sequence[float],
) -> Hardware:
    """``hw`` with ``call_s`` and ``train_call_s`` fitted to a measured run: the median time each no-grad forward
    call (``forward_s``) and each training call (``train_s``) took beyond what the cost model gives its compute,
    all calls of the run on one pool of ``devices``.

    Runs on: any process (arithmetic). Times measured on oversubscribed CPU cores are scaled back by
    :func:`core_share`. Returns a new :class:`Hardware`; the costs are never negative.
    """
    import statistics

    bare = dataclasses.replace(hw, call_s=0.0, train_call_s=0.0)
    forward = forward_seconds(model, wl, bare, devices)
    train = train_seconds(model, wl, bare, devices)
    share = core_share(cores=hw.cores, processes=devices, threads=hw.threads)
    call_s = max(0.0, statistics.median(t * share - forward for t in forward_s)) if forward_s else hw.call_s
    extra = max(0.0, statistics.median(t * share - train for t in train_s) - call_s) if train_s else hw.train_call_s
    return dataclasses.replace(hw, call_s=call_s, train_call_s=extra)


CALL_COSTS_FILE = "placement_call_costs.json"
"""The file, in the embedded models' cache folder, where a calibration run (``benchmarks/placement_validation.py``)
leaves the call costs it fitted, for ``plan --device-type cpu`` and ``placement="auto"`` on the same machine."""


def _call_costs_entry(model: ModelShape, processes: int, cache_dir: str | None) -> tuple[str, str]:
    """The file of the saved call costs, and the key of ``model``'s on this CPU with ``processes`` ranks."""
    import os

    from lightning_rlhf.config.models import embedded_cache_dir
    from lightning_rlhf.perf import cpu_model_name

    shape = f"{model.layers}x{model.hidden}x{model.intermediate}x{model.vocab}"
    key = f"{cpu_model_name()} | processes={processes} | {shape}"
    return os.path.join(cache_dir or embedded_cache_dir(), CALL_COSTS_FILE), key


def save_call_costs(hw: Hardware, model: ModelShape, processes: int, *, cache_dir: str | None = None) -> str:
    """Keep ``hw``'s fitted ``call_s`` and ``train_call_s`` for ``model`` on this CPU with ``processes`` ranks; returns
    the file. Runs on: the calibration run's driver."""
    from lightning_rlhf.perf import read_json, write_json

    path, key = _call_costs_entry(model, processes, cache_dir)
    table = read_json(path)
    table[key] = {"call_s": hw.call_s, "train_call_s": hw.train_call_s}
    write_json(path, table)
    return path


def with_saved_call_costs(hw: Hardware, model: ModelShape, processes: int, *, cache_dir: str | None = None) -> Hardware:
    """``hw`` with the call costs a calibration run left for ``model`` on this CPU with ``processes`` ranks, if it
    left any (else ``hw`` as it is). Runs on: the planning process (``plan --device-type cpu``, ``"auto"``)."""
    from lightning_rlhf.perf import read_json

    path, key = _call_costs_entry(model, processes, cache_dir)
    entry = read_json(path).get(key)
    if not isinstance(entry, dict):
        return hw
    return dataclasses.replace(
        hw, call_s=float(entry.get("call_s", hw.call_s)), train_call_s=float(entry.get("train_call_s", 0.0))
    )


def measure_call_overhead(rows: int = 64, length: int = 48, repeats: int = 5) -> float:
    """Seconds of host work one role call costs besides its compute, on this machine: what the control plane does to
    a rollout batch of ``rows`` x ``length`` tokens for 2 ranks (split it, pickle each part and unpickle it, as the
    scatter does; pickle and unpickle the results, as the gather does; merge them), best of ``repeats``, in the
    thread's CPU time; not the transport itself. Runs on: the calling process (a fraction of a second).
    """
    import pickle

    import torch

    from lightning_rlhf.batch import Batch
    from lightning_rlhf.controller.dispatch import Dispatch, merge_results, split_args

    def one_batch() -> Batch:
        return Batch(
            {
                "input_ids": torch.randint(0, 4096, (rows, length)),
                "attention_mask": torch.ones(rows, length, dtype=torch.long),
                "prompt_mask": torch.ones(rows, length // 3, dtype=torch.bool),
                "response_mask": torch.ones(rows, length - length // 3, dtype=torch.bool),
                "logprobs": torch.randn(rows, length - length // 3),
                "scores": torch.rand(rows),
            },
            {"prompt": [f"Add {i} and {i}. Answer:" for i in range(rows)], "answer": [str(i) for i in range(rows)]},
        )

    def call() -> None:
        parts = split_args(Dispatch.DP_SPLIT, (one_batch(),), {}, 2, where="calibration")
        results = [pickle.loads(pickle.dumps(part))[0][0] for part in parts if part is not None]
        merge_results(Dispatch.DP_SPLIT, [pickle.loads(pickle.dumps(r)) for r in results])

    return _best_of(call, repeats, timer=time.thread_time)


def calibrated_cpu_hardware(
    model: ModelShape, wl: Workload, *, processes: int, memory: float, threads: int
) -> Hardware:
    """This machine as the cost model sees it for ``processes`` processes of ``threads`` threads (each with
    ``memory`` bytes) running ``model`` on ``wl``: the matmul peak of one process, the memory bandwidth, the host time
    per layer and per role call, what the model's shapes reach of the peak, the cores the processes share, and the
    per-call costs a calibration run saved here, if any. Runs on: the ``plan`` command's process, or rank 0 for
    ``placement="auto"`` (a few seconds).
    """
    import torch

    from lightning_rlhf.perf import available_cores, cpu_matmul_peak

    layer_step_s, layer_micro_s = measure_host_overheads()
    hardware = cpu_hardware(
        flops=cpu_matmul_peak(torch.float32), memcpy_bw=measure_memcpy_bw(), memory=memory, processes=processes,
        layer_step_s=layer_step_s, layer_micro_s=layer_micro_s, call_s=measure_call_overhead(),
        cores=available_cores(), threads=threads,
    )  # fmt: skip
    return with_saved_call_costs(calibrate_for_shape(hardware, model, wl), model, processes)
