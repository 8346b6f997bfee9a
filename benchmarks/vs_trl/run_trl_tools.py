"""TRL 1.16's ``GRPOTrainer`` with ``tools=`` on the embedded tool task; run by ``bench_tools.py`` with
``.venv-trl``'s python (it cannot import lightning_rlhf: the model folder, the prompts and the answers come in).

    .venv-trl/bin/python benchmarks/vs_trl/run_trl_tools.py --model-dir DIR --data recipes/data/tools_train.jsonl \
        --steps 10 --out run.json

The workload is the demo's ``--task tools``: 16 prompts x 8 samples per step, temperature 1, up to 2 tool rounds
(3 assistant turns), one optimizer step per generation, lr 3e-4, no KL. TRL renders the prompt with ``tools=`` through
the model's tool chat template and reads the calls with ``tokenizer.parse_response``; the template is not one TRL
knows, so its ``response_template`` is set here (the same Hermes calls lightning_rlhf parses). TRL runs its tools in
its own process, one call after another, between lock-step generations. Writes one JSON object with a record per
optimizer step (its seconds and the episodes it trained on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import workload as W  # noqa: E402  (the workload file sits next to this script: stdlib, torch, transformers)

PROMPTS, SAMPLES, TURN_TOKENS, TOOL_ROUNDS, LR = 16, 8, 96, 2, 3e-4


def _load_calculator() -> Any:
    """The demo's ``calculator`` (``lightning_rlhf/demo/calculator.py``, standard library only), loaded by its path:
    this venv has no lightning_rlhf, and importing it as part of the package would need one."""
    import importlib.util

    path = os.path.join(ROOT, "lightning_rlhf", "demo", "calculator.py")
    spec = importlib.util.spec_from_file_location("demo_calculator", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.calculator


def reward(completions: list[list[dict[str, Any]]], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the last assistant message is the sum (as the demo's environment scores an episode)."""
    out = []
    for messages, ans in zip(completions, answer, strict=True):
        last = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
        text = str(last.get("content") or "").strip()
        out.append(1.0 if not last.get("tool_calls") and text == ans.strip() else 0.0)
    return out


RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"</s>\s*", "content": "text"},
    },
}
"""How ``parse_response`` reads an assistant turn of the demo's tool template (``lightning_rlhf.demo.tool_task``)."""


def main() -> None:
    """Train with TRL and write the per-step records. Runs on: the TRL venv's process."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data", required=True, help="jsonl with prompt and answer")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    torch.set_num_threads(args.threads)
    with open(args.data) as f:
        rows = [json.loads(line) for line in f]
    rows = (rows * (1 + args.steps * PROMPTS // len(rows)))[: args.steps * PROMPTS]
    data = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    tok.response_template = RESPONSE_TEMPLATE
    samples = PROMPTS * SAMPLES
    config = trl.GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_tools_out"),
        num_generations=SAMPLES,
        generation_batch_size=samples,
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_steps=args.steps,
        max_completion_length=TURN_TOKENS * (TOOL_ROUNDS + 1),
        max_tool_calling_iterations=TOOL_ROUNDS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=0,
        beta=0.0,
        loss_type="dapo",
        use_cpu=True,
        bf16=False,
        seed=0,
        **W.TRL_PLAIN_RUN,
    )
    trainer = trl.GRPOTrainer(
        model=args.model_dir,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        tools=[_load_calculator()],
    )
    records: list[dict[str, Any]] = []
    rewards: list[float] = []

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        """Times each optimizer step (on_step_begin -> on_step_end). Runs on: the TRL process."""

        t0 = 0.0

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            records.append({"step": time.perf_counter() - self.t0, "episodes": samples})

        def on_log(
            self, _args: Any, _state: Any, _control: Any, logs: dict[str, float] | None = None, **kw: Any
        ) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer.add_callback(StepTimer())
    trainer.train()
    with open(args.out, "w") as f:
        json.dump(
            {
                "side": "trl",
                "versions": {"trl": trl.__version__, "torch": torch.__version__},
                "steps": records,
                "rewards": rewards,
            },
            f,
        )


if __name__ == "__main__":
    main()
