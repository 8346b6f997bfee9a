"""``AlgorithmConfig.batching.skip_zero_advantage``: the actor's update leaves out samples whose advantages are all 0,
and takes the same gradients as the update that trains every sample (one process, and two FSDP ranks over gloo)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, OptimConfig, RolloutConfig
from lightning_rlhf.config.settings import flat_names

GROUP = 4


def grouped_batch(groups: int, zero_groups: set[int], *, seed: int, vocab: int = 200) -> Batch:
    """``groups`` x :data:`GROUP` samples (each group one prompt); the groups in ``zero_groups`` get advantage 0,
    the others nonzero advantages that sum to 0 within the group (as GRPO's). Ragged responses."""
    g = torch.Generator().manual_seed(seed)
    rows = groups * GROUP
    prompts = torch.randint(4, vocab, (groups, 5), generator=g).repeat_interleave(GROUP, 0)
    resp_len = torch.randint(2, 9, (rows,), generator=g)
    response_mask = (torch.arange(8)[None, :] < resp_len[:, None]).long()
    scores = torch.randn(groups, GROUP, generator=g)
    adv = scores - scores.mean(1, keepdim=True)
    for k in zero_groups:
        adv[k] = 0.0
    batch = Batch(
        {
            "prompts": prompts,
            "prompt_mask": torch.ones(rows, 5, dtype=torch.long),
            "responses": torch.randint(4, vocab, (rows, 8), generator=g) * response_mask,
            "response_mask": response_mask,
            "advantages": adv.reshape(rows, 1) * response_mask,
        }
    )
    batch.meta["group_size"] = GROUP
    return batch


def grouped(*flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``AlgorithmConfig`` keywords for settings given by their flat names (``kl_coef`` -> ``kl``)."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in (item for settings in flat for item in settings.items()):
        group, name = flat_names(AlgorithmConfig)[key]
        groups.setdefault(group, {})[name] = value
    return groups


def make_actor(
    path: str, *, skip: bool, micro_batch_tokens: int | None = None, param_dtype: str | None = None, **algo: Any
) -> Any:
    """An ActorRole on the tiny model with an optimizer whose step moves the weights visibly (weight decay too, so a
    step on zero gradients is not a no-op). Runs on: this process (sharded when a process group is up)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    from lightning_rlhf.roles import ActorRole

    batching = {"micro_batch_size": 3, "micro_batch_tokens": micro_batch_tokens, "skip_zero_advantage": skip}
    actor = ActorRole(
        path,
        tokenizer=AutoTokenizer.from_pretrained(path),
        rollout=RolloutConfig(n=GROUP, max_new_tokens=8),
        algorithm=AlgorithmConfig(**grouped(batching, algo)),
        optim=OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.0),
    )
    actor.load()
    if dist.is_initialized():
        dtype = getattr(torch, param_dtype) if param_dtype else None
        actor.train_engine.shard(init_device_mesh("cpu", (dist.get_world_size(),)), param_dtype=dtype)
        actor.train_engine.materialize(torch.device("cpu"))
    actor.configure_optimizer(total_steps=10)
    return actor


def record_gradients(actor: Any) -> list[dict[str, Tensor]]:
    """Make the actor's engine keep the full gradients of each optimizer step (gathered when sharded: a
    collective), taken before the step; returns the list they are appended to."""
    engine, steps = actor.train_engine, []
    step = engine.step

    def recording() -> Any:
        grads = {}
        for name, p in engine.model.named_parameters():
            g = p.grad
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        steps.append(grads)
        return step()

    engine.step = recording
    return steps


def assert_same_gradients(got: list[dict[str, Tensor]], ref: list[dict[str, Tensor]]) -> None:
    """Gradients agree up to float rounding (Adam would turn rounding noise in near-zero gradients into weight
    differences of about lr, so the weights are not the thing to compare)."""
    assert len(got) == len(ref) == 1
    largest = max(float(g.abs().max()) for g in ref[0].values())
    assert largest > 1e-4  # a real gradient, so agreement means something
    for k, g in ref[0].items():
        torch.testing.assert_close(got[0][k], g, rtol=1e-5, atol=1e-6 * largest)


def weights(actor: Any) -> dict[str, Tensor]:
    """Full parameters (gathered when sharded: a collective)."""
    out = {}
    for name, p in actor.model.named_parameters():
        data = p.data
        out[name] = (data.full_tensor() if hasattr(data, "full_tensor") else data).detach().clone()
    return out


def assert_same_weights(got: dict[str, Tensor], ref: dict[str, Tensor], before: dict[str, Tensor]) -> None:
    moved = max(float((ref[k] - before[k]).abs().max()) for k in ref)
    assert moved > 1e-5  # the update changed the weights, so agreement means something
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("micro_batch_tokens", [None, 30])
def test_the_update_skips_zero_advantage_samples_and_takes_the_same_gradients(
    tiny_model: str, micro_batch_tokens: int | None
) -> None:
    batch = grouped_batch(4, {1, 2}, seed=0)
    calls: dict[bool, list[int]] = {}
    results = {}
    for skip in (False, True):
        actor = make_actor(tiny_model, skip=skip, micro_batch_tokens=micro_batch_tokens)
        seen: list[int] = []
        forward = actor._policy_loss

        def counting(micro: Batch, *args: Any, _seen: list[int] = seen, _f: Any = forward) -> Any:
            _seen.append(len(micro))
            return _f(micro, *args)

        actor._policy_loss = counting
        grads = record_gradients(actor)
        metrics = actor.update(batch)
        calls[skip] = seen
        results[skip] = (grads, metrics)
    assert sum(calls[False]) == 16 and sum(calls[True]) == 8  # two of four groups carry no gradient
    assert results[True][1]["actor/skipped_rows"] == pytest.approx(0.5)
    assert "actor/skipped_rows" not in results[False][1]
    assert_same_gradients(results[True][0], results[False][0])


def test_seq_mean_token_mean_stays_exact_with_rows_that_have_no_loss_token(tiny_model: str) -> None:
    """``seq-mean-token-mean`` averages over the rows with a loss token (DAPO's overlong filtering empties a
    truncated row's ``loss_mask``): skipped or not, and in micro-batches or not, the gradient is the one-pass one."""
    batch = grouped_batch(3, {1}, seed=4)
    loss_mask = batch["response_mask"].clone()
    loss_mask[[0, 9]] = 0  # a truncated row in a trained group and one in another group
    batch["loss_mask"] = loss_mask
    got = {}
    for skip, micro in ((False, 100), (False, 3), (True, 3)):
        actor = make_actor(tiny_model, skip=skip, loss_agg="seq-mean-token-mean")
        actor.train_engine.micro_batch_size = micro
        got[(skip, micro)] = record_gradients(actor)
        actor.update(batch)
    assert_same_gradients(got[(False, 3)], got[(False, 100)])
    assert_same_gradients(got[(True, 3)], got[(False, 100)])


def test_a_batch_with_no_gradient_anywhere_is_trained_whole(tiny_model: str) -> None:
    """No sample to train on any rank: nothing is skipped (the step's metrics, such as the entropy, are still
    measured), and AdamW steps on the zero gradients (weight decay moves the weights) exactly as without skipping."""
    batch = grouped_batch(2, {0, 1}, seed=1)
    out = {}
    for skip in (False, True):
        actor = make_actor(tiny_model, skip=skip)
        before = weights(actor)
        metrics = actor.update(batch)
        out[skip] = weights(actor)
    assert metrics["actor/skipped_rows"] == 0.0 and metrics["actor/grad_norm"] == 0.0 and "actor/entropy" in metrics
    assert_same_weights(out[True], out[False], before)


@pytest.mark.parametrize(
    "algo",
    [{"entropy_coef": 0.01}, {"kl_coef": 0.1, "kl_in_reward": False}, {"skip_zero_advantage": False}],
    ids=["entropy", "kl-loss", "off"],
)
def test_nothing_is_skipped_when_a_zero_advantage_sample_still_has_a_gradient(
    tiny_model: str, algo: dict[str, Any]
) -> None:
    batch = grouped_batch(2, {0}, seed=2)
    if "kl_coef" in algo:
        batch["ref_logprobs"] = torch.full(batch["response_mask"].shape, -5.0)
    skip = algo.pop("skip_zero_advantage", True)
    actor = make_actor(tiny_model, skip=skip, **algo)
    metrics = actor.update(batch)
    assert "actor/skipped_rows" not in metrics


def _two_ranks(
    rank: int, world: int, init: str, path: str, out: str, zero: list[list[int]], whole: bool = False
) -> None:
    """One rank: the update with and without skipping on this rank's batch; rank 0 saves the weights. ``whole``:
    with ``reshard_in_update=False`` and a token budget (trimmed micro-batches, stand-ins under deferred gradient
    reduction)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        batch = grouped_batch(3, set(zero[rank]), seed=10 + rank)
        saved: dict[str, Any] = {}
        for skip in (False, True):
            actor = make_actor(path, skip=skip, micro_batch_tokens=30 if whole else None)
            actor.train_engine.reshard_in_update = not whole
            saved["before"] = weights(actor)
            grads = record_gradients(actor)
            metrics = actor.update(batch)
            saved[str(skip)] = weights(actor)
            saved[f"grads{skip}"] = grads
            saved[f"metrics{skip}"] = metrics
        torch.save(saved, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("zero", "whole"),
    [([[0, 1, 2], [1]], False), ([[0, 1, 2], [0, 1, 2]], False), ([[], [2]], False), ([[0, 1, 2], [1]], True)],
    ids=["one-rank-trains-nothing", "no-rank-trains", "uneven", "one-rank-trains-nothing-whole-params-token-budget"],
)
def test_two_fsdp_ranks_skip_apart_and_end_with_the_same_weights(
    tiny_model: str, tmp_path: Any, zero: list[list[int]], whole: bool
) -> None:
    """FSDP forwards are collectives: a rank with fewer rows to train (or none) runs stand-ins, not fewer forwards;
    the gradients (and the weights, when no rank trains) equal those of the update that trains every sample."""
    import torch.multiprocessing as mp

    init = f"file://{tmp_path}/store"
    mp.start_processes(
        _two_ranks, args=(2, init, tiny_model, str(tmp_path), zero, whole), nprocs=2, start_method="spawn"
    )
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    nothing = len(zero[0]) + len(zero[1]) == 6  # no gradient anywhere: trained whole
    assert r0["metricsTrue"]["actor/skipped_rows"] == pytest.approx(0 if nothing else len(zero[0]) / 3)
    assert r1["metricsTrue"]["actor/skipped_rows"] == pytest.approx(0 if nothing else len(zero[1]) / 3)
    if nothing:  # the step on zero gradients (weight decay) is exact
        assert_same_weights(r0["True"], r0["False"], r0["before"])
    else:
        assert_same_gradients(r0["gradsTrue"], r0["gradsFalse"])
    for k in r0["True"]:
        assert torch.equal(r0["True"][k], r1["True"][k])


def test_the_controller_balances_the_rows_that_train_over_ranks_in_whole_groups(tiny_model: str) -> None:
    """``ActorRole.split_costs`` gives a row's tokens if it trains, else 0; the DP split then gives every rank as
    many groups and about as many trained tokens, each group whole and in batch order."""
    from lightning_rlhf.controller.dispatch import COSTS_KEY, ROWS_KEY, Dispatch, _mark_balance, split_args

    actor = make_actor(tiny_model, skip=True)
    batch = grouped_batch(4, {0, 1}, seed=3)  # contiguous halves would give rank 0 nothing to train
    costs = actor.split_costs("update", batch)
    tokens = (batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)).tolist()
    assert costs == [0] * 8 + tokens[8:]
    assert actor.split_costs("log_prob", batch) is None
    parts = split_args(Dispatch.DP_SPLIT, (_mark_balance(batch, False, costs),), {}, 2, where="update")
    rows = [part[0][0].meta[ROWS_KEY] for part in parts if part is not None]
    assert sorted(r for rs in rows for r in rs) == list(range(16))
    for rs in rows:
        assert len(rs) == 8 and rs == sorted(rs)
        assert all(rs[k : k + GROUP] == list(range(rs[k], rs[k] + GROUP)) for k in range(0, 8, GROUP))
        assert sum(costs[r] for r in rs) > 0  # each rank trains one of the two groups with a gradient
    assert all(COSTS_KEY not in part[0][0].meta for part in parts if part is not None)

    mini = make_actor(tiny_model, skip=True, mini_batch_size=8)  # two optimizer steps: rows keep their order
    assert mini.split_costs("update", batch) is None
    assert make_actor(tiny_model, skip=False).split_costs("update", batch) is None


def test_metrics_a_rank_lacks_are_averaged_over_the_ranks_that_report_them() -> None:
    """A rank whose samples all had zero advantages trains nothing and reports no loss metrics."""
    from lightning_rlhf.controller.dispatch import Dispatch, merge_results

    merged = merge_results(
        Dispatch.DP_SPLIT, [{"actor/grad_norm": 1.0}, {"actor/pg_loss": 4.0, "actor/grad_norm": 3.0}]
    )
    assert merged == {"actor/grad_norm": 2.0, "actor/pg_loss": 4.0}


def test_a_one_rank_split_gives_a_batch_of_its_own_without_the_costs() -> None:
    """The worker's part may come back with new columns that the caller merges into its batch: it must not share
    the caller's column dict."""
    from lightning_rlhf.controller.dispatch import COSTS_KEY, Dispatch, _mark_balance, split_args

    batch = grouped_batch(1, set(), seed=5)
    marked = _mark_balance(batch, False, [1] * len(batch))
    parts = split_args(Dispatch.DP_SPLIT, (marked,), {}, 1, where="update")
    assert parts[0] is not None
    part = parts[0][0][0]
    assert part.tensors is not marked.tensors and COSTS_KEY not in part.meta
    part["logprobs"] = torch.zeros(len(part), 8)
    marked.update(part)  # what the controller does with a worker's returned batch
    assert "logprobs" in marked
