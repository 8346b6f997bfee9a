"""The performance metrics users compare across frameworks: peaks, the CPU peak's cache, the formulas, and a real
one-process GRPO run that logs them all (``perf/mfu/actor``, memory, ``timing_per_token_ms/*``)."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_rlhf import perf
from lightning_rlhf.batch import Batch
from lightning_rlhf.demo import addition_reward
from tests.conftest import failure_text, run_script


# ---------------------------------------------------------------------------------------------- GPU table
@pytest.mark.parametrize(
    ("name", "bf16_tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.5),  # SXM
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.5),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA H20", 148.0),
        ("NVIDIA H800", 989.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L40S", 362.05),
        ("NVIDIA L40", 181.05),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("NVIDIA B200", 2250.0),
        ("AMD Instinct MI300X", 1307.4),
    ],
)
def test_gpu_names_find_their_bf16_peak(name: str, bf16_tflops: float) -> None:
    assert perf.gpu_peak_flops(name, torch.bfloat16) == pytest.approx(bf16_tflops * 1e12)
    assert perf.gpu_peak_flops(name, torch.float16) == pytest.approx(bf16_tflops * 1e12)


def test_gpu_float32_peak_follows_tf32_and_unknowns_have_none() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert perf.gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == pytest.approx(67e12)
        assert perf.gpu_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32) == pytest.approx(19.5e12)
        assert perf.gpu_peak_flops("NVIDIA B200", torch.float32) is None  # no plain FP32 figure published
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores
        assert perf.gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == pytest.approx(494.5e12)
        assert perf.gpu_peak_flops("Tesla T4", torch.float32) == pytest.approx(8.1e12)  # no TF32: plain FP32
    finally:
        torch.set_float32_matmul_precision(before)
    assert perf.gpu_peak_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # Volta has no bfloat16
    assert perf.gpu_peak_flops("Tesla V100-PCIE-32GB", torch.float16) == pytest.approx(112e12)
    assert perf.gpu_peak_flops("NVIDIA A10G", torch.bfloat16) is None  # not the A10, not in the table
    assert perf.gpu_peak_flops("NVIDIA GeForce GTX 1080", torch.bfloat16) is None


def test_peak_override_and_unknown_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(perf.PEAK_ENV, "2.5")
    assert perf.device_peak_flops(torch.device("cpu"), torch.float32) == 2.5e12
    monkeypatch.setenv(perf.PEAK_ENV, "fast")
    with pytest.raises(ValueError, match=r"LIGHTNING_RLHF_PEAK_TFLOPS='fast'.*HINT"):
        perf.device_peak_flops(torch.device("cpu"), torch.float32)
    monkeypatch.delenv(perf.PEAK_ENV)
    with pytest.warns(UserWarning, match=r"perf/mfu/\* is not logged: no peak for device type 'meta'"):
        assert perf.device_peak_flops(torch.device("meta"), torch.float32) is None


# ---------------------------------------------------------------------------------------------- CPU peak
def test_cpu_peak_is_measured_once_then_read_from_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    perf._CPU_PEAKS.clear()
    measured: list[float] = []

    def measure_once(dtype: torch.dtype, **kwargs: object) -> float:
        measured.append(real_measure(dtype, budget_s=0.2))
        return measured[-1]

    real_measure = perf.measure_matmul_flops
    monkeypatch.setattr(perf, "measure_matmul_flops", measure_once)
    peak = perf.cpu_matmul_peak(torch.float32, cache_dir=str(tmp_path))
    assert measured == [peak]  # measured once, by the budgeted measurement
    assert peak > 0
    key = perf._cpu_peak_key(torch.float32, torch.get_num_threads())
    assert key.startswith(f"{perf.cpu_model_name()} | threads={torch.get_num_threads()} | float32 | ")
    cache = tmp_path / perf.CPU_PEAK_FILE
    assert json.loads(cache.read_text()) == {key: peak}

    def measured_again(*args: object, **kwargs: object) -> float:
        raise AssertionError("the peak was measured a second time")

    monkeypatch.setattr(perf, "measure_matmul_flops", measured_again)
    assert perf.cpu_matmul_peak(torch.float32, cache_dir=str(tmp_path)) == peak  # this process's memo
    perf._CPU_PEAKS.clear()  # a new process: only the file is left
    assert perf.cpu_matmul_peak(torch.float32, cache_dir=str(tmp_path)) == peak
    # Another dtype is another key; a value already in the file is taken as is.
    bf16_key = perf._cpu_peak_key(torch.bfloat16, torch.get_num_threads())
    cache.write_text(json.dumps({key: peak, bf16_key: 5e10}))
    assert perf.cpu_matmul_peak(torch.bfloat16, cache_dir=str(tmp_path)) == 5e10
    perf._CPU_PEAKS.clear()


class ScriptedClock:
    """A clock that only the products move: an ``n x n`` product takes ``2 n^3 / rate(n)`` seconds."""

    def __init__(self, rate: Callable[[int], float]) -> None:
        self.now, self.rate, self.sizes = 0.0, rate, []

    def perf_counter(self) -> float:
        return self.now

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        n = a.shape[0]
        self.sizes.append(n)
        self.now += 2.0 * n**3 / self.rate(n)
        return a


def test_matmul_measurement_keeps_the_best_rate_within_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement's logic on a scripted clock (no wall-clock figure, so the machine's load cannot matter):
    sizes double from 256 until a product takes 50 ms, the fastest rate is kept, and the budget bounds the time."""
    rate = {256: 20e9, 512: 40e9, 1024: 50e9, 2048: 50e9, 4096: 50e9}  # small products reach less of the peak
    clock = ScriptedClock(lambda n: rate[n])
    monkeypatch.setattr(perf, "time", clock)
    monkeypatch.setattr(perf, "_cpu_products", lambda dtype: [clock.mm])
    assert perf.measure_matmul_flops(torch.float32, budget_s=1.0) == pytest.approx(50e9)
    # 2 x 1024^3 / 50e9 = 43 ms < 50 ms, so 2048 (344 ms) is the size repeated; 256 and 512 once, plus warm-ups.
    assert sorted(set(clock.sizes)) == [256, 512, 1024, 2048]
    assert clock.now <= 1.0 + 2 * 2.0 * 2048**3 / 50e9  # the budget, overrun by at most the product under way
    repeated = clock.sizes.count(2048)
    assert 2 <= repeated <= 2 + 8  # warm-up and first timing, then at most 8 repeats while the budget lasts


