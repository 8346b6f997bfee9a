"""The demo's ``--decode`` and ``--cpu-layer`` reach the settings they name (``RolloutConfig.decode``,
``RLHFStrategy(cpu_kernels=...)``); tests/e2e/test_cpu_layer_off.py runs them to learning."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_rlhf.cpu import switches
from lightning_rlhf.demo.job import build_job, parse_args


@pytest.mark.parametrize(
    ("flags", "decode", "cpu_kernels"),
    [
        ([], "auto", None),
        (["--decode", "generate", "--cpu-layer", "off"], "generate", False),
        (["--cpu-layer", "on", "--decode", "loop"], "loop", True),
    ],
)
def test_decode_and_cpu_layer_flags_set_the_rollout_and_the_strategy(
    flags: list[str],
    decode: str,
    cpu_kernels: bool | None,
    tiny_model: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LIGHTNING_RLHF_RUN_VERSION", "0")  # the run folder's number, which build_job would export
    monkeypatch.setattr(switches, "_STATE", dict(switches._STATE))  # the strategy sets this process's switch
    args = parse_args(["--rollout", "hf", "--out", str(tmp_path), *flags])
    module, _, trainer = build_job(args, tiny_model)
    assert module.rollout_config.decode == decode
    assert trainer.strategy.cpu_kernels is cpu_kernels
