"""The auto-mapping planner (placement/cost_model.py, calibration.py, plan.py): enumeration, the cost model on
hand-computed cases, the placement rules, the errors, and the ``plan`` command."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_rlhf import perf
from lightning_rlhf.cli import main as cli_main
from lightning_rlhf.placement.calibration import (
    calibrate_for_shape,
    fit_call_costs,
    measure_host_overheads,
    save_call_costs,
    with_saved_call_costs,
)
from lightning_rlhf.placement.cost_model import (
    HARDWARE,
    KNOWN_SHAPES,
    MODELS,
    Hardware,
    InfeasiblePlacementError,
    ModelShape,
    Workload,
    activation_bytes,
    attention_flops,
    core_share,
    dataflow_for,
    device_splits,
    hardware_for,
    plan,
    predict,
    set_partitions,
    shape_of,
    train_seconds,
    update_buffers,
)
from lightning_rlhf.placement.plan import recipe_inputs

ROOT = Path(__file__).resolve().parents[2]

# A device with round numbers and no communication cost: every predicted time below is FLOPs / 1e12.
UNIT = Hardware(
    "unit", flops=1e12, memory=1e15, hbm_bw=1e30, intra_bw=1e30, inter_bw=1e30, devices_per_node=8,
    train_eff=1.0, forward_eff=1.0, bw_eff=1.0, latency_s=0.0, usable_memory=1.0,
)  # fmt: skip
SHAPE = ModelShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=100)


def test_set_partitions_are_every_way_to_colocate() -> None:
    roles = ["actor", "critic", "reference", "reward"]
    partitions = list(set_partitions(roles))
    assert len(partitions) == 15  # Bell(4)
    assert len({tuple(tuple(g) for g in p) for p in partitions}) == 15
    for p in partitions:
        assert sorted(r for g in p for r in g) == sorted(roles)
    assert len(list(set_partitions(roles[:3]))) == 5


def test_device_splits_in_whole_nodes_coarsened_for_large_clusters() -> None:
    assert list(device_splits(4, 2, 1)) == [(1, 3), (2, 2), (3, 1)]
    assert list(device_splits(16, 3, 8)) == []  # 2 nodes cannot make 3 pools
    large = list(device_splits(1024, 2, 8))
    assert len(large) == 15 and all(sum(s) == 1024 and all(d % 64 == 0 for d in s) for s in large)


def test_parameter_count_is_transformers_own() -> None:
    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    assert SHAPE.params == sum(p.numel() for p in model.parameters())
    assert SHAPE.matmul_params == SHAPE.params - model.get_input_embeddings().weight.numel()
    assert MODELS["7b"].params == pytest.approx(6.74e9, rel=0.01)  # Llama 2 7B
    assert MODELS["70b"].params == pytest.approx(68.98e9, rel=0.01)  # Llama 2 70B
    assert SHAPE.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2  # keys and values, layers, kv heads, head_dim, bf16


@pytest.mark.parametrize(
    ("family", "fields"),
    [
        ("llama", {"tie_word_embeddings": False}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"tie_word_embeddings": True, "head_dim": 32}),  # wider heads than hidden / heads (Qwen3, Gemma)
        ("qwen2", {"tie_word_embeddings": True}),  # q, k, v biases (Qwen2.5's small models: tied)
    ],
)
def test_the_shape_read_from_a_config_counts_transformers_parameters(
    tmp_path: Path, family: str, fields: dict[str, object]
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family, vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, **fields,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    shape = shape_of(str(tmp_path))
    assert shape.tied == fields["tie_word_embeddings"]
    assert shape.params == sum(p.numel() for p in model.parameters())  # parameters() counts a tied matrix once
    head = model.get_output_embeddings().weight.numel()
    assert shape.matmul_params == shape.params - (0 if shape.tied else head)


def test_llama_3_2_1b_counts_its_tied_embedding_once() -> None:
    shape = KNOWN_SHAPES["meta-llama/Llama-3.2-1B-Instruct"]
    assert shape.params == pytest.approx(1.236e9, rel=0.005)  # the model card's 1.23B; twice the embedding: 1.50B
    assert KNOWN_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"].params == pytest.approx(0.494e9, rel=0.005)  # its card: 0.49B


def test_stage_times_by_hand_colocated_and_split() -> None:
    wl = Workload(prompts=4, n=2, prompt_len=3, response_len=5)  # 8 sequences of 8 tokens
    p, tokens = SHAPE.matmul_params, 64  # FLOPs count the matmuls' parameters (not the input embedding's)
    attention = 2 * 2 * 64 * 8 * 8 * 8  # 2 x layers x hidden x length^2 x sequences
    forward = (2 * p * tokens + attention) / 1e12
    train = (6 * p * tokens + 3 * attention) / 1e12
    kw = {"model": SHAPE, "hardware": UNIT, "workload": wl, "algorithm": "ppo"}
    together = predict([["actor", "critic", "reference", "reward"]], [4], 1, **kw)
    # one pool of 4: its four scoring forwards (PPO's old log-probs among them) and two updates one after another
    assert together.stage_s[1] == pytest.approx(4 * forward / 4)
    assert together.stage_s[2] == pytest.approx(2 * train / 4)
    split = predict([["actor", "reference"], ["critic", "reward"]], [2, 2], 1, **kw)
    # two pools of 2 at the same time: the longer pool's calls (2 forwards each; 1 update each)
    assert split.stage_s[1] == pytest.approx(2 * forward / 2)
    assert split.stage_s[2] == pytest.approx(train / 2)
    # a host cost per role call adds to its pool: 4 scoring calls on the shared pool, 2 on each split one
    slow = Hardware(**{**UNIT.__dict__, "call_s": 0.5})
    assert predict([["actor", "critic", "reference", "reward"]], [4], 1, **{**kw, "hardware": slow}).stage_s[
        1
    ] == pytest.approx(4 * forward / 4 + 4 * 0.5)
    assert predict([["actor", "reference"], ["critic", "reward"]], [2, 2], 1, **{**kw, "hardware": slow}).stage_s[
        2
    ] == pytest.approx(train / 2 + 0.5)
    # generation on 2 replicas of 1 device: 4 sequences each, all in one wave (memory is unlimited)
    prefill = 2 * p * 4 * 3 / 1e12
    decode = 5 * (2 * p * 4 / 1e12)  # compute-bound: reading memory is free on this device
    assert split.stage_s[0] == pytest.approx(prefill + decode)
    assert split.to_json()["placement"] == {"actor": [0, 1], "reference": [0, 1], "critic": [2, 3], "reward": [2, 3]}
    assert split.to_json()["parallel"]["actor"] == {"fsdp": 2, "rollout_tp": 1, "rollout_replicas": 2}


def test_a_small_kv_cache_decodes_in_waves() -> None:
    wl = Workload(prompts=8, n=1, prompt_len=4, response_len=4, micro_tokens=8)
    shape = dataclasses.replace(SHAPE, tied=True)
    per_seq = shape.kv_bytes_per_token() * 8
    # the actor's FSDP states and its engine's weights, 1 device; the update's activations and buffers (its root
    # unit gathered with its gradient) take turns with the engine's weights, and are smaller here
    assert activation_bytes(shape, wl) + update_buffers(shape, wl) < 2 * shape.params
    states = 16 * shape.params + 2 * shape.params
    roomy = Hardware(**{**UNIT.__dict__, "memory": states + 8 * per_seq})
    tight = Hardware(**{**UNIT.__dict__, "memory": states + 2 * per_seq})
    kw = {"model": shape, "workload": wl, "algorithm": dataflow_for(["actor"])}
    one_wave = predict([["actor"]], [1], 1, hardware=roomy, **kw).stage_s[0]
    four_waves = predict([["actor"]], [1], 1, hardware=tight, **kw).stage_s[0]
    # compute-bound decoding is linear in the batch: the same total work, here in 4 waves of 2 sequences
    assert four_waves == pytest.approx(one_wave)
    slow_memory = Hardware(**{**tight.__dict__, "hbm_bw": 1e9})  # now each decoding step reads the weights
    read = (2 * shape.params + 2 * 6 * shape.kv_bytes_per_token()) / 1e9
    assert predict([["actor"]], [1], 1, hardware=slow_memory, **kw).stage_s[0] > 4 * 4 * read


def test_placement_errors_name_the_setting() -> None:
    kw = {"model": SHAPE, "hardware": UNIT, "workload": Workload(), "algorithm": "ppo"}
    with pytest.raises(InfeasiblePlacementError, match=r"missing \['reward'\]"):
        predict([["actor", "critic", "reference"]], [2], 1, **kw)
    with pytest.raises(InfeasiblePlacementError, match=r"repeated \['critic'\]"):
        predict([["actor", "critic"], ["critic", "reference", "reward"]], [1, 1], 1, **kw)
    with pytest.raises(InfeasiblePlacementError, match="rollout_tp=4 does not divide the actor's pool of 2"):
        predict([["actor", "critic", "reference", "reward"]], [2], 4, **kw)
    with pytest.raises(InfeasiblePlacementError, match=r"needs .* GB per device .* HINT: give the pool more devices"):
        big = {**kw, "model": MODELS["70b"], "hardware": HARDWARE["a100"]}
        predict([["actor", "critic", "reference", "reward"]], [8], 8, **big)
    with pytest.raises(InfeasiblePlacementError, match=r"no placement of .* fits on 8 x a100"):
        plan(model=MODELS["70b"], hardware=HARDWARE["a100"], devices=8, workload=Workload())
    with pytest.raises(InfeasiblePlacementError, match="unknown: \\['judge'\\]"):
        dataflow_for(["actor", "judge"])


def test_colocating_everything_wins_on_small_clusters_and_splitting_on_large_ones() -> None:
    """The trend HybridFlow reports: colocating all models is best on few GPUs; on many GPUs, separate pools run
    independent calls (the critic's and the actor's updates) at the same time."""
    wl = Workload(activation_checkpointing=True)  # 16k tokens per micro-batch: HybridFlow's runs checkpoint
    small = plan(model=MODELS["7b"], hardware=HARDWARE["a100"], devices=16, workload=wl)
    assert small.groups == (("actor", "critic", "reference", "reward"),)
    large = plan(model=MODELS["34b"], hardware=HARDWARE["a100"], devices=1024, workload=wl)
    assert len(large.groups) > 1
    assert sum(large.devices) == 1024
    colocated = predict(
        [["actor", "critic", "reference", "reward"]], [1024], large.rollout_tp, model=MODELS["34b"],
        hardware=HARDWARE["a100"], workload=wl,
    )  # fmt: skip
    assert large.step_s < colocated.step_s


def test_recipe_inputs_and_the_plan_command(capsys: pytest.CaptureFixture[str]) -> None:
    flow, shape, wl = recipe_inputs(str(ROOT / "recipes" / "ppo.yaml"))
    assert [sorted(r for r, _ in stage) for stage in flow] == [
        ["actor"],
        ["actor", "critic", "reference"],  # PPO's old log-probs beside the critic's values and the reference
        ["actor", "critic"],
    ]
    assert dataflow_for(["actor", "reference"])[1] == [("reference", "forward")]  # GRPO on-policy: no old log-probs
    assert dataflow_for(["actor", "reference"], old_logprobs=True)[1] == [
        ("actor", "forward"),
        ("reference", "forward"),
    ]
    assert shape.layers == 24 and wl.sequences == 64 and wl.prompt_len == 512 and wl.response_len == 512
    cli_main(["plan", "--config", str(ROOT / "recipes" / "ppo.yaml"), "--devices", "16", "--device-type", "h100"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"placement", "parallel", "predicted_step_s"} <= set(last)
    assert sorted(last["placement"]) == ["actor", "critic", "reference"] and last["predicted_step_s"] > 0
    ranks = sorted({r for ranks in last["placement"].values() for r in ranks})
    assert ranks == list(range(16))
    with pytest.raises(SystemExit):
        cli_main(["plan", "--config", str(ROOT / "recipes" / "rloo.yaml"), "--devices", "8", "--device-type", "h100",
                  "--model-shape", "3b"])  # fmt: skip
    assert "--model-shape: invalid choice: '3b'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"lightning-rlhf plan: no placement of .* fits on 8 x a100"):
        cli_main(["plan", "--config", str(ROOT / "recipes" / "ppo.yaml"), "--devices", "8", "--device-type", "a100",
                  "--model-shape", "70b"])  # fmt: skip


def test_host_overheads_add_per_layer_per_step_and_per_micro_batch() -> None:
    wl = Workload(prompts=2, n=1, prompt_len=3, response_len=5, micro_tokens=4)  # 16 tokens: 4 micro-batches on 1
    kw = {"model": SHAPE, "workload": wl, "algorithm": dataflow_for(["actor", "reference"])}
    base = predict([["actor", "reference"]], [1], 1, hardware=UNIT, **kw).stage_s
    slow = Hardware(**{**UNIT.__dict__, "layer_step_s": 1e-3, "layer_micro_s": 3e-3})
    stages = predict([["actor", "reference"]], [1], 1, hardware=slow, **kw).stage_s
    assert stages[0] - base[0] == pytest.approx(5 * 2 * 1e-3)  # 5 decoding steps x 2 layers
    assert stages[1] - base[1] == pytest.approx(4 * 2 * 1e-3)  # a forward: a third of a micro-batch's cost
    assert stages[2] - base[2] == pytest.approx(4 * 2 * 3e-3)


def test_host_overheads_are_measured() -> None:
    """On this machine, with its real clock (the arithmetic is tested below with a scripted one): each of the 8
    timed calls (2 repeats x 2 sizes x decode and train) reads the clock before and after, and each cost is a
    finite time > 0, or 0 with a warning that names it (a busy machine may time the 5-layer model faster)."""
    readings: list[float] = []

    def clock() -> float:
        readings.append(time.thread_time())
        return readings[-1]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        step_s, micro_s = measure_host_overheads(repeats=2, timer=clock)
    assert len(readings) == 16 and readings == sorted(readings)
    warned = " ".join(str(w.message) for w in caught)
    for name, cost in (("layer_step_s", step_s), ("layer_micro_s", micro_s)):
        assert math.isfinite(cost) and (cost > 0 or (cost == 0 and f"{name} came out" in warned)), (name, cost)


def scripted_timer(durations: list[float]) -> Callable[[], float]:
    """A clock whose consecutive timed calls take ``durations`` seconds (two readings per call)."""
    readings = iter(itertools.chain.from_iterable((0.0, d) for d in durations))
    return lambda: next(readings)


def test_host_overheads_are_the_fastest_times_difference_and_never_negative() -> None:
    """The timer is scripted, so the figures do not depend on the machine's load. Order of the timed calls per
    repeat: 1 layer (decode, train), then 5 layers (decode, train). A decode is 32 steps."""
    # A burst of load on the first 5-layer decode: each size keeps its fastest time.
    timer = scripted_timer([0.32, 1.0, 9.0, 2.0, 0.32, 1.0, 0.64, 2.0])
    step_s, micro_s = measure_host_overheads(repeats=2, timer=timer)
    assert step_s == pytest.approx((0.64 - 0.32) / 4 / 32)  # per layer and decoding step
    assert micro_s == pytest.approx((2.0 - 1.0) / 4)  # per layer and micro-batch
    # The user's case: the machine busy throughout the 1-layer timings, so the 5-layer model times faster. The
    # difference is negative; the cost is 0, with a warning, never a negative time.
    timer = scripted_timer([0.64, 3.0, 0.32, 1.0, 0.64, 3.0, 0.32, 1.0])
    with pytest.warns(RuntimeWarning) as caught:
        step_s, micro_s = measure_host_overheads(repeats=2, timer=timer)
    assert (step_s, micro_s) == (0.0, 0.0)
    assert [str(w.message).split(" (")[0] for w in caught] == [
        "measure_host_overheads: layer_step_s came out -0.0025 s",
        "measure_host_overheads: layer_micro_s came out -0.5 s",
    ]
    assert all("taken as 0. HINT: plan on an idle machine" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match=r"repeats=0"):
        measure_host_overheads(repeats=0)


def test_calibration_measures_what_the_shape_reaches_of_the_peak() -> None:
    wl = Workload(prompts=4, n=2, prompt_len=6, response_len=4, micro_tokens=40)
    slow_peak = Hardware(**{**UNIT.__dict__, "flops": 1e6})  # a peak no CPU misses: efficiencies cap at 1
    fast_peak = Hardware(**{**UNIT.__dict__, "flops": 1e18})  # a peak no CPU reaches: tiny efficiencies
    capped = calibrate_for_shape(slow_peak, SHAPE, wl, repeats=1)
    assert capped.train_eff == capped.forward_eff == capped.decode_eff == 1.0
    tiny = calibrate_for_shape(fast_peak, SHAPE, wl, repeats=1)
    assert all(0 < e < 1e-3 for e in (tiny.train_eff, tiny.forward_eff, tiny.decode_eff or 0))
    assert UNIT.decode_eff is None  # the input is left as it was
    # decoding's compute uses decode_eff: halving it doubles a compute-bound decode
    kw = {"model": SHAPE, "workload": wl, "algorithm": dataflow_for(["actor"])}
    half = Hardware(**{**UNIT.__dict__, "decode_eff": UNIT.forward_eff / 2})
    base, slow = (predict([["actor"]], [1], 1, hardware=h, **kw).stage_s[0] for h in (UNIT, half))
    prefill = 2 * SHAPE.matmul_params * 8 * 6 / (UNIT.flops * UNIT.forward_eff)
    assert slow - prefill == pytest.approx(2 * (base - prefill))


def test_call_costs_are_fitted_to_a_measured_run() -> None:
    wl = Workload(prompts=4, n=2, prompt_len=3, response_len=5)
    tokens, attention = 64, 2 * 2 * 64 * 8 * 8 * 8
    forward = (2 * SHAPE.matmul_params * tokens + attention) / 1e12 / 2  # on 2 devices
    train = (6 * SHAPE.matmul_params * tokens + 3 * attention) / 1e12 / 2
    fitted = fit_call_costs(
        UNIT, SHAPE, wl, 2, forward_s=[forward + 0.01, forward + 0.03, forward + 0.02], train_s=[train + 0.05]
    )
    assert fitted.call_s == pytest.approx(0.02) and fitted.train_call_s == pytest.approx(0.03)
    kw = {"model": SHAPE, "workload": wl, "algorithm": "ppo"}
    stages = predict([["actor", "critic", "reference", "reward"]], [2], 1, hardware=fitted, **kw).stage_s
    bare = predict([["actor", "critic", "reference", "reward"]], [2], 1, hardware=UNIT, **kw).stage_s
    assert stages[1] - bare[1] == pytest.approx(4 * 0.02)  # 4 scoring calls
    assert stages[2] - bare[2] == pytest.approx(2 * (0.02 + 0.03))  # 2 updates
    assert fit_call_costs(UNIT, SHAPE, wl, 2, forward_s=[0.0], train_s=[0.0]).call_s == 0.0  # never negative


def test_fitted_call_costs_are_kept_for_later_plans(tmp_path: Path) -> None:
    fitted = Hardware(**{**UNIT.__dict__, "call_s": 0.04, "train_call_s": 0.05})
    assert with_saved_call_costs(UNIT, SHAPE, 2, cache_dir=str(tmp_path)) == UNIT  # nothing kept yet
    save_call_costs(fitted, SHAPE, 2, cache_dir=str(tmp_path))
    read = with_saved_call_costs(UNIT, SHAPE, 2, cache_dir=str(tmp_path))
    assert (read.call_s, read.train_call_s) == (0.04, 0.05)
    assert with_saved_call_costs(UNIT, SHAPE, 4, cache_dir=str(tmp_path)) == UNIT  # another world: not used
    other = ModelShape(layers=3, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=100)
    assert with_saved_call_costs(UNIT, other, 2, cache_dir=str(tmp_path)) == UNIT  # another model: not used


def test_device_types_are_taken_in_any_case(capsys: pytest.CaptureFixture[str]) -> None:
    """The user's command: ``lightning-rlhf plan --device-type H100`` (upper case, as NVIDIA writes it)."""
    recipe = str(ROOT / "recipes" / "ppo.yaml")
    cli_main(["plan", "--config", recipe, "--devices", "16", "--device-type", "H100"])
    upper = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cli_main(["plan", "--config", recipe, "--devices", "16", "--device-type", "h100"])
    lower = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert upper == lower and upper["device_type"] == "h100"
    # The planner's API takes a device type in any case too.
    assert hardware_for("A100") is hardware_for(" a100 ") is HARDWARE["a100"]
    wl = Workload(prompts=64, n=1, prompt_len=128, response_len=128, activation_checkpointing=True)
    by_name = plan(model=MODELS["7b"], hardware="H200", devices=8, workload=wl)
    assert by_name == plan(model=MODELS["7b"], hardware=HARDWARE["h200"], devices=8, workload=wl)
    groups = [["actor", "critic", "reference", "reward"]]
    assert predict(groups, [8], 1, model=MODELS["7b"], hardware="A100", workload=wl).step_s > 0
    with pytest.raises(InfeasiblePlacementError, match=r"device type 'V100': no specification\. HINT: use one of"):
        hardware_for("V100")
    with pytest.raises(SystemExit):
        cli_main(["plan", "--config", recipe, "--devices", "8", "--device-type", "V100"])
    assert "--device-type: invalid choice: 'v100'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ CPU cores shared by processes
