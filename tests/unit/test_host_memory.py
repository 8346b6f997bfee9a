"""``controller/host_memory.py``: freed heap goes back to the system; the worker loop calls it after each call."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_rlhf.controller import host_memory as glibc

CHILD = """
import torch
from lightning_rlhf.controller.host_memory import release_free_heap

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

blocks = [torch.ones(16 * 1024) for _ in range(8192)]  # 64 KiB each: glibc puts them in its heap, 512 MiB
del blocks[::2]  # every other one freed: holes below live blocks, which the heap's own trim cannot reach
held = rss_mib()
assert release_free_heap()
print(held, rss_mib())
"""


@pytest.mark.skipif(glibc._libc() is None or not sys.platform.startswith("linux"), reason="glibc only")
def test_release_free_heap_returns_the_holes_of_freed_tensors() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    held, after = map(float, out.stdout.split())
    assert held - after > 200  # of the 256 MiB freed, at least 200 come back


def test_the_worker_loop_releases_the_heap_after_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from test_dispatch import Scorer  # tests/unit, on sys.path

    from lightning_rlhf.batch import Batch
    from lightning_rlhf.controller import controller
    from lightning_rlhf.controller.dispatch import controller_active

    calls: list[str] = []
    monkeypatch.setattr(controller, "release_free_heap", lambda: calls.append("released") or True)
    scorer = Scorer()
    ctl = controller.Controller({"scorer": scorer}.__getitem__, rank=0, world_size=1)  # type: ignore[arg-type]
    with controller_active(ctl):
        scorer.score(Batch({"x": torch.arange(4)}))
        scorer.prefixed(Batch({"x": torch.arange(4)}))
    assert calls == ["released", "released"]
