"""Asynchronous against lock-step episodes on a workload with uneven tool latency (issue 33).

The tool task's model (``lightning-rlhf/tiny-tools``: it calls a calculator, then answers) runs episodes of the
held-out and training sums on one rollout engine, in this process, with a calculator that sleeps 0-200 ms (the
delay is a hash of the expression, so both modes meet the same delays). Lock-step turns wait for every episode's
tool before the next engine call; asynchronous episodes submit a turn as soon as its own tool has answered (vLLM:
through the engine's request stream; transformers: each call takes the episodes that are ready). Prints and writes
episodes per second of each mode, the median of ``--repeats`` timed runs after a warm-up run.

    python benchmarks/bench_episodes.py --engine vllm --out /tmp/episodes.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from typing import Any

MAX_DELAY_MS = 200


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression with +, - and *.

    Args:
        expression: The expression, e.g. "482+397".
    """
    digest = int(hashlib.md5(expression.encode()).hexdigest(), 16)
    time.sleep((digest % (MAX_DELAY_MS + 1)) / 1000)  # 0-200 ms, the same for the same call in either mode
    # Plain Python only: this function is pickled by value into the tool workers, and importing lightning_rlhf
    # there (torch) on a call's first use would count against the call's timeout.
    a, plus, b = expression.strip().partition("+")
    if not plus or not a.strip().isdigit() or not b.strip().isdigit():
        raise ValueError(f"not a sum of two integers: {expression!r}")
    return str(int(a) + int(b))


async def async_calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression with +, - and *.

    Args:
        expression: The expression, e.g. "482+397".
    """
    import asyncio

    digest = int(hashlib.md5(expression.encode()).hexdigest(), 16)
    await asyncio.sleep((digest % (MAX_DELAY_MS + 1)) / 1000)  # the same delays as `calculator`, waited side by side
    a, plus, b = expression.strip().partition("+")
    if not plus or not a.strip().isdigit() or not b.strip().isdigit():
        raise ValueError(f"not a sum of two integers: {expression!r}")
    return str(int(a) + int(b))


async_calculator.__name__ = "calculator"  # the name the model calls


def main() -> None:
    """Run both modes and report. Runs on: one process (the engine and the tool workers it starts)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--tool-workers", type=int, default=8)
    p.add_argument(
        "--async-tools", action="store_true", help="the calculator as an async def tool (one worker runs every call)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", default=os.environ.get("LIGHTNING_RLHF_CACHE", "/tmp/lightning_rlhf_cache"))
    p.add_argument("--out", default=None, help="JSON file for the figures")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_rlhf.agents.rollout import EpisodeRunner
    from lightning_rlhf.config import RolloutConfig, VLLMConfig
    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.demo.tool_task import CalculatorEnvironment, tool_splits
    from lightning_rlhf.demo.warmstart import prepare_tool_model
    from lightning_rlhf.engines.rollout import SamplingParams

    class SlowCalculator(CalculatorEnvironment):
        tools = (async_calculator if args.async_tools else calculator,)

    model_dir = prepare_tool_model(args.cache)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine: Any
    if args.engine == "vllm":
        from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine, check_vllm_settings

        config = VLLMConfig(load_format="auto")
        max_len = check_vllm_settings(
            model_dir, config, dtype=torch.float32, device_type="cpu", world_size=1, max_prompt_length=64,
            max_new_tokens=192,
        )  # fmt: skip
        engine = VLLMRolloutEngine(
            model_dir, param_names=[n for n, _ in model.named_parameters()], config=config, dtype=torch.float32,
            device=torch.device("cpu"), max_model_len=max_len, tie_word_embeddings=model.config.tie_word_embeddings,
            hf_config=model.config, layer=CPULayer(),
        )  # fmt: skip
    else:
        from lightning_rlhf.engines.rollout.hf import HFRolloutEngine

        engine = HFRolloutEngine(
            model,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            device=torch.device("cpu"),
            decode_loop=CPULayer().decode_loop(),
        )
    splits = tool_splits()
    rows = [dict(r) for r in splits["test"]] + [dict(r) for r in splits["train"]]
    rows = rows[: args.episodes]
    params = SamplingParams(temperature=1.0, max_new_tokens=96, stop_token_ids=(tok.eos_token_id,), seed=3)
    report: dict[str, Any] = {
        "engine": args.engine,
        "episodes": len(rows),
        "tool_workers": "one, async" if args.async_tools else args.tool_workers,
    }
    for mode in ("lock-step", "async"):
        cfg = RolloutConfig(
            max_new_tokens=96, max_turns=3, tool_workers=args.tool_workers, async_episodes=mode == "async"
        )
        runner = EpisodeRunner(SlowCalculator, tok, cfg)
        try:
            runner.run(engine, rows, params)  # warm-up: worker start, engine caches
            walls, calls, gens, tools = [], [], [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                episodes, _, driver = runner.run(engine, rows, params)
                walls.append(time.perf_counter() - t0)
                gens.append(driver.engine_s)
                tools.append(sum(ep.tool_s for ep in episodes))
                calls.append(sum(ep.info.tool_calls for ep in episodes) / len(episodes))
        finally:
            runner.close()
        wall = statistics.median(walls)
        report[mode] = {
            "wall_s": [round(w, 3) for w in walls],
            "episodes_per_s": round(len(rows) / wall, 2),
            "tool_calls_per_episode": round(statistics.mean(calls), 3),
            "engine_s": [round(g, 3) for g in gens],
            "tool_s": [round(t, 3) for t in tools],  # the calls' own seconds, summed over the episodes
        }
        print(
            f"{args.engine} {mode:>9}: {len(rows) / wall:7.2f} episodes/s (wall {[round(w, 3) for w in walls]}, in the "
            f"engine {[round(g, 3) for g in gens]})",
            flush=True,
        )
    report["async_vs_lock_step"] = round(report["async"]["episodes_per_s"] / report["lock-step"]["episodes_per_s"], 3)
    # What no schedule can beat: an asynchronous run lasts at least its engine time, and at least the tools' seconds
    # spread over the workers (one worker runs every call of an async tool at once: no such bound).
    lock_wall = len(rows) / report["lock-step"]["episodes_per_s"]
    floor = statistics.median(report["async"]["engine_s"])
    if not args.async_tools:
        floor = max(floor, statistics.median(report["async"]["tool_s"]) / args.tool_workers)
    report["async_best_possible"] = round(lock_wall / floor, 3)
    print(
        f"{args.engine}: asynchronous / lock-step = {report['async_vs_lock_step']:.2f}x (no schedule beats "
        f"{report['async_best_possible']:.2f}x: lock-step's wall over the asynchronous run's engine time or its tools' "
        "seconds per worker)",
        flush=True,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