# ---------------------------------------------------------------------------------------------- formulas
def test_training_flops_and_mfu_by_hand() -> None:
    assert perf.training_flops(1000, 50, epochs=2) == 600_000.0
    assert perf.mfu(600_000.0, 0.5, 1e6, devices=2) == pytest.approx(0.6)  # 1.2 MFLOP/s of 2 MFLOP/s
    assert perf.per_token_ms(0.2, 20) == pytest.approx(10.0)
    assert perf.per_token_ms(0.2, 0) is None
    with pytest.raises(ValueError, match=r"seconds=0.*HINT"):
        perf.mfu(1.0, 0.0, 1e6)


def test_step_perf_metrics_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(perf.PEAK_ENV, "1e-6")  # 1 MFLOP/s per device
    timings = {
        "timing_s/gen": 0.2,
        "timing_s/ref": 0.1,
        "timing_s/update_critic": 0.3,
        "timing_s/update_actor": 0.5,
        "timing_s/step": 1.5,
        "timing_s/dynamic_sampling": 0.4,
    }
    out = perf.step_perf_metrics(
        prompt_tokens=30,
        response_tokens=20,
        timings=timings,
        params={"actor": 1000, "critic": 500},
        epochs=2,
        device=torch.device("cpu"),
        dtype=torch.float32,
        world_size=2,
    )
    rss = out.pop("perf/cpu_memory_used_gb")
    peak = out.pop("perf/cpu_memory_peak_gb")  # no other rank's given: the controller's own peak RSS
    assert out.pop("perf/cpu_memory_peak_gb/rank0") == peak >= rss * 0.99
    assert out == pytest.approx(
        {
            "timing_per_token_ms/gen": 200 / 20,  # per generated token
            "timing_per_token_ms/ref": 100 / 50,  # per prompt + response token
            "timing_per_token_ms/update_critic": 300 / 50,
            "timing_per_token_ms/update_actor": 500 / 50,
            "perf/mfu/actor": 6 * 1000 * 50 * 2 / 0.5 / (1e6 * 2),  # 0.6
            "perf/mfu/critic": 6 * 500 * 50 * 2 / 0.3 / (1e6 * 2),  # 0.5
        }
    )
    import psutil

    assert rss == pytest.approx(psutil.Process().memory_info().rss / 2**30, rel=0.05)
    assert 0.05 < rss < 64


