"""The causal LM head and the token log-probs: the whole ``[T, V]`` logits against the blocked head
(``engines/train/head.py``), at a real vocabulary: peak memory and time of a training forward + backward, and of a
scoring forward; optionally with activation checkpointing (``engines/train/checkpointing.py``), in bfloat16 and on a
CUDA GPU.

    python benchmarks/bench_token_head.py                       # Qwen2.5-0.5B's width, 2 layers, 2 x 578 tokens
    python benchmarks/bench_token_head.py --layers 24 --repeats 2
    python benchmarks/bench_token_head.py --device cuda --dtype bf16 --layers 24 --rows 1 \
        --resp-len 512,2048,8192 --activation-checkpointing both --passes train --repeats 2   # gpu_check.sh's size

Model: ``build_family("qwen2.5-0.5b", layers=--layers)`` (hidden 896, vocabulary 151,936, tied embeddings; random
weights, built locally once; 24 layers is the published depth), loaded in ``--dtype`` (float32 or bfloat16) on
``--device``, no FSDP. Workload: ``--rows`` rows of ``--prompt-len`` prompt + ``--resp-len`` response tokens (a
comma-separated list: one measurement per length); a GRPO-style training pass is a forward and a backward of the
loss ``-mean(logp * advantage) - 0.01 mean(entropy)`` (one advantage per row; no optimizer step: its state does not
depend on the length), a scoring pass a forward without gradients. ``--activation-checkpointing`` (off, on, both)
checkpoints every decoder block with the library's own function for the training passes. Every measurement is one
warm-up pass, then the measured one(s); whole and blocked head alternate.

On CPU (the default) each measurement is a child process (``--repeats`` of each, the median reported); the parent
reads the child's peak resident memory from outside (``os.wait4``'s ``ru_maxrss``), less a child that only loads the
model; time: the child's CPU time of the measured pass. On CUDA (or with ``--in-process``) the model is loaded once
and every measurement runs in this process: ``--repeats`` measured passes after the warm-up, the peak of
``torch.cuda.max_memory_allocated`` (reset before each pass; on CPU the resident high-water mark, reset through
``/proc/self/clear_refs``) less the memory at rest (the weights), the median wall time between
``torch.cuda.synchronize()`` calls (on CPU, CPU time); a measurement that runs out of GPU memory is reported as
``OOM``. Prints a markdown table (row by row) and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_rlhf.batch import Batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CHECKPOINTING = {"off": (False,), "on": (True,), "both": (False, True)}
HEADS = ("whole", "blocked")
MIB = 1 << 20


@dataclass(frozen=True)
class Case:
    """One measurement: a training (``train``) or scoring pass, with or without activation checkpointing (a scoring
    pass has no backward: always without), at ``resp_len`` response tokens, with the ``whole`` or ``blocked`` head."""

    train: bool
    checkpointing: bool
    resp_len: int
    head: str

    @property
    def key(self) -> str:
        """The measurement's name in the JSON line, e.g. ``train/ckpt/blocked/2048``."""
        kind = "train" if self.train else "score"
        return f"{kind}/{'ckpt' if self.checkpointing else 'no-ckpt'}/{self.head}/{self.resp_len}"


def cases(args: argparse.Namespace) -> list[Case]:
    """Every measurement asked for, in order: checkpointing, pass, length, head. Runs on: parent."""
    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    settings = CHECKPOINTING[args.activation_checkpointing]
    out = []
    for ckpt in settings:
        for kind in passes:
            if kind == "score" and ckpt != settings[0]:
                continue  # a scoring pass has no backward, so nothing to checkpoint: measured once
            for resp_len in args.resp_lens:
                out += [Case(kind == "train", ckpt and kind == "train", resp_len, head) for head in HEADS]
    return out


def load_model(args: argparse.Namespace) -> nn.Module:
    """The family model of ``--model-path`` in ``--dtype`` on ``--device``. Runs on: the measuring process (child on
    CPU, parent with ``--in-process``)."""
    from transformers import AutoModelForCausalLM

    model: nn.Module = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=DTYPES[args.dtype])
    return model.to(torch.device(args.device))


def set_checkpointing(model: nn.Module, on: bool) -> None:
    """Activation checkpointing of every decoder block on (the library's ``enable_activation_checkpointing``, as the
    training engine applies it) or off. Runs on: the measuring process."""
    from lightning_rlhf.engines.train.checkpointing import enable_activation_checkpointing

    if on:
        enable_activation_checkpointing(model, setting="bench_token_head")
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()  # type: ignore[operator]


