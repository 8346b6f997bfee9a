"""The loss and its gradients do not depend on the number of data-parallel ranks or on sequence parallelism:
``loss_aggregation_check.py`` under torchrun (2 processes, gloo, FSDP2) splits one mini-batch over the ranks as the
controller does (contiguous halves with 21 and 7 response tokens; balanced by tokens with the token budget; by
trained tokens when zero-advantage rows are skipped, which leaves one rank none; once as two mini-batches), or
gives both ranks every row as one sequence-parallel group (SP=2: each rank runs half of every sequence, through
the Ulysses attention; 3 rows per micro-batch, and one row with the token budget over two mini-batches), and
compares the gathered gradients of the actor's and the critic's updates, and the loss metrics they report, with
those of each mini-batch's loss written from each aggregation's definition (the one-rank updates are compared with
the same reference in ``tests/unit/test_loss_aggregation.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT, SCRIPTS, failure_text
from tests.scripts.loss_aggregation_check import AGGREGATIONS, CASES, TOLERANCE, TWO_RANKS


def test_two_ranks_give_the_whole_mini_batch_gradients_and_loss_for_every_aggregation(tiny_model: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, str(SCRIPTS / "loss_aggregation_check.py"), "--model", tiny_model],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, failure_text(proc)
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    results = {tuple(line[1:5]): (float(line[5]), float(line[6])) for line in lines}  # gradient, loss metrics
    expected = {(r, c, a, str(layout)) for r in "01" for c in CASES for a in AGGREGATIONS for layout in TWO_RANKS}
    assert set(results) == expected, sorted(expected ^ set(results))
    wrong = {key: errs for key, errs in results.items() if not max(errs) < TOLERANCE}
    assert not wrong, wrong