def test_module_counts_actor_and_critic_parameters(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_rlhf import PPOModule

    monkeypatch.setenv(perf.PEAK_ENV, "1e-3")  # 1 GFLOP/s
    module = PPOModule(tiny_model, critic=tiny_model, reference=True, reward=addition_reward)
    module.configure_model()  # full weights in this process (no strategy)
    assert module.reference is not None and module.reference.model is not None  # frozen: never counted
    actor_n = AutoModelForCausalLM.from_pretrained(tiny_model).num_parameters()
    critic_n = perf.trainable_parameters(module.critic.model if module.critic else None)
    assert perf.trainable_parameters(module.actor.model) == actor_n and 0 < critic_n != actor_n
    assert perf.trainable_parameters(module.reference.model) == 0
    rollout = Batch(
        {
            "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),  # 5 prompt tokens
            "response_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),  # 6 response tokens
            "scores": torch.tensor([1.0, 0.0]),
            "response_truncated": torch.tensor([False, True]),
        }
    )
    timings = {"timing_s/gen": 0.06, "timing_s/update_critic": 0.2, "timing_s/update_actor": 0.4}
    out = module.rollout_metrics(rollout, timings=timings)
    assert out["perf/mfu/actor"] == pytest.approx(6 * actor_n * 11 / 0.4 / 1e9)
    assert out["perf/mfu/critic"] == pytest.approx(6 * critic_n * 11 / 0.2 / 1e9)
    assert out["timing_per_token_ms/gen"] == pytest.approx(60 / 6)
    assert out["timing_per_token_ms/update_actor"] == pytest.approx(400 / 11)
    assert "perf/cpu_memory_used_gb" in out and "perf/max_memory_allocated_gb" not in out  # CPU: no CUDA figure
    assert "perf/mfu/actor" not in module.rollout_metrics(rollout)  # without timings: the rollout metrics only


# --------------------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_one_process_grpo_run_logs_the_perf_metrics(tiny_model: str, tmp_path: Path) -> None:
    prompts, n, epochs = 4, 4, 2
    cache = tmp_path / "cache"
    proc = run_script(
        "train.py",
        *("--model", tiny_model, "--out", str(tmp_path), "--devices", "1", "--steps", "2"),
        *("--prompts", str(prompts), "--n", str(n), "--ppo-epochs", str(epochs), "--kl-coef", "0.01"),
        env={"LIGHTNING_RLHF_CACHE": str(cache)},
    )
    assert proc.returncode == 0, failure_text(proc)
    # The run measured this machine's float32 peak once, with the controller's threads (Lightning sets cores /
    # processes), and cached it.
    peaks = json.loads((cache / perf.CPU_PEAK_FILE).read_text())
    threads = [t for t in range(1, (os.cpu_count() or 1) + 1) if perf._cpu_peak_key(torch.float32, t) in peaks]
    assert len(peaks) == 1 and len(threads) == 1, peaks
    peak = next(iter(peaks.values()))
    from transformers import AutoModelForCausalLM

    params = AutoModelForCausalLM.from_pretrained(tiny_model).num_parameters()
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert "perf/max_memory_allocated_gb" not in rows[0]  # CPU run
    for row in rows:
        v = {k: float(x) for k, x in row.items() if x not in ("", None)}
        tokens = v["perf/throughput"] * v["timing_s/step"]  # one rank: all prompt + response tokens of the step
        assert 0 < v["perf/mfu/actor"] < 1
        # mfu = 6 N tokens epochs / t_update / peak, with N the FSDP-wrapped actor's parameters counted on rank 0.
        counted = v["perf/mfu/actor"] * peak * v["timing_s/update_actor"] / (6 * tokens * epochs)
        assert counted == pytest.approx(params, rel=1e-4)
        assert v["timing_per_token_ms/update_actor"] == pytest.approx(v["timing_s/update_actor"] * 1e3 / tokens, 1e-4)
        assert v["timing_per_token_ms/old_log_prob"] == pytest.approx(v["timing_s/old_log_prob"] * 1e3 / tokens, 1e-4)
        assert v["timing_per_token_ms/ref"] == pytest.approx(v["timing_s/ref"] * 1e3 / tokens, 1e-4)
        generated = v["response_length/mean"] * prompts * n
        assert v["timing_per_token_ms/gen"] == pytest.approx(v["timing_s/gen"] * 1e3 / generated, 1e-4)
        assert 0.1 < v["perf/cpu_memory_used_gb"] < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
