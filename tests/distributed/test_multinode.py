"""Multi-node through Lightning, on loopback: 2 torchrun "nodes" x 2 processes train like 1 node x 4.

Both runs use ``tests/scripts/multinode_train.py`` (``Trainer(num_nodes=..., devices=...)`` under torchrun, so
Lightning sees ``TorchElasticEnvironment`` and starts no process itself). Global ranks are the same in both
layouts (``node_rank * nproc_per_node + local_rank``), so with the same seed every logged value must agree.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_rlhf.controller.liveness import Liveness, machine_id
from tests.conftest import ROOT, SCRIPTS

COMPARED = [
    "critic/score/mean",
    "reward/addition_reward/mean",
    "critic/advantages/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "response_length/mean",
]


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (all held open at once while they are picked)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _torchrun(out: Path, *, nnodes: int, node_rank: int, nproc: int, port: int, model: str) -> subprocess.Popen[str]:
    """One torchrun agent (one "node"), writing its output to ``<out>.node<k>.log``."""
    log = open(f"{out}.node{node_rank}.log", "w")  # noqa: SIM115 (closed with the process below)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        str(SCRIPTS / "multinode_train.py"),
        "--model",
        model,
        "--out",
        str(out),
        "--num-nodes",
        str(nnodes),
        "--devices",
        str(nproc),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "offline",
    }
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT), env=env)
    log.close()
    return proc


def _wait_all(procs: dict[str, subprocess.Popen[str]], logs: dict[str, Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, proc in procs.items():
        if proc.returncode != 0:
            tail = logs[name].read_text()[-6000:]
            pytest.fail(f"{name} exited with {proc.returncode}\n--- {logs[name]} (end)\n{tail}")


def _rows(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _views(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
def test_two_nodes_by_two_match_one_node_by_four(demo_model: str, tmp_path: Path) -> None:
    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    port_one, port_two = _free_ports(2)
    # All three agents at once: the machine has 2 cores, and each run spends part of its time waiting.
    procs = {
        "1x4": _torchrun(one, nnodes=1, node_rank=0, nproc=4, port=port_one, model=demo_model),
        "2x2 node 0": _torchrun(two, nnodes=2, node_rank=0, nproc=2, port=port_two, model=demo_model),
        "2x2 node 1": _torchrun(two, nnodes=2, node_rank=1, nproc=2, port=port_two, model=demo_model),
    }
    logs = {
        "1x4": Path(f"{one}.node0.log"),
        "2x2 node 0": Path(f"{two}.node0.log"),
        "2x2 node 1": Path(f"{two}.node1.log"),
    }
    _wait_all(procs, logs, timeout_s=240)

    # Lightning saw torchrun's environment and the 2x2 layout; the controller is rank 0 = local rank 0 of node 0.
    views = _views(two)
    assert [(v["global_rank"], v["node_rank"], v["local_rank"]) for v in views] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert [v["env_node_rank"] for v in views] == [0, 0, 1, 1]  # torchrun's GROUP_RANK: two agents really ran
    assert {v["cluster_environment"] for v in views} == {"TorchElasticEnvironment"}
    assert {v["launcher"] for v in views} == {"ExternalLauncher"}
    assert {v["world_size"] for v in views} == {4}
    assert [v["node_rank"] for v in _views(one)] == [0, 0, 0, 0]

    rows_one, rows_two = _rows(one), _rows(two)
    assert [int(r["step"]) for r in rows_two] == [0, 1, 2]
    assert [int(r["step"]) for r in rows_one] == [0, 1, 2]
    for a, b in zip(rows_one, rows_two, strict=True):
        for key in COMPARED:
            assert math.isfinite(float(b[key])), key
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-5, abs=1e-6), (a["step"], key)
    # The comparison means something: the policy learned (non-zero gradients) and the rewards moved.
    assert all(float(r["actor/grad_norm"]) > 0 for r in rows_two)
    assert len({r["critic/score/mean"] for r in rows_two}) > 1
    end_one = json.loads((one / "result.json").read_text())
    end_two = json.loads((two / "result.json").read_text())
    assert end_two["global_step"] == end_one["global_step"] == 3
    assert end_two["param_checksum"] == pytest.approx(end_one["param_checksum"], rel=1e-6)


def test_a_rank_on_another_machine_is_never_taken_for_a_local_child() -> None:
    """Rank 0's child and rank 1 on another machine have the same pid (separate pid spaces): rank 1 is judged by
    its heartbeat, not by the child's exit; a same-machine rank with that pid is the child and is named by signal."""
    store = dist.HashStore()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # Ranks 1 and 2 publish what they would: rank 1 from node 1, another machine with the same host name (two
        # containers, say), rank 2 from this machine.
        host = socket.gethostname()
        here, there = machine_id(), f"{host}|other-boot|pid:[4026531836]"
        for r, machine in ((1, there), (2, here)):
            store.set(f"lightning_rlhf/rank/{r}", json.dumps({"pid": child.pid, "host": host, "machine": machine}))
        controller = Liveness(store, 0, 3, children=[child], heartbeat_timeout_s=1.0)
        controller.publish()
        remote = Liveness(store, 1, 3, heartbeat_timeout_s=1.0)
        assert controller.machines[0] == controller.machine
        assert not controller.is_child(1)
        assert controller.is_child(2)

        remote.beat()
        assert controller._death_of(1, child.pid, host) is None  # first heartbeat seen
        child.send_signal(signal.SIGKILL)
        child.wait()
        death = controller._death_of(2, child.pid, host)
        assert death is not None and death.signal == signal.SIGKILL  # the child: its real signal
        remote.beat()
        assert controller._death_of(1, child.pid, host) is None  # the remote rank still beats
        time.sleep(1.2)
        death = controller._death_of(1, child.pid, host)  # no beat for longer than the timeout
        assert death is not None and death.signal is None and f"no heartbeat from {host}" in death.how
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