def make_batch(rows: int, prompt_len: int, resp_len: int, device: torch.device) -> tuple[Batch, torch.Tensor]:
    """``(Batch of token ids and masks on the host, advantages [rows, 1] on device)``, the same for every call.
    ``forward_response`` moves the ids to the model's device. Runs on: the measuring process."""
    from lightning_rlhf.batch import Batch

    g = torch.Generator().manual_seed(0)
    batch = Batch(
        {
            "prompts": torch.randint(10, 1000, (rows, prompt_len), generator=g),
            "prompt_mask": torch.ones(rows, prompt_len, dtype=torch.long),
            "responses": torch.randint(10, 1000, (rows, resp_len), generator=g),
            "response_mask": torch.ones(rows, resp_len, dtype=torch.long),
        }
    )
    return batch, torch.randn(rows, 1, generator=g).to(device)


def one_pass(model: nn.Module, batch: Batch, advantages: torch.Tensor, train: bool) -> None:
    """One training (forward + backward, gradients dropped after) or scoring pass of the current head setting.
    Runs on: the measuring process."""
    from lightning_rlhf.engines.train import forward_response

    model.train(train)  # transformers checkpoints the blocks only in training mode
    with torch.set_grad_enabled(train):
        out = forward_response(model, batch, output="logprobs", with_entropy=True)
        if train:
            loss = -(out["logprobs"] * advantages).mean() - 0.01 * out["entropy"].mean()
            loss.backward()
            model.zero_grad(set_to_none=True)


_BLOCKS: list[int] = []  # the library's HEAD_CHUNK_ELEMENTS, read before the first change


def set_head(mode: str) -> None:
    """``whole``: the head's logits in one piece whatever their size; ``blocked``: the library's default blocks
    (``HEAD_CHUNK_ELEMENTS``). Runs on: the measuring process."""
    from lightning_rlhf.engines.train import head

    if not _BLOCKS:
        _BLOCKS.append(head.HEAD_CHUNK_ELEMENTS)
    head.HEAD_CHUNK_ELEMENTS = 1 << 62 if mode == "whole" else _BLOCKS[0]


def child(args: argparse.Namespace) -> None:
    """One measured pass (``--mode``: ``load``, ``whole`` or ``blocked``; ``--train`` or a scoring forward; one
    ``--resp-len``). Runs on: child."""
    torch.set_num_threads(args.threads)
    model = load_model(args)
    if args.mode == "load":
        print(json.dumps({"cpu_s": 0.0}))
        return
    set_head(args.mode)
    set_checkpointing(model, args.activation_checkpointing == "on")
    batch, advantages = make_batch(args.rows, args.prompt_len, args.resp_lens[0], torch.device(args.device))
    one_pass(model, batch, advantages, args.train)
    start = time.process_time()
    one_pass(model, batch, advantages, args.train)
    print(json.dumps({"cpu_s": time.process_time() - start}))


def run_child(args: argparse.Namespace, case: Case | None) -> tuple[float, float]:
    """(peak MiB, CPU seconds) of one child (``case`` None: one that only loads the model). Runs on: parent."""
    cmd = [sys.executable, __file__, "--child", "--model-path", args.model_path, "--dtype", args.dtype]
    cmd += ["--rows", str(args.rows), "--prompt-len", str(args.prompt_len), "--threads", str(args.threads)]
    if case is None:
        cmd += ["--mode", "load"]
    else:
        cmd += ["--mode", case.head, "--resp-len", str(case.resp_len)]
        cmd += ["--activation-checkpointing", "on" if case.checkpointing else "off"]
        cmd += ["--train"] if case.train else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    out = proc.stdout.read() if proc.stdout else ""
    if status:
        raise SystemExit(f"child {case} failed ({status}): {out}")
    return usage.ru_maxrss / 1024, json.loads(out.strip().splitlines()[-1])["cpu_s"]


class Meter:
    """Memory (MiB) and clock of the measuring process: CUDA's allocator and synchronized wall time on a GPU, the
    resident set (``/proc/self/status``) and CPU time on the host. Runs on: the measuring process."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        """The memory in use now."""
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated() / MIB
        return _status("VmRSS")

    def reset(self) -> None:
        """Start a new peak at the memory in use now."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to VmRSS (Linux >= 4.0)

    def peak(self) -> float:
        """The peak since the last :meth:`reset`."""
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / MIB
        return _status("VmHWM")

    def clock(self) -> float:
        """Seconds: wall time after the GPU's queued work is done, or this process's CPU time."""
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()