def test_core_share_is_the_cores_over_the_threads_that_want_them() -> None:
    assert core_share(cores=2, processes=4, threads=1) == 0.5  # the user's case: 4 processes on 2 cores
    assert core_share(cores=2, processes=2, threads=1) == 1.0
    assert core_share(cores=2, processes=1, threads=1) == 1.0  # an idle core does not speed a process up
    assert core_share(cores=16, processes=4, threads=4) == 1.0
    assert core_share(cores=16, processes=8, threads=4) == 0.5
    assert core_share(cores=1.5, processes=3, threads=1) == 0.5  # a fractional cgroup quota
    assert core_share(cores=None, processes=64, threads=8) == 1.0  # GPUs do not share compute
    with pytest.raises(ValueError, match=r"core_share\(cores=0, processes=4, threads=1\).*HINT"):
        core_share(cores=0, processes=4, threads=1)


def test_available_cores_and_threads_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(perf.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    none = tmp_path / "none"
    none.mkdir()
    assert perf.available_cores(cgroup_root=str(none)) == 4.0  # the affinity mask (taskset, cpusets)
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")  # docker --cpus 1.5
    assert perf.available_cores(cgroup_root=str(v2)) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert perf.available_cores(cgroup_root=str(v2)) == 4.0
    (v2 / "cpu.max").write_text("800000 100000\n")  # a quota above the mask: the mask bounds it
    assert perf.available_cores(cgroup_root=str(v2)) == 4.0
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert perf.available_cores(cgroup_root=str(v1)) == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert perf.available_cores(cgroup_root=str(v1)) == 4.0
    # Lightning's rule for the ranks it starts: the mask's cores divided among the processes, or OMP_NUM_THREADS.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [perf.threads_per_process(p) for p in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert perf.threads_per_process(2) == 3
    with pytest.raises(ValueError, match=r"processes=0"):
        perf.threads_per_process(0)


def test_oversubscribed_cpu_processes_compute_proportionally_slower() -> None:
    """4 single-threaded processes on 2 cores: a stage whose pools keep all 4 busy takes twice as long; a stage
    with only 2 busy (the split placement's generation, the critic's pool idle) takes what it takes alone."""
    wl = Workload(prompts=4, n=2, prompt_len=3, response_len=5)
    flow = dataflow_for(["actor", "critic"])
    kw = {"model": SHAPE, "workload": wl, "algorithm": flow}
    own = Hardware(**{**UNIT.__dict__, "layer_step_s": 1e-3, "layer_micro_s": 3e-3, "call_s": 0.01})
    shared = Hardware(**{**own.__dict__, "cores": 2.0, "threads": 1})
    colocated = [["actor", "critic"]], [4]
    split = [["actor"], ["critic"]], [2, 2]
    alone = predict(*colocated, 1, hardware=own, **kw).stage_s
    assert predict(*colocated, 1, hardware=shared, **kw).stage_s == pytest.approx([2 * t for t in alone])
    alone = predict(*split, 1, hardware=own, **kw).stage_s
    got = predict(*split, 1, hardware=shared, **kw).stage_s
    assert got == pytest.approx([alone[0], 2 * alone[1], 2 * alone[2]])
    # Enough cores for every thread: nothing changes.
    roomy = Hardware(**{**own.__dict__, "cores": 8.0, "threads": 2})
    assert predict(*colocated, 1, hardware=roomy, **kw).stage_s == predict(*colocated, 1, hardware=own, **kw).stage_s
    # The call costs fitted on an oversubscribed run are a process's own (scaled back), so predict gives the run.
    forward = predict(*colocated, 1, hardware=Hardware(**{**shared.__dict__, "call_s": 0.0}), **kw).stage_s[1] / 2
    fitted = fit_call_costs(
        Hardware(**{**shared.__dict__, "call_s": 0.0}), SHAPE, wl, 4, forward_s=[forward + 0.02] * 2, train_s=[]
    )
    assert fitted.call_s == pytest.approx(0.01)  # 0.02 s measured at half speed


def test_the_planner_counts_the_cores_in_the_users_oversubscribed_case() -> None:
    """PPO on the demo task (the demo model as actor and critic, 32 prompts x 8, 6 new tokens) on 4 processes of 1
    thread, with host costs of this machine's order (0.15 ms per layer and decoding step, 0.85 ms per layer and
    micro-batch, 2 ms per call): with 4 cores the planner colocates, predicting about what the user was told (0.177
    s). On the user's 2 cores a colocated stage keeps all 4 processes busy, each at half speed; the split placement's
    generation keeps 2 processes on 2 cores, and its pools run the other stages' calls at the same time: the planner
    now picks the split, as the user measured (0.272 s split, 0.467 s colocated)."""
    demo = ModelShape(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=384)
    wl = Workload(prompts=32, n=8, prompt_len=5, response_len=6, micro_tokens=128 * 11)
    cpu = Hardware(
        "cpu", flops=100e9, memory=4e9, hbm_bw=10e9, intra_bw=5e9, inter_bw=5e9, devices_per_node=4, train_eff=0.3,
        forward_eff=0.3, bw_eff=1.0, latency_s=200e-6, layer_step_s=0.15e-3, layer_micro_s=0.85e-3, call_s=2e-3,
        train_call_s=4e-3, threads=1,
    )  # fmt: skip
    kw = {"model": demo, "workload": wl, "algorithm": dataflow_for(["actor", "critic"])}
    four_cores = plan(hardware=Hardware(**{**cpu.__dict__, "cores": 4.0}), devices=4, tp_sizes=(1,), unit=1, **kw)
    assert four_cores.groups == (("actor", "critic"),) and four_cores.step_s == pytest.approx(0.171, abs=0.001)
    two = Hardware(**{**cpu.__dict__, "cores": 2.0})
    two_cores = plan(hardware=two, devices=4, tp_sizes=(1,), unit=1, **kw)
    assert two_cores.groups == (("actor",), ("critic",)) and two_cores.devices == (2, 2)
    colocated = predict([["actor", "critic"]], [4], 1, hardware=two, **kw)
    assert colocated.step_s == pytest.approx(2 * four_cores.step_s)  # every stage at half speed
    assert two_cores.step_s < colocated.step_s


PPO_DEMO_RECIPE = """
model:
  class_path: lightning_rlhf.PPOModule
  init_args:
    actor: lightning-rlhf/tiny-addition
    critic: lightning-rlhf/tiny-addition
    reward: lightning_rlhf.demo.addition_reward
    rollout: {n: 8, max_new_tokens: 6}
data:
  class_path: lightning_rlhf.PromptDataModule
  init_args: {train: recipes/data/addition.jsonl, batch_size: 32, max_prompt_length: 16}
"""


def test_plan_on_cpu_splits_single_processes_and_counts_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The user's command, ``lightning-rlhf plan --devices 4 --device-type cpu`` for PPO on the demo task: it had
    only whole-machine pools to choose from (the CPU "node" is every process) and did not count the cores. The
    machine's timings are given (the choice must not depend on this machine's load); the cores are the variable."""
    import torch

    from lightning_rlhf.placement import calibration

    recipe = tmp_path / "ppo_demo.yaml"
    recipe.write_text(PPO_DEMO_RECIPE)
    monkeypatch.setattr(calibration, "measure_host_overheads", lambda: (0.15e-3, 0.85e-3))
    monkeypatch.setattr(calibration, "measure_memcpy_bw", lambda: 10e9)
    monkeypatch.setattr(calibration, "measure_call_overhead", lambda: 2e-3)
    monkeypatch.setattr(calibration, "with_saved_call_costs", lambda hw, shape, processes: hw)
    monkeypatch.setattr(
        calibration,
        "calibrate_for_shape",
        lambda hw, shape, wl: Hardware(**{**hw.__dict__, "train_eff": 0.3, "forward_eff": 0.3, "decode_eff": 0.1}),
    )
    monkeypatch.setattr(perf, "cpu_matmul_peak", lambda dtype: 100e9)
    monkeypatch.setattr(perf, "threads_per_process", lambda processes: 1)
    threads = torch.get_num_threads()
    chosen = {}
    try:
        for cores in (4.0, 2.0):
            monkeypatch.setattr(perf, "available_cores", lambda c=cores: c)
            cli_main(["plan", "--config", str(recipe), "--devices", "4", "--device-type", "cpu"])
            out = capsys.readouterr().out
            chosen[cores] = json.loads(out.strip().splitlines()[-1])["placement"]
            assert f"{cores:g} cores for 4 processes of 1 thread(s)" in out
    finally:
        torch.set_num_threads(threads)
    assert chosen[4.0] == {"actor": [0, 1, 2, 3], "critic": [0, 1, 2, 3]}  # enough cores: colocated
    assert chosen[2.0] == {"actor": [0, 1], "critic": [2, 3]}  # the user's 2 cores: the split they measured faster


def test_engine_servers_cost_their_copies_requests_and_memory() -> None:
    """A vLLM actor on part of the devices generates in engine servers (one process per device): the planner adds
    two host copies of each device's weights and one request to its generation, and keeps the engine's weights
    beside training's activations. A colocated actor (every device) pays nothing of it."""
    wl = Workload(activation_checkpointing=True)
    hw = HARDWARE["h100"]
    kw = {"model": MODELS["7b"], "hardware": hw, "workload": wl, "algorithm": "ppo"}
    groups, devices = [["actor", "reference"], ["critic", "reward"]], [8, 8]
    plain = predict(groups, devices, 2, **kw)
    served = predict(groups, devices, 2, engine_servers=True, **kw)
    copies = 2 * 2.0 * MODELS["7b"].params / 2 / hw.server_copy_bw + hw.server_call_s
    assert served.stage_s[0] == pytest.approx(plain.stage_s[0] + copies)  # the generation stage
    assert served.stage_s[1:] == pytest.approx(plain.stage_s[1:])
    assert served.memory[0] > plain.memory[0] and served.memory[1] == plain.memory[1]
    everywhere = [["actor", "critic", "reference", "reward"]]
    assert predict(everywhere, [16], 2, engine_servers=True, **kw) == predict(everywhere, [16], 2, **kw)


