"""Attention kernels on CPU: one training forward + backward per (dtype, ``attn_implementation``).

    python benchmarks/bench_attention.py                    # the vs-TRL small model, 32 x (11 + 64) tokens
    python benchmarks/bench_attention.py --rows 8 --prompt-len 256 --resp-len 256 --threads 2

The model is the side-by-side benchmark's ``small`` (``bench.py`` builds it into
``~/.cache/lightning_rlhf/vs_trl/small``). One step is ``forward_response`` (logits at the response positions,
block-wise log-probs) plus ``backward`` of their mean, as the actor update runs it; the model is held in the dtype
(as FSDP2's ``param_dtype`` computes). Two warm-up steps, then the median of ``--repeats``; with
``--profile``, the top operators of one more step. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def model_dir(cache: str) -> str:
    """The small vs-TRL model's folder, built once. Runs on: this process."""
    path = os.path.join(cache, "small")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"{path} does not exist. HINT: run `python benchmarks/vs_trl/bench.py --quick` once (it builds the "
            "workload's models), or pass --cache."
        )
    return path


def main() -> None:
    """Time the configurations and print the table. Runs on: this process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "lightning_rlhf", "vs_trl"))
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=11)
    p.add_argument("--resp-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--kernels", default="sdpa,eager")
    p.add_argument("--profile", action="store_true", help="print the top operators of each configuration")
    p.add_argument(
        "--compile", action="store_true", help="also each configuration with its decoder layers torch.compile'd"
    )
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_rlhf.batch import Batch
    from lightning_rlhf.engines.train.forward import forward_response

    torch.set_num_threads(args.threads)
    path = model_dir(args.cache)
    g = torch.Generator().manual_seed(0)
    rows, plen, rlen = args.rows, args.prompt_len, args.resp_len
    batch = Batch(
        {
            "prompts": torch.randint(5, 4000, (rows, plen), generator=g),
            "prompt_mask": torch.ones(rows, plen, dtype=torch.long),
            "responses": torch.randint(5, 4000, (rows, rlen), generator=g),
            "response_mask": torch.ones(rows, rlen, dtype=torch.long),
        }
    )
    print(f"small model, {rows} x ({plen} + {rlen}) tokens, {args.threads} thread(s), median of {args.repeats}\n")
    print("| dtype | attn_implementation | torch.compile | forward + backward s | compile + warm-up s |")
    print("| --- | --- | --- | ---: | ---: |")
    for dtype_name in args.dtypes.split(","):
        for kernel, compiled in [(k, c) for k in args.kernels.split(",") for c in [False, True][: 1 + args.compile]]:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=getattr(torch, dtype_name), attn_implementation=kernel
            )
            t_setup = time.perf_counter()
            if compiled:  # per decoder layer, as torchtitan does before FSDP2 wraps them
                for layer in model.model.layers:
                    layer.compile(dynamic=True)

            def step(model: torch.nn.Module = model) -> None:
                out = forward_response(model, batch, output="logprobs")
                out["logprobs"].float().mean().backward()

            for _ in range(2):
                step()
            setup = time.perf_counter() - t_setup
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            print(
                f"| {dtype_name} | {kernel} | {'yes' if compiled else 'no'} | {statistics.median(times):.3f} | "
                f"{setup:.1f} |",
                flush=True,
            )
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