def _status(field: str) -> float:
    """``field`` of /proc/self/status in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def measure_in_process(
    model: nn.Module, case: Case, args: argparse.Namespace, meter: Meter
) -> tuple[float, float, float] | None:
    """(peak MiB, peak over the memory at rest MiB, median seconds) of ``case``: a warm-up pass, then ``--repeats``
    measured ones; None when the GPU ran out of memory. Runs on: parent (``--in-process``, always on CUDA)."""
    set_head(case.head)
    set_checkpointing(model, case.checkpointing)
    batch, advantages = make_batch(args.rows, args.prompt_len, case.resp_len, torch.device(args.device))
    peaks, over, seconds = [], [], []
    try:
        one_pass(model, batch, advantages, case.train)
        for _ in range(args.repeats):
            meter.reset()
            rest = meter.now()
            start = meter.clock()
            one_pass(model, batch, advantages, case.train)
            seconds.append(meter.clock() - start)
            peaks.append(meter.peak())
            over.append(peaks[-1] - rest)
    except RuntimeError as err:  # torch.cuda.OutOfMemoryError, or a GPU library's failed allocation
        if not isinstance(err, torch.cuda.OutOfMemoryError) and "out of memory" not in str(err).lower():
            raise
        failed = True
    else:
        failed = False
    if failed:  # outside the handler: its traceback (and the tensors of the failed pass) are gone
        model.zero_grad(set_to_none=True)
        gc.collect()
        if meter.cuda:
            torch.cuda.empty_cache()
        return None
    return max(peaks), max(over), statistics.median(seconds)


def _row(case: Case, peak: float | None, over: float | None, seconds: float | None) -> str:
    kind = "train" if case.train else "score"
    ckpt = ("on" if case.checkpointing else "off") if case.train else "-"
    if peak is None or over is None or seconds is None:
        return f"| {kind} | {ckpt} | {case.head} | {case.resp_len} | OOM | OOM | OOM |"
    return f"| {kind} | {ckpt} | {case.head} | {case.resp_len} | {peak:,.0f} | {over:,.0f} | {seconds:.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=66)
    parser.add_argument("--resp-len", default="512", help="response tokens; a comma-separated list: one per length")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--activation-checkpointing", choices=tuple(CHECKPOINTING), default="off")
    parser.add_argument("--passes", default="train,score", help="train, score or both (comma-separated)")
    parser.add_argument("--in-process", action="store_true", help="measure in this process (always on CUDA)")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--mode", default="whole")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--model-path", default="")
    args = parser.parse_args()
    args.resp_lens = [int(x) for x in args.resp_len.split(",") if x.strip()]
    if args.child:
        child(args)
        return
    from lightning_rlhf.config.models import embedded_cache_dir
    from lightning_rlhf.demo import warmstart
    from lightning_rlhf.demo.families import build_family

    torch.set_num_threads(args.threads)
    name = f"bench-qwen2.5-0.5b-{args.layers}l"
    args.model_path = warmstart.build_once(
        embedded_cache_dir(),
        name,
        lambda tmp: build_family("qwen2.5-0.5b", os.path.join(tmp, "model"), layers=args.layers),
    )
    in_process = args.in_process or args.device == "cuda"
    device = torch.device(args.device)
    info: dict[str, object] = {"device": args.device, "dtype": args.dtype, "layers": args.layers, "rows": args.rows}
    info |= {"prompt_len": args.prompt_len, "repeats": args.repeats, "in_process": in_process}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if in_process:
        meter = Meter(device)
        model = load_model(args)
        base = meter.now()
    else:
        base = run_child(args, None)[0]
    info["model_mib"] = round(base)  # at rest: the weights on CUDA, a child that only loads the model on CPU
    clock = "wall s" if device.type == "cuda" else "CPU s"
    memory = "max_memory_allocated" if device.type == "cuda" else "resident"
    print(json.dumps(info), flush=True)
    print(f"| pass | checkpointing | head | response | peak {memory} (MiB) | over the loaded model (MiB) | {clock} |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |", flush=True)
    figures: dict[str, object] = {}
    todo = cases(args)
    if in_process:
        for case in todo:
            got = measure_in_process(model, case, args, meter)
            peak, over, seconds = got if got is not None else (None, None, None)
            figures[case.key] = "OOM" if got is None else {"peak_mib": peak, "over_mib": over, "s": seconds}
            print(_row(case, peak, over, seconds), flush=True)
    else:
        samples: dict[Case, list[tuple[float, float]]] = {case: [] for case in todo}
        for _ in range(args.repeats):
            for case in todo:  # whole and blocked alternate
                samples[case].append(run_child(args, case))
        for case, runs in samples.items():
            peak = statistics.median(m for m, _ in runs)
            seconds = statistics.median(c for _, c in runs)
            figures[case.key] = {"peak_mib": peak, "over_mib": peak - base, "s": seconds}
            print(_row(case, peak, peak - base, seconds), flush=True)
    print(json.dumps({**info, "tokens": [args.prompt_len + r for r in args.resp_lens], **figures}))


if __name__ == "__main__":
    main()
