"""The transformers engine's decoding loop, one rank's share of the vs-TRL step, A/B on one switch.

    python benchmarks/bench_decode.py                      # small model, fp32 and bf16, 1 thread
    python benchmarks/bench_decode.py --models small,tiny --repeats 8

One rank's share of the benchmark's step (8 prompts x 8 samples x 64 new tokens, EOS held back) on the workload's
randomly initialised Qwen2 model (``vs_trl/workload.py``'s shapes), prompts of 9-13 random tokens. The variants
alternate in one process (``A B A B ...``) so that a slow moment of the machine hits both; the median of each is
printed, and the last line is one JSON object. Variants (:data:`VARIANTS`): ``eager`` (PyTorch ops only),
``attention`` (the decoding step's attention through the compiled kernel of ``lightning_rlhf/cpu/native``),
``kernels`` (the attention, the RMS norms and the SiLU-gated products compiled), ``step`` (as ``kernels``, with the
rotary embedding, the cache writes and the attention of a decoding step as one compiled call: ``DecodeStep``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "vs_trl"))

from workload import MODELS, random_model

from lightning_rlhf.cpu import decode as decode_module
from lightning_rlhf.cpu import native
from lightning_rlhf.engines.rollout import SamplingParams


def build(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The workload's model of that name (its random weights), in ``dtype``."""
    return random_model(MODELS[name], pad_id=0, bos_id=2, eos_id=1).to(dtype).eval()


VARIANTS = ("eager", "attention", "kernels", "step")
"""Eager ops only; the compiled attention step only; the compiled attention, RMS norms and SiLU products; those and
the whole decoding step's attention (rotation, cache writes, attention) as one compiled call."""
_RMS_NORM, _SILU_MUL, _STEP = native.rms_norm, native.silu_mul, native.DecodeStep.make


def use(variant: str) -> None:
    """Switch the decoding loop to one of :data:`VARIANTS`."""
    decode_module._native_kernels = lambda cache: variant != "eager" and cache.keys[0].device.type == "cpu"  # type: ignore[attr-defined]
    off = lambda *args, **kwargs: None  # noqa: E731
    native.rms_norm = _RMS_NORM if variant in ("kernels", "step") else off  # type: ignore[assignment]
    native.silu_mul = _SILU_MUL if variant in ("kernels", "step") else off  # type: ignore[assignment]
    native.DecodeStep.make = _STEP if variant == "step" else off  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="small")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=6, help="calls per variant (alternated)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not native.native_attention_available():
        raise SystemExit("the decoding attention kernel is not available here (no C compiler?)")
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(2, 200, (int(torch.randint(9, 14, (1,), generator=generator)),), generator=generator).tolist()
        for _ in range(8)
    ]
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=64, min_new_tokens=64, seed=0)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    summary: dict[str, float] = {}
    for name in args.models.split(","):
        for precision in args.precisions.split(","):
            model = build(name, dtypes[precision])
            times: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for i in range(len(VARIANTS) * (args.repeats + 1)):  # the first round warms up
                variant = VARIANTS[i % len(VARIANTS)]
                use(variant)
                torch.manual_seed(0)
                start = time.perf_counter()
                decode_module.sample_loop(model, prompts, params, stops={1}, pad_token_id=0, device=torch.device("cpu"))
                if i >= len(VARIANTS):
                    times[variant].append(time.perf_counter() - start)
            use("step")
            medians = {variant: statistics.median(values) for variant, values in times.items()}
            eager = medians["eager"]
            cells = ", ".join(f"{v} {medians[v]:.3f} s ({medians[v] / eager - 1:+.1%})" for v in VARIANTS[1:])
            print(f"{name} {precision}: eager {eager:.3f} s, {cells}")
            summary |= {f"{name}_{precision}_{variant}_s": round(medians[variant], 4) for variant in VARIANTS}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
