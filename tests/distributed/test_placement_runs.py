"""Roles on rank pools of their own (``RLHFStrategy(placement=...)``), 2 and 4 processes over gloo.

Each test runs ``tests/scripts/train.py`` as a subprocess (Lightning's launcher starts the other ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import failure_text, run_script
from tests.distributed.test_training import check_ok, read_metrics

pytestmark = pytest.mark.slow

SPLIT_2 = json.dumps({"actor": [0], "reward": [0], "critic": [1], "reference": [1]})


def test_split_ppo_runs_stages_concurrently_and_resumes_exactly(demo_model: str, tmp_path: Path) -> None:
    """Actor + reward on rank 0, critic + reference on rank 1: the two updates (and the two pools' scoring calls)
    run at the same time, and a resumed run continues exactly like the uninterrupted one."""
    straight, first, second, ckpt = (tmp_path / name for name in ("straight", "first", "second", "ckpt"))
    common = ["--model", demo_model, "--algo", "ppo", "--kl-coef", "0.01", "--devices", "2", "--placement", SPLIT_2]
    check_ok(run_script("train.py", *common, "--out", str(straight), "--steps", "5"))
    rows = read_metrics(straight)[1:]  # the first step starts the reward workers
    both = [float(r["timing_s/update_actor"]) + float(r["timing_s/update_critic"]) for r in rows]
    stage = [float(r["timing_s/stage_update"]) for r in rows]
    longer = [max(float(r["timing_s/update_actor"]), float(r["timing_s/update_critic"])) for r in rows]
    # Disjoint pools: the two calls overlap. Each call's time lies within its stage's, so one after the other the
    # stage would take at least their sum, whatever the machine's load; overlapping, it takes less.
    assert sum(stage) < sum(both), (stage, both)
    assert all(s >= 0.9 * m for s, m in zip(stage, longer, strict=True)), (stage, longer)
    for row in rows:
        assert float(row["critic/vf_loss"]) > 0 and float(row["actor/grad_norm"]) > 0

    check_ok(run_script("train.py", *common, "--out", str(first), "--steps", "3", "--save-ckpt", str(ckpt)))
    assert {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= {p.name for p in ckpt.iterdir()}  # one file per rank
    check_ok(run_script("train.py", *common, "--out", str(second), "--steps", "5", "--resume", str(ckpt)))
    full, resumed = read_metrics(straight), read_metrics(second)
    assert [int(r["step"]) for r in resumed] == [3, 4]
    for a, b in zip(full[3:], resumed, strict=True):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/values/mean"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6), key
    end_full = json.loads((straight / "result.json").read_text())["param_checksum"]
    end_resumed = json.loads((second / "result.json").read_text())["param_checksum"]
    assert end_full == pytest.approx(end_resumed, rel=1e-6)


def test_lora_with_the_reference_apart_from_the_actor_resumes_exactly(demo_model: str, tmp_path: Path) -> None:
    """LoRA GRPO with the actor on rank 0 and the reference on rank 1: the reference, away from the actor's shards,
    loads a base of its own; the checkpoint leaves the actor's frozen base out and resumes like the straight run."""
    from torch.distributed.checkpoint import FileSystemReader

    placement = json.dumps({"actor": [0], "reward": [0], "reference": [1]})
    common = [
        "--model",
        demo_model,
        "--devices",
        "2",
        "--kl-coef",
        "0.05",
        "--lora-rank",
        "8",
        "--placement",
        placement,
    ]
    straight, first, second, ckpt = (tmp_path / name for name in ("straight", "first", "second", "ckpt"))
    check_ok(run_script("train.py", *common, "--out", str(straight), "--steps", "4"))
    check_ok(run_script("train.py", *common, "--out", str(first), "--steps", "2", "--save-ckpt", str(ckpt)))
    keys = list(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    actor = [key for key in keys if key.startswith("state_dict.actor.")]
    assert actor and all(".lora_" in key for key in actor), actor[:4]
    assert any(key.startswith("state_dict.reference.") for key in keys)  # its own (frozen, full) copy
    check_ok(run_script("train.py", *common, "--out", str(second), "--steps", "4", "--resume", str(ckpt)))
    full, resumed = read_metrics(straight), read_metrics(second)
    assert [int(r["step"]) for r in resumed] == [2, 3]
    for a, b in zip(full[2:], resumed, strict=True):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-7), key
    assert float(full[-1]["actor/kl_loss"]) > 0  # the reference is the base, not the adapted actor


def test_four_ranks_two_pools(demo_model: str, tmp_path: Path) -> None:
    """GRPO with a reference on 4 processes: actor + reward FSDP-sharded over ranks {0, 1}, the reference over
    {2, 3}; every batch is split by its pool's size. Then with ``sequence_parallel=2``: each pool is one group of 2
    ranks (made within the pool: the reference's on ranks 2 and 3, neither of them the controller's), every rank
    runs the Ulysses attention, and the run equals the plain one (losses, gradient norms and KL at every step within
    1e-5, the weights at the end)."""
    placement = json.dumps({"actor": [0, 1], "reward": [0, 1], "reference": [2, 3]})
    args = ["--model", demo_model, "--devices", "4", "--kl-coef", "0.05", "--steps", "3", "--placement", placement]
    out, split = tmp_path / "run", tmp_path / "sp"
    check_ok(run_script("train.py", *args, "--out", str(out), timeout=420))
    rows = read_metrics(out)
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for row in rows:
        assert float(row["timing_s/ref"]) > 0 and float(row["actor/grad_norm"]) > 0
    # The reference is the initial policy: no KL before the first update, some after it (k3 is never negative).
    kl = [float(row["actor/kl_loss"]) for row in rows]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and all(k > 0 for k in kl[1:]), kl
    assert json.loads((out / "result.json").read_text())["global_step"] == 3

    check_ok(run_script("train.py", *args, "--out", str(split), "--sequence-parallel", "2", timeout=420))
    calls = [int((split / f"ulysses_calls.{rank}").read_text()) for rank in range(4)]
    assert all(c > 0 for c in calls), calls  # the actor's pool (0, 1) and the reference's (2, 3) split sequences
    for a, b in zip(rows, read_metrics(split), strict=True):
        for key in ("actor/grad_norm", "actor/pg_loss", "actor/kl_loss"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-5, abs=1e-7), (a["step"], key)
    ends = [json.loads((run / "result.json").read_text())["param_checksum"] for run in (out, split)]
    assert ends[1] == pytest.approx(ends[0], rel=1e-6)


@pytest.mark.parametrize(
    ("placement", "extra", "words"),
    [
        ({"actor": [0], "reward": [0, 2]}, [], ["names rank 2", "2 processes"]),
        ({"actor": [0]}, [], ["gives no ranks to ['reward']"]),
        (  # a pool smaller than the sequence-parallel size
            {"actor": [0], "reward": [1]},
            ["--sequence-parallel", "2"],
            ["RLHFModule(sequence_parallel=2)", "'actor' runs on the pool [0]", "a multiple of 2 ranks"],
        ),
    ],
)
def test_a_bad_placement_fails_before_any_model_loads(
    demo_model: str, tmp_path: Path, placement: dict, extra: list[str], words: list[str]
) -> None:
    proc = run_script(
        "train.py",
        "--model",
        demo_model,
        "--devices",
        "2",
        "--out",
        str(tmp_path),
        "--placement",
        json.dumps(placement),
        *extra,
    )
    assert proc.returncode != 0
    text = failure_text(proc)
    for word in words:
        assert word in text, text
    assert not (tmp_path / "metrics.csv").exists()
    # raised in the launching process, before it started rank 1 or any process group (Lightning logs each rank's
    # "Initializing distributed: GLOBAL_RANK: ..." when it joins one)
    assert "Initializing distributed" not in text, text


def test_auto_placement_chooses_and_trains(demo_model: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--model", demo_model, "--algo", "ppo", "--devices", "2", "--steps", "2", "--placement", "auto"]
    proc = run_script("train.py", *args, "--out", str(out))
    assert proc.returncode == 0, failure_text(proc)
    line = next(x for x in proc.stdout.splitlines() if "placement='auto'" in x)
    chosen = json.loads(line.split("placement='auto': ")[1].split(" (predicted")[0].replace("'", '"'))
    assert set(chosen) == {"actor", "critic", "reference", "reward"}
    assert all(set(ranks) <= {0, 1} for ranks in chosen.values()) and 0 in chosen["actor"]
    assert len(read_metrics(out)) == 2
