"""vLLM engine settings on one rank's share of the vs-TRL workload: generation time per setting.

    python benchmarks/bench_vllm_settings.py              # the small model, float32 and bfloat16, 1 thread
    python benchmarks/bench_vllm_settings.py --model m30 --dtypes bfloat16

One rank's generation of the side-by-side workload (``benchmarks/vs_trl/workload.py``: 8 prompts of ~11 tokens x
8 samples, exactly 64 new tokens, temperature 1, the sampled tokens' log-probs), in a vLLM engine built as
:class:`~lightning_rlhf.engines.rollout.vllm.VLLMRolloutEngine` builds it (in process, eager, token ids in and out,
``processed_logprobs``), once per setting, each in a fresh process: the default, prefix caching off, and the
scheduler's sequence cap (``max_num_seqs``) at 16 and 256. One warm-up round, then the median of ``--repeats``.
The model is one of the workload's (``bench.py`` builds them into ``~/.cache/lightning_rlhf/vs_trl``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS: dict[str, dict[str, object]] = {
    "default (prefix caching on)": {},
    "prefix caching off": {"enable_prefix_caching": False},
    "max_num_seqs=16": {"max_num_seqs": 16},
    "max_num_seqs=256": {"max_num_seqs": 256},
}
"""Name -> keyword arguments of ``vllm.LLM`` on top of the engine's own."""


def child(model: str, dtype: str, threads: int, repeats: int, extra: dict[str, object]) -> list[float]:
    """Build the engine with ``extra`` and time the rounds. Runs on: a fresh child process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process, as the trainer runs it
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=128,
        kv_cache_memory_bytes=256 << 20,
        seed=0,
        logprobs_mode="processed_logprobs",
        **extra,
    )
    torch.set_num_threads(threads)
    prompts = [{"prompt_token_ids": [5 + (7 * i + 13 * j) % 900 for i in range(11)]} for j in range(8)]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=64, min_tokens=64, logprobs=0, seed=0)
    llm.generate(prompts, params, use_tqdm=False)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        assert sum(len(c.token_ids) for o in out for c in o.outputs) == 8 * 8 * 64
    return times


def main() -> None:
    """Run every setting in its own process and print the table. Runs on: the caller."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "lightning_rlhf", "vs_trl"))
    p.add_argument("--model", default="small")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: a rank of the 2-process runs)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    path = os.path.join(args.cache, args.model)
    if args.child:
        dtype, extra = json.loads(args.child)
        print("RESULT " + json.dumps(child(path, dtype, args.threads, args.repeats, extra)))
        return
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} does not exist. HINT: `python benchmarks/vs_trl/bench.py --quick` builds it.")
    print(
        f"model {args.model}, 8 prompts x 8 samples x 64 new tokens, {args.threads} thread(s), median of {args.repeats}"
    )
    print("\n| dtype | setting | generate s | tokens/s |")
    print("| --- | --- | ---: | ---: |")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VLLM_LOGGING_LEVEL="ERROR")
    for dtype in args.dtypes.split(","):
        for name, extra in SETTINGS.items():
            cmd = [sys.executable, __file__, "--model", args.model, "--cache", args.cache]
            cmd += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
            cmd += ["--child", json.dumps([dtype, extra])]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(f"| {dtype} | {name} | failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]} | |")
                continue
            seconds = statistics.median(json.loads(lines[-1][len("RESULT ") :]))
            print(f"| {dtype} | {name} | {seconds:.3f} | {8 * 8 * 64 / seconds:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