def test_the_plan_command_names_the_rollout_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """``--rollout hf`` plans without engine servers. 70B PPO on 64 H100s (it fits with activation checkpointing,
    which the planner turns on) with the recipe's micro-batches of 8 sequences: both engines split the roles onto
    pools of their own, and vLLM's engine servers (the actor on part of the devices) pay the hand-off copies: a
    longer step."""
    args = ["plan", "--config", str(ROOT / "recipes" / "ppo.yaml"), "--devices", "64", "--device-type", "h100"]
    args += ["--model-shape", "70b"]
    steps = {}
    for engine in ("vllm", "hf"):
        cli_main([*args, "--rollout", engine])
        steps[engine] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(plan_["activation_checkpointing"] for plan_ in steps.values())
    assert all(len(plan_["placement"]["actor"]) < 64 for plan_ in steps.values())
    assert steps["vllm"]["predicted_step_s"] > steps["hf"]["predicted_step_s"]


def test_lora_adapters_are_counted_like_peft_and_fit_on_fewer_devices() -> None:
    """The adapter count is peft's on a Llama model; LoRA's state (a frozen float32 base, adapters with Adam, the
    reference in the actor's pool for free) lets every size fit on fewer GPUs, and the plan reads ``lora`` from a
    recipe."""
    from peft import LoraConfig, get_peft_model

    shape = ModelShape(layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2, vocab=128)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128,
    )  # fmt: skip
    wrapped = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
    assert shape.lora_params(4) == sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    wl = Workload(prompts=256, n=4, prompt_len=512, response_len=512)
    lora = Workload(prompts=256, n=4, prompt_len=512, response_len=512, lora_rank=16)

    def fewest(work: Workload, model: ModelShape) -> int:
        for devices in (1, 2, 4, 8, 16, 32, 64, 128):
            try:
                plan(model=model, hardware="a100", devices=devices, workload=work, algorithm="ppo")
                return devices
            except InfeasiblePlacementError:
                continue
        return 10**6

    for name in ("7b", "70b"):
        assert fewest(lora, MODELS[name]) < fewest(wl, MODELS[name]), name
    lora = dataclasses.replace(lora, activation_checkpointing=True)
    together = predict([["actor", "critic", "reference", "reward"]], [8], 1, model=MODELS["7b"], hardware="a100",
                       workload=lora)  # fmt: skip
    apart = predict([["actor", "critic", "reward"], ["reference"]], [4, 4], 1, model=MODELS["7b"], hardware="a100",
                    workload=lora)  # fmt: skip
    assert together.memory[0] < apart.memory[0] + apart.memory[1]  # the reference beside the actor costs nothing
    _, _, from_recipe = recipe_inputs(str(ROOT / "recipes" / "grpo_lora.yaml"))
    assert from_recipe.lora_rank == 8


