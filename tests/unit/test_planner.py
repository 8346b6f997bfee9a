"""The auto-mapping planner (lightning_rlhf/planner.py): enumeration, the cost model on hand-computed cases, the
placement rules, the errors, and the ``plan`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_rlhf.cli import main as cli_main
from lightning_rlhf.planner import (
    HARDWARE,
    MODELS,
    Hardware,
    InfeasiblePlacementError,
    ModelShape,
    Workload,
    calibrate_for_shape,
    dataflow_for,
    device_splits,
    fit_call_costs,
    measure_host_overheads,
    plan,
    predict,
    recipe_inputs,
    save_call_costs,
    set_partitions,
    with_saved_call_costs,
)

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
    per_seq = SHAPE.kv_bytes_per_token() * 8
    states = 16 * SHAPE.params + 2 * SHAPE.params  # the actor's FSDP states and its engine's weights, 1 device
    roomy = Hardware(**{**UNIT.__dict__, "memory": states + 8 * per_seq})
    tight = Hardware(**{**UNIT.__dict__, "memory": states + 2 * per_seq})
    kw = {"model": SHAPE, "workload": wl, "algorithm": dataflow_for(["actor"])}
    one_wave = predict([["actor"]], [1], 1, hardware=roomy, **kw).stage_s[0]
    four_waves = predict([["actor"]], [1], 1, hardware=tight, **kw).stage_s[0]
    # compute-bound decoding is linear in the batch: the same total work, here in 4 waves of 2 sequences
    assert four_waves == pytest.approx(one_wave)
    slow_memory = Hardware(**{**tight.__dict__, "hbm_bw": 1e9})  # now each decoding step reads the weights
    read = (2 * SHAPE.params + 2 * 6 * SHAPE.kv_bytes_per_token()) / 1e9
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
    small = plan(model=MODELS["7b"], hardware=HARDWARE["a100"], devices=16, workload=Workload())
    assert small.groups == (("actor", "critic", "reference", "reward"),)
    large = plan(model=MODELS["34b"], hardware=HARDWARE["a100"], devices=1024, workload=Workload())
    assert len(large.groups) > 1
    assert sum(large.devices) == 1024
    colocated = predict(
        [["actor", "critic", "reference", "reward"]], [1024], large.rollout_tp, model=MODELS["34b"],
        hardware=HARDWARE["a100"], workload=Workload(),
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
    step_s, micro_s = measure_host_overheads(repeats=2)
    assert 0 < step_s < 0.01 and 0 < micro_s < 0.1  # per layer: microseconds to milliseconds on any CPU


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
