"""GRPO and PPO learn on the path a GPU user of the transformers engine gets, in every CI run: transformers'
``generate`` (``--decode generate``) and the CPU speed layer off (``--cpu-layer off``: PyTorch's own ops, as on a
GPU), 2 processes. Last 10% of 60 steps >= first 10% + 0.2, the bound of the other learning tests.

The other learning tests sample with the engine's own decoding loop (what ``decode="auto"`` picks on a CPU) and
the layer on; this one checks that learning does not depend on either. 60 steps of 32 prompts (measured, seed 0:
GRPO 0.49 -> 0.87, PPO 0.49 -> 0.87; the same runs at a learning rate of 1e-9, which cannot learn, move the
mean reward by under 0.03; 16 prompts per step gain only 0.19-0.22). The run's kernel cache stays empty: no
process built the compiled kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_rlhf.callbacks.history import first_last
from tests.conftest import ROOT, demo_rows

pytestmark = pytest.mark.slow

STEPS = 60


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_algorithm_learns_with_generate_and_the_cpu_layer_off(algo: str, demo_model: str, tmp_path: Path) -> None:
    cache = str(Path(demo_model).parent)  # the session's warm-started model
    kernels = tmp_path / "cache"  # where a process that compiled the CPU kernels would leave them
    env = {**os.environ, "LIGHTNING_RLHF_CACHE": str(kernels)}
    cmd = [sys.executable, "-m", "lightning_rlhf.demo", "--algo", algo, "--steps", str(STEPS)]
    cmd += ["--rollout", "hf", "--decode", "generate", "--cpu-layer", "off"]
    cmd += ["--out", str(tmp_path / "runs"), "--cache", cache]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(ROOT), env=env)
    scores = [float(r["critic/score/mean"]) for r in demo_rows(proc)]
    assert len(scores) == STEPS
    first, last = first_last(scores)
    assert last >= first + 0.2, (algo, first, last)
    assert not (kernels / "kernels").exists(), "a process compiled the CPU kernels with the layer off"
