"""FSDP2's "returned a view tensor ... will silently drop the pre-backward hook" warning (issue 31, item 4): in our
training forwards no pre-backward hook is dropped, with ``reshard_after_forward=True`` on 2 gloo ranks the
gradients equal an unsharded model's, and the warning no longer appears.

``tests/scripts/fsdp_backward_check.py`` (under torchrun) asserts the hooks, the resharding, the gradients and the
absence of FSDP2 warnings per case; here its counts are checked: the default CPU path (oneDNN linears) returns no
view, so ``shard_model``'s forward hook copies nothing; PyTorch's own linear value head does return one, which the
hook copies, and then even an in-place op on the model's output keeps every unit's hook.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from lightning_rlhf.cpu.onednn import fp32_through_onednn, linear
from tests.conftest import ROOT, SCRIPTS, failure_text


def test_onednn_linear_returns_no_view_of_a_3d_input() -> None:
    x = torch.randn(2, 5, 16, requires_grad=True)
    weight, bias = torch.randn(7, 16, requires_grad=True), torch.randn(7, requires_grad=True)
    for args in ((x, weight, None), (x, weight, bias)):
        out = linear(*args)
        assert out._base is None  # FSDP2 registers its pre-backward hook on such a model output
        torch.testing.assert_close(out, torch.nn.functional.linear(*args), rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            assert linear(*args)._base is None


def test_no_pre_backward_hook_is_dropped_and_fsdp_does_not_warn(tiny_model: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "FSDP_CHECK_MODEL": tiny_model}
    proc = subprocess.run(
        [*cmd, str(SCRIPTS / "fsdp_backward_check.py")], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, failure_text(proc)
    lines = sorted(line.split() for line in proc.stdout.splitlines() if line.startswith("OK"))
    cases = ["actor", "actor-packed", "critic", "critic-plain"]
    assert sorted((line[1], line[2]) for line in lines) == sorted((r, c) for r in "01" for c in cases)
    for _, rank, case, hooks, warnings, copies in lines:
        ran, units = hooks.split("/")
        assert ran == units and int(units) >= 3, (rank, case, hooks)  # each decoder layer and the root, each backward
        assert warnings == "0", (rank, case)
        # the default path's outputs are no views: nothing copied; a linear value head with a bias through PyTorch's
        # F.linear returns one: one copy per forward (2 micro-batches)
        views = case == "critic-plain" or (case == "critic" and not fp32_through_onednn())
        assert copies == ("2" if views else "0"), (rank, case, copies)