# ------------------------------------------------------------- activations: checkpointing, sequence parallelism
def saved_per_token(model: torch.nn.Module, tokens: int) -> float:
    """Elements per token that torch keeps for the backward of ``model``'s decoder (the parameters aside)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=torch.randint(0, 100, (1, tokens)))  # type: ignore[operator]
    return sum(kept.values()) / tokens / 4  # float32


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize(("hidden", "intermediate", "heads", "kv_heads"), [(64, 160, 4, 2), (128, 160, 8, 8)])
def test_saved_activations_are_what_torch_keeps(
    checkpointing: bool, hidden: int, intermediate: int, heads: int, kv_heads: int
) -> None:
    shape = ModelShape(layers=3, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads, vocab=100)
    config = LlamaConfig(
        vocab_size=100, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    counted = saved_per_token(model, 64)
    assert counted == pytest.approx(shape.saved_activations(checkpointing=checkpointing), rel=0.02)
    if checkpointing:  # one hidden vector per block (+ the final norm's)
        assert shape.saved_activations(checkpointing=True) == 3 * hidden + 2 * hidden


def test_checkpointing_and_sequence_parallelism_shrink_the_activations_and_cost_their_time() -> None:
    wl = Workload(prompts=8, n=1, prompt_len=16, response_len=4096, micro_tokens=1024)
    plain = activation_bytes(SHAPE, wl)
    block = SHAPE.block_activations()  # 8 x 64 + 2 x 32 + 4 x 128 = 1,088, more than the logits' 2 x 100
    assert plain == 4112 * 2 * (SHAPE.saved_activations(checkpointing=False) + block)
    bigger_vocab = dataclasses.replace(SHAPE, vocab=5000)
    assert activation_bytes(bigger_vocab, wl) == 4112 * 2 * (SHAPE.saved_activations(checkpointing=False) + 10000)
    checkpointed = activation_bytes(SHAPE, dataclasses.replace(wl, activation_checkpointing=True))
    assert checkpointed < plain
    split = dataclasses.replace(wl, activation_checkpointing=True, sequence_parallel=2)
    exchange = 2 * (2 * 64 + 2 * 32)  # the all-to-all's buffers: q, k, v and the output, sent and received
    assert activation_bytes(SHAPE, split) == pytest.approx(checkpointed / 2 + 4112 / 2 * exchange * 2)
    # Time: checkpointing runs each block's forward again (8 weight passes instead of 6, 4 attention passes
    # instead of 3); sequence parallelism adds its all-to-alls, on one device the same compute.
    base = train_seconds(SHAPE, wl, UNIT, 1)
    again = train_seconds(SHAPE, dataclasses.replace(wl, activation_checkpointing=True), UNIT, 1)
    attention = attention_flops(SHAPE, wl)
    assert again - base == pytest.approx((2 * SHAPE.matmul_params * wl.tokens + attention) / UNIT.flops)
    slow = dataclasses.replace(UNIT, intra_bw=1e9)
    sp_seconds = train_seconds(SHAPE, dataclasses.replace(wl, sequence_parallel=2), slow, 2)
    per_token = (2 * 64 + 2 * 32) * 2 * (1 / 2)  # bf16, half of it leaves each rank
    expected = train_seconds(SHAPE, wl, slow, 2) + 2 * SHAPE.layers * per_token * wl.tokens / 2 / 1e9
    assert sp_seconds == pytest.approx(expected)


def test_the_planner_turns_on_checkpointing_then_sequence_parallelism_to_fit() -> None:
    """A 7B actor on 4 x 80 GB with 96k-token responses fits with neither setting on, checkpointing alone is not
    enough, and sequence parallelism of 2 on top fits; without the levers the plan is refused."""
    kw = {"model": MODELS["7b"], "hardware": "a100", "devices": 4, "algorithm": "grpo"}
    long = Workload(prompts=8, n=8, prompt_len=512, response_len=98304, micro_tokens=4096)
    with pytest.raises(InfeasiblePlacementError, match="needs"):
        plan(workload=long, memory_levers=False, **kw)
    with pytest.raises(InfeasiblePlacementError, match="needs"):
        plan(workload=dataclasses.replace(long, activation_checkpointing=True), memory_levers=False, **kw)
    chosen = plan(workload=long, **kw)
    assert (chosen.activation_checkpointing, chosen.sequence_parallel) == (True, 2)
    assert chosen.to_json()["sequence_parallel"] == 2
    short = dataclasses.replace(long, response_len=1024)
    assert plan(workload=short, **kw).activation_checkpointing is False  # nothing turned on that is not needed
    with pytest.raises(InfeasiblePlacementError, match=r"sequence_parallel=3 .* must divide the pool's devices"):
        predict([["actor", "reference"]], [4], 1, model=MODELS["7b"], hardware="a100", algorithm="grpo",
                workload=dataclasses.replace(short, sequence_parallel=3))  # fmt: skip


def test_sequence_parallelism_divides_the_pool_of_every_role_it_splits_the_reference_included() -> None:
    """``RLHFModule(sequence_parallel=2)`` splits the reference's forwards too (its ``log_prob`` is declared
    ``sequence_parallel=True``), and the strategy refuses a reference pool of 1 rank before any model loads: the
    planner must not choose one. It did: PPO on 5 A100s put the reference and the reward model on 1 device, GRPO on 3
    the reference alone; now PPO's 1-device pool holds the reward model only, and GRPO on 3 has no placement."""
    wl = Workload(prompts=8, n=8, prompt_len=512, response_len=1024, micro_tokens=4096, sequence_parallel=2)
    kw = {"model": MODELS["7b"], "hardware": "a100", "workload": wl}
    with pytest.raises(InfeasiblePlacementError, match=r"sequence_parallel=2 on pool \['reference'\] of 1 devices"):
        predict([["actor"], ["reference"]], [2, 1], 1, algorithm="grpo", **kw)
    chosen = plan(devices=5, unit=1, algorithm="ppo", **kw)
    split = {role: n for group, n in zip(chosen.groups, chosen.devices, strict=True) for role in group}
    assert all(split[role] % 2 == 0 for role in ("actor", "critic", "reference")), chosen.groups
    with pytest.raises(InfeasiblePlacementError, match=r"sequence_parallel=2 on pool .* of 3 devices"):
        plan(devices=3, unit=1, algorithm="grpo", memory_levers=False, **kw)


