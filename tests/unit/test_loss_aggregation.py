"""The loss and its gradients do not depend on how a mini-batch is cut, on one process: for every registered loss
aggregation, the actor's update (PPO + KL + entropy with a filtered row; the policy loss with zero-advantage rows
left out) and the critic's give the gradients of the whole mini-batch's loss written from the aggregation's
definition, whatever the rows per micro-batch (1, 3, all 8: gradient accumulation over 8, 3 or 1 backwards), with
the token budget's packing and trimming on or off, and for each optimizer step when the batch is two mini-batches.

The cases, the batch and the reference live in ``tests/scripts/loss_aggregation_check.py``, which
``tests/distributed/test_loss_aggregation_runs.py`` runs on 2 ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn

from lightning_rlhf.algorithms import MicroBatchAggregation
from lightning_rlhf.batch import Batch
from lightning_rlhf.roles.base import Role
from tests.scripts.loss_aggregation_check import (
    AGGREGATIONS,
    CASES,
    ONE_RANK,
    TOLERANCE,
    Layout,
    error,
    layout_errors,
    make_role,
    prepared,
    reference_aggregate,
    reference_gradients,
    reference_loss,
    update_gradients,
    use_layout,
)

Built = Callable[[str], tuple[Role, nn.Module, Batch]]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model's updates are faster so on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def built(tiny_model: str) -> Built:
    """Per case, made once: its role (optimizer configured), an unsharded copy of its model and its batch (the
    updates under test take no optimizer step, so the weights stay as loaded)."""
    cache: dict[str, tuple[Role, nn.Module, Batch]] = {}

    def get(case: str) -> tuple[Role, nn.Module, Batch]:
        if case not in cache:
            role = make_role(case, tiny_model)
            reference = copy.deepcopy(role.model)
            assert reference is not None
            role.configure_optimizer(10)
            cache[case] = (role, reference, prepared(case, reference))
        return cache[case]

    return get


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("case", CASES)
def test_gradients_and_loss_equal_the_whole_mini_batch_s_however_it_is_cut(
    built: Built, case: str, aggregation: str
) -> None:
    role, reference, batch = built(case)
    errors = {str(layout): errs for layout, *errs in layout_errors(case, role, reference, batch, aggregation, ONE_RANK)}
    assert len(errors) == len(ONE_RANK), errors
    assert max(max(errs) for errs in errors.values()) < TOLERANCE, errors


def test_the_checks_can_fail(built: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparisons have power: the aggregations' gradients differ by far more than the tolerance, and so do a
    whole mini-batch's loss and the mean of its halves' where the rows or tokens with a loss are uneven (what the
    2-rank run tells apart); an engine that forgets to weight the micro-batches is caught."""
    role, reference, batch = built("actor")
    grads = {mode: reference_gradients("actor", reference, batch, mode) for mode in AGGREGATIONS}
    assert all(max(float(g.abs().max()) for g in grads[mode].values()) > 1e-3 for mode in AGGREGATIONS)
    for a in AGGREGATIONS:
        for b in AGGREGATIONS:
            assert a == b or error(grads[a], grads[b]) > 100 * TOLERANCE, (a, b)
    halves = [batch.select(list(range(4))), batch.select(list(range(4, 8)))]
    with torch.no_grad():
        for mode in ("token-mean", "seq-mean-token-mean"):
            whole = reference_loss("actor", reference, batch, mode)
            mean_of_halves = sum(reference_loss("actor", reference, half, mode) for half in halves) / 2
            assert abs(float(whole - mean_of_halves)) > 0.01 * abs(float(whole)), mode
    monkeypatch.setattr(MicroBatchAggregation, "scale", property(lambda self: 1.0))
    use_layout(role, Layout(micro_batch_size=1), "seq-mean-token-sum")
    assert error(update_gradients(role, batch)[0][0], grads["seq-mean-token-sum"]) > 0.5


def test_the_reference_names_an_aggregation_it_does_not_know() -> None:
    rows: list[Tensor] = [torch.ones(2), torch.ones(0)]
    assert float(reference_aggregate(rows, "seq-mean-token-mean", 8)) == 1.0  # the empty row does not count
    assert float(reference_aggregate(rows, "seq-mean-token-sum", 8)) == 1.0  # it does here
    with pytest.raises(KeyError, match="write its definition in reference_aggregate"):
        reference_aggregate(rows, "seq-sum", 8)