def test_the_plan_command_takes_the_memory_settings(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--config", str(ROOT / "recipes" / "grpo_gsm8k.yaml"), "--devices", "8", "--device-type", "h100"]
    cli_main([*args, "--activation-checkpointing", "--sequence-parallel", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["activation_checkpointing"] is True and out["sequence_parallel"] == 2
    with pytest.raises(SystemExit):
        cli_main([*args, "--sequence-parallel", "0"])
    assert "--sequence-parallel 0: expected at least 1" in capsys.readouterr().err


def test_auto_placement_names_the_memory_setting_it_needed() -> None:
    from lightning_rlhf.placement.auto import _check_memory_settings

    fitted = plan(model=MODELS["7b"], hardware="a100", devices=4, algorithm="grpo",
                  workload=Workload(prompts=8, n=8, prompt_len=512, response_len=98304, micro_tokens=4096))  # fmt: skip
    with pytest.raises(InfeasiblePlacementError, match=r"only with RLHFModule\(activation_checkpointing=True, "):
        _check_memory_settings(fitted, Workload(), world_size=4)
    _check_memory_settings(fitted, Workload(activation_checkpointing=True, sequence_parallel=2), world_size=4)


def test_a_recipe_gives_its_micro_batch_and_dtypes(tmp_path: Path) -> None:
    """The memory a recipe's run needs depends on its micro-batch (rows x sequence, or a token budget) and on its
    dtypes: the compute dtype (activations, the engine's weights) and the frozen roles' (float32 by default)."""
    _, _, cpu = recipe_inputs(str(ROOT / "recipes" / "real_size_cpu.yaml"))
    assert cpu.micro_tokens == 2 * (96 + 512)  # micro_batch_size 2 of 96 + 512 tokens
    assert (cpu.activation_dtype_bytes, cpu.frozen_dtype_bytes) == (4, 4)  # float32: the defaults
    _, _, gpu = recipe_inputs(str(ROOT / "recipes" / "grpo_gsm8k.yaml"))
    assert (gpu.activation_dtype_bytes, gpu.frozen_dtype_bytes) == (2, 4)  # param_dtype bfloat16; frozen float32
    text = (ROOT / "recipes" / "grpo_gsm8k.yaml").read_text()
    budget = text.replace("micro_batch_size: 8", "micro_batch_tokens: 3000\n        micro_batch_size: 8")
    (tmp_path / "r.yaml").write_text(budget.replace("reference: true", "reference: true\n    frozen_dtype: bfloat16"))
    _, _, tokens = recipe_inputs(str(tmp_path / "r.yaml"))
    assert (tokens.micro_tokens, tokens.frozen_dtype_bytes) == (3000, 2)


def test_the_planner_counts_the_head_blocks_the_update_buffers_and_a_cpu_engine_that_stays() -> None:
    from lightning_rlhf.engines.train import head
    from lightning_rlhf.placement.cost_model import HEAD_BLOCK_ELEMENTS

    assert HEAD_BLOCK_ELEMENTS == head.HEAD_CHUNK_ELEMENTS
    qwen = ModelShape(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, tied=True)
    wl = Workload(prompts=2, n=4, prompt_len=96, response_len=512, micro_tokens=1216, activation_dtype_bytes=4)
    # 1,216 tokens x 151,936 logits are more than a block: one block's logits and gradient, not all of them
    per_token = qwen.saved_activations(checkpointing=False) + qwen.block_activations()
    assert activation_bytes(qwen, wl) == (1216 * per_token + 2 * HEAD_BLOCK_ELEMENTS) * 4
    assert update_buffers(qwen, wl) == 151936 * 896 * 12  # the tied embedding gathered, its gradient and a copy
    assert update_buffers(dataclasses.replace(qwen, tied=False), wl) == 2 * 151936 * 896 * 12
    gpu = predict([["actor", "reference"]], [2], 2, model=qwen, hardware="h100", workload=wl, algorithm="grpo")
    cpu = dataclasses.replace(hardware_for("h100"), engine_sleeps=False, engine_cache_bytes=1e8)
    kept = predict([["actor", "reference"]], [2], 2, model=qwen, hardware=cpu, workload=wl, algorithm="grpo")
    engine = 4 * qwen.params / 2
    assert kept.memory[0] - gpu.memory[0] == pytest.approx(engine + 1e8)  # the engine could sleep on the GPU
