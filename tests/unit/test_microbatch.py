"""Micro-batches without padding: trimming is exact, the token-budget plan and the rank partition keep their promises,
``infer`` puts rows back in order, ``train`` computes the same gradients, and the setting reaches every role."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from lightning_rlhf.algorithms import MicroBatchAggregation
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, BatchingConfig, KLConfig, OptimConfig
from lightning_rlhf.controller.dispatch import (
    BALANCE_KEY,
    ROWS_KEY,
    Dispatch,
    controller_active,
    merge_results,
    split_args,
)
from lightning_rlhf.engines.train import TrainEngine, forward_response
from lightning_rlhf.engines.train.microbatch import (
    balanced_partition,
    plan_micro_batches,
    response_aligned,
    row_spans,
    split_to_count,
    trim_padding,
)
from lightning_rlhf.roles import ReferenceRole

PROMPT_LENS = [3, 1, 5, 2, 4, 1, 3, 2]
RESPONSE_LENS = [2, 7, 1, 4, 3, 6, 1, 5]


def ragged_batch(
    prompt_lens: list[int] = PROMPT_LENS,
    response_lens: list[int] = RESPONSE_LENS,
    *,
    width_p: int = 7,
    width_r: int = 9,
    seed: int = 0,
) -> Batch:
    """Left-padded prompts and right-padded responses wider than any row (so every micro-batch has padding columns
    on both sides), with the response-aligned columns an update reads."""
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt_lens)
    cols_p, cols_r = torch.arange(width_p), torch.arange(width_r)
    prompt_mask = (cols_p >= width_p - torch.tensor(prompt_lens)[:, None]).long()
    response_mask = (cols_r < torch.tensor(response_lens)[:, None]).long()
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width_r) * response_mask
    return Batch(
        {
            "prompts": torch.randint(4, 300, (rows, width_p), generator=g) * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": torch.randint(4, 300, (rows, width_r), generator=g) * response_mask,
            "response_mask": response_mask,
            "advantages": advantages.contiguous(),
            "old_logprobs": -torch.rand(rows, width_r, generator=g) * response_mask,
            "uid": torch.arange(rows) // 2,
        },
        {"prompt": [f"p{i}" for i in range(rows)]},
        {"step": 3},
    )


def logprobs(model: torch.nn.Module, micro: Batch) -> dict[str, Tensor]:
    return forward_response(model, micro, output="logprobs", with_entropy=True, entropy_grad=False)


# ------------------------------------------------------------------------------------------------ trim_padding
def test_trim_cuts_each_side_by_its_own_rule_even_when_prompt_and_response_widths_agree() -> None:
    b = ragged_batch([1, 2], [1, 3], width_p=5, width_r=5)  # P == R: names, not widths, tell the prompt side
    b["prompt_extra"] = torch.arange(10).reshape(2, 5)  # another prompt-aligned column
    b["loss_mask"] = b["response_mask"].clone()
    b["values3d"] = torch.arange(2 * 5 * 2).reshape(2, 5, 2)  # response-aligned with a trailing dim
    b["scores"] = torch.tensor([1.0, 2.0])
    assert set(response_aligned(b)) == {"responses", "response_mask", "advantages", "old_logprobs", "loss_mask"} | {
        "values3d"
    }
    assert row_spans(b) == [(1, 1), (2, 3)]
    t = trim_padding(b)
    assert t["prompts"].shape == t["prompt_mask"].shape == t["prompt_extra"].shape == (2, 2)
    assert torch.equal(t["prompts"], b["prompts"][:, 3:]) and torch.equal(t["prompt_extra"], b["prompt_extra"][:, 3:])
    for key in ("responses", "response_mask", "advantages", "old_logprobs", "loss_mask"):
        assert torch.equal(t[key], b[key][:, :3]), key
    assert torch.equal(t["values3d"], b["values3d"][:, :3])
    assert torch.equal(t["scores"], b["scores"]) and torch.equal(t["uid"], b["uid"])
    assert t["prompt"] == b["prompt"] and t.meta == b.meta
    assert trim_padding(b, responses=False)["responses"].shape == (2, 5)
    assert trim_padding(b, responses=False)["prompts"].shape == (2, 2)


def test_trim_keeps_one_column_per_side_and_leaves_other_batches_alone() -> None:
    b = ragged_batch([0, 0], [0, 0], width_p=3, width_r=4)  # nothing real: one column stays on each side
    t = trim_padding(b)
    assert t["prompts"].shape == (2, 1) and t["responses"].shape == (2, 1)
    full = ragged_batch([3, 3], [4, 4], width_p=3, width_r=4)
    assert trim_padding(full) is full
    sft = Batch({"input_ids": torch.ones(2, 5), "attention_mask": torch.ones(2, 5), "loss_mask": torch.ones(2, 5)})
    assert trim_padding(sft) is sft


def test_trimmed_forward_equals_the_padded_one(tiny_model: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    b = ragged_batch()
    t = trim_padding(b)
    assert t["prompts"].shape[1] == max(PROMPT_LENS) < b["prompts"].shape[1]
    assert t["responses"].shape[1] == max(RESPONSE_LENS) < b["responses"].shape[1]
    with torch.no_grad():
        full, cut = logprobs(model, b), logprobs(model, t)
        values_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        # a causal LM's first logit stands in for a value head: same positions as the critic's
        v_full = forward_response(values_model, b, output="values")["values"]
        v_cut = forward_response(values_model, t, output="values")["values"]
    mask = t["response_mask"].bool()
    width = mask.shape[1]
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(cut[key][mask], full[key][:, :width][mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v_cut[mask], v_full[:, :width][mask], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- planning
@pytest.mark.parametrize(("max_rows", "max_tokens"), [(1, 100), (3, 20), (8, 30), (16, 1000), (4, 1)])
def test_plan_respects_both_caps_and_covers_every_row_once(max_rows: int, max_tokens: int) -> None:
    g = torch.Generator().manual_seed(max_rows * 31 + max_tokens)
    prompts, responses = torch.randint(1, 9, (37,), generator=g), torch.randint(1, 20, (37,), generator=g)
    lengths = [(int(p), int(r)) for p, r in zip(prompts, responses, strict=True)]
    plan = plan_micro_batches(lengths, max_rows=max_rows, max_tokens=max_tokens)
    assert sorted(itertools.chain.from_iterable(plan)) == list(range(37))
    for group in plan:
        cost = len(group) * (max(lengths[i][0] for i in group) + max(lengths[i][1] for i in group))
        assert len(group) <= max_rows
        assert cost <= max_tokens or len(group) == 1  # a row over the budget runs alone
    order = [sum(lengths[i]) for i in itertools.chain.from_iterable(plan)]
    assert order == sorted(order)  # sorted by length, so neighbours share a width
    assert plan == plan_micro_batches(lengths, max_rows=max_rows, max_tokens=max_tokens)


def test_plan_is_stable_greedy_and_isolates_long_rows() -> None:
    # sorted 1, 1, 5, 5, 5, 50 (ties in batch order): [1, 3] cannot take a 5 (3 x 5 = 15 > 12), nor [0, 2] a third
    assert plan_micro_batches([5, 1, 5, 1, 50, 5], max_rows=8, max_tokens=12) == [[1, 3], [0, 2], [5], [4]]
    assert plan_micro_batches([2, 2, 2, 2], max_rows=3, max_tokens=100) == [[0, 1, 2], [3]]
    assert plan_micro_batches([], max_rows=3, max_tokens=10) == []
    # segments are padded separately: (1, 4) and (4, 1) together cost 2 x (4 + 4) = 16, not 2 x 5
    assert plan_micro_batches([(1, 4), (4, 1)], max_rows=2, max_tokens=10) == [[0], [1]]
    assert plan_micro_batches([(1, 4), (4, 1)], max_rows=2, max_tokens=16) == [[0, 1]]


def test_split_to_count_halves_the_costliest_micro_batch_until_the_count_agrees() -> None:
    lengths = [1, 1, 1, 1, 2, 2, 9]
    plan = plan_micro_batches(lengths, max_rows=4, max_tokens=100)
    assert plan == [[0, 1, 2, 3], [4, 5, 6]]  # costs 4 and 27
    assert split_to_count(plan, lengths, 2) == plan
    assert split_to_count(plan, lengths, 3) == [[0, 1, 2, 3], [4, 5], [6]]  # 27 -> 4 + 9
    # then 4, 4, 9: [6] cannot be split, and of the two costing 4 the first goes
    assert split_to_count(plan, lengths, 4) == [[0, 1], [2, 3], [4, 5], [6]]
    assert split_to_count(plan, lengths, 7) == [[i] for i in range(7)]
    with pytest.raises(ValueError, match=r"cannot turn 2 micro-batches of 7 rows into 8\. HINT"):
        split_to_count(plan, lengths, 8)


def _rank_plans(rank: int, world: int, init: str, out: str) -> None:
    """One rank of the 2-process check: a rank with short rows and one with long rows plan micro-batches."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        lens = [1] * 8 if rank == 0 else [7] * 8
        batch = ragged_batch([1] * 8, lens, width_p=2, width_r=7)
        eng = TrainEngine(micro_batch_size=8, micro_batch_tokens=15)
        alone = plan_micro_batches([(1, r) for r in lens], max_rows=8, max_tokens=15)
        micros = eng.micro_batches(batch)
        torch.save({"alone": alone, "rows": [rows for rows, _ in micros]}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_every_rank_runs_as_many_micro_batches(tmp_path: Any) -> None:
    """FSDP forwards are collectives: two gloo processes whose own plans differ end with equal counts."""
    import torch.multiprocessing as mp

    init = f"file://{tmp_path}/store"
    mp.start_processes(_rank_plans, args=(2, init, str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert len(r0["alone"]) == 2 and len(r1["alone"]) == 8  # 7 x 2 tokens + 1 x 2; a long row is 8 tokens
    assert len(r0["rows"]) == len(r1["rows"]) == 8
    assert r1["rows"] == r1["alone"] and sorted(itertools.chain.from_iterable(r0["rows"])) == list(range(8))


def test_plan_and_partition_refuse_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"max_rows=0 must be >= 1\. HINT: micro_batch_size"):
        plan_micro_batches([1], max_rows=0, max_tokens=5)
    with pytest.raises(ValueError, match=r"max_tokens=0 must be >= 1\. HINT: micro_batch_tokens"):
        plan_micro_batches([1], max_rows=1, max_tokens=0)
    with pytest.raises(ValueError, match=r"lengths\[1\]=\(-2,\) is negative"):
        plan_micro_batches([1, -2], max_rows=1, max_tokens=5)
    with pytest.raises(ValueError, match=r"5 rows cannot be split into 2 equal groups\. HINT"):
        balanced_partition([1] * 5, 2)


def test_partition_is_equal_sized_balanced_and_in_batch_order() -> None:
    lengths = list(range(1, 33))  # sorted: contiguous chunks would give one rank all the long rows
    groups = balanced_partition(lengths, 4)
    assert [len(g) for g in groups] == [8] * 4
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(32))
    assert all(g == sorted(g) for g in groups)
    sums = [sum(lengths[i] for i in g) for g in groups]
    chunks = [sum(lengths[i * 8 : (i + 1) * 8]) for i in range(4)]
    assert max(sums) - min(sums) <= 2 < max(chunks) - min(chunks)
    assert balanced_partition(lengths, 4) == groups
    assert balanced_partition([(1, 9), (5, 5), (2, 2), (3, 1)], 2) == [[0, 2], [1, 3]]  # tuples count their sum
    assert balanced_partition([7, 7, 7], 1) == [[0, 1, 2]]


# --------------------------------------------------------------------------------------------- rank splitting
def dp_split(batch: Batch, ranks: int, *args: Any, **kwargs: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Every rank's ``(args, kwargs)`` of a ``DP_SPLIT`` call (every rank runs one)."""
    per_rank = split_args(Dispatch.DP_SPLIT, (batch, *args), kwargs, ranks, where="r.m")
    assert all(a is not None for a in per_rank)
    return [a for a in per_rank if a is not None]


def test_split_balances_marked_rollout_batches_and_merge_restores_their_order() -> None:
    b = ragged_batch(PROMPT_LENS, sorted(RESPONSE_LENS))  # contiguous halves: 18 and 32 tokens
    plain = dp_split(b, 2)
    assert [p[0][0]["prompt"] for p in plain] == [b["prompt"][:4], b["prompt"][4:]]  # unmarked: contiguous

    b.meta[BALANCE_KEY] = True
    per_rank = dp_split(b, 2, 7, k=1)
    parts = [a[0][0] for a in per_rank]
    assert all(a[0][1] == 7 and a[1] == {"k": 1} for a in per_rank)
    rows = [p.meta[ROWS_KEY] for p in parts]
    assert sorted(rows[0] + rows[1]) == list(range(8)) and rows != [[0, 1, 2, 3], [4, 5, 6, 7]]
    tokens = [int(p["prompt_mask"].sum() + p["response_mask"].sum()) for p in parts]
    halves = [int(q[0][0]["prompt_mask"].sum() + q[0][0]["response_mask"].sum()) for q in plain]
    assert halves == [18, 32] and abs(tokens[0] - tokens[1]) <= 2  # 26 and 24
    for p in parts:  # a worker adds a column and returns its part
        p["doubled"] = p["uid"] * 2
    merged = merge_results(Dispatch.DP_SPLIT, parts)
    assert merged["prompt"] == b["prompt"] and torch.equal(merged["doubled"], b["uid"] * 2)
    assert torch.equal(merged["responses"], b["responses"])
    assert ROWS_KEY not in merged.meta and BALANCE_KEY not in merged.meta and merged.meta["step"] == 3
    assert merge_results(Dispatch.DP_SPLIT, [{"loss": 1.0}, {"loss": 3.0}]) == {"loss": 2.0}

    lost = [parts[0], Batch(parts[1].tensors, parts[1].columns)]  # a result that dropped the split's meta
    with pytest.raises(RuntimeError, match=r"cannot put rank 1's result back in order.*HINT: return the input batch"):
        merge_results(Dispatch.DP_SPLIT, lost)

    no_masks = Batch({"x": torch.arange(4)}, meta={BALANCE_KEY: True})  # a prompt-less batch stays contiguous
    assert [a[0][0]["x"].tolist() for a in dp_split(no_masks, 2)] == [[0, 1], [2, 3]]


class LocalRanks:
    """The controller's protocol for ``ranks`` data-parallel ranks in one process: split, run every rank's share
    with routing off (as a worker does), merge. It exercises the same ``split_args``/``merge_results`` as
    ``strategy.Controller.call``, without its process groups."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.parts: list[Batch] = []

    def call(self, role: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from lightning_rlhf.controller.dispatch import dispatch_of

        dispatch = dispatch_of(role, method)
        per_rank = split_args(dispatch, args, kwargs, self.ranks, where=f"{role.name}.{method}")
        self.parts = [a[0][0] for a in per_rank if a is not None]
        results = []
        with controller_active(None):
            for a in per_rank:
                assert a is not None
                results.append(getattr(role, method)(*a[0], **a[1]))
        return merge_results(dispatch, results)


def test_a_role_with_a_token_budget_is_balanced_over_ranks_and_comes_back_in_order(tiny_model: str) -> None:
    plain = ReferenceRole(tiny_model, temperature=1.0, micro_batch_size=8)
    packed = ReferenceRole(tiny_model, temperature=1.0, micro_batch_size=8)
    for role in (plain, packed):
        role.load()
    packed.train_engine.micro_batch_tokens = 24
    assert packed.balances_ranks and not plain.balances_ranks
    ranks = LocalRanks(2)
    batch = ragged_batch()
    with controller_active(ranks):
        a = plain.log_prob(batch)
        assert all(ROWS_KEY not in p.meta for p in ranks.parts)  # no budget: contiguous chunks
        b = packed.log_prob(batch)
        assert all(ROWS_KEY in p.meta for p in ranks.parts)  # budget: balanced parts
    assert BALANCE_KEY not in batch.meta and ROWS_KEY not in b.meta  # the caller's batch is untouched
    assert b["prompt"] == batch["prompt"]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(b["ref_logprobs"][mask], a["ref_logprobs"][mask], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- the engine
def make_engine(path: str, *, micro: int = 3, tokens: int | None = None) -> TrainEngine:
    eng = TrainEngine(micro_batch_size=micro, micro_batch_tokens=tokens, optim=OptimConfig(lr=1e-3, grad_clip=0.0))
    eng.bind(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    eng.configure_optimizer(10)
    return eng


def test_infer_puts_rows_back_in_order_and_pads_to_the_full_width(tiny_model: str) -> None:
    batch = ragged_batch()
    ref = make_engine(tiny_model, micro=8).infer(batch, logprobs)
    packed = make_engine(tiny_model, micro=3, tokens=20)
    plan = [rows for rows, _ in packed.micro_batches(batch)]
    assert len(plan) > 2 and plan != [[0, 1, 2], [3, 4, 5], [6, 7]]  # really reordered
    widths = [micro["responses"].shape[1] for _, micro in packed.micro_batches(batch)]
    assert min(widths) < 9
    out = packed.infer(batch, logprobs)
    mask = batch["response_mask"].bool()
    for key in ("logprobs", "entropy"):
        assert out[key].shape == ref[key].shape == (8, 9)
        torch.testing.assert_close(out[key][mask], ref[key][mask], rtol=1e-5, atol=1e-6)
    assert torch.all(out["logprobs"][:, max(RESPONSE_LENS) :] == 0)  # past every response: padded with 0

    def row_sums(model: torch.nn.Module, micro: Batch) -> dict[str, Tensor]:
        return {"n": micro["prompt_mask"].sum(-1) + micro["response_mask"].sum(-1)}

    lengths = torch.tensor(PROMPT_LENS) + torch.tensor(RESPONSE_LENS)
    assert torch.equal(packed.infer(batch, row_sums)["n"], lengths)

    def one_per_batch(model: torch.nn.Module, micro: Batch) -> dict[str, Tensor]:
        return {"total": micro["response_mask"].sum().reshape(1)}

    with pytest.raises(ValueError, match=r"output 'total' has shape \(1,\) for a micro-batch of \d rows.*HINT"):
        packed.infer(batch, one_per_batch)


class RecordingEngine(TrainEngine):
    """The engine, keeping a copy of the gradients of each optimizer step before it is taken."""

    grads: list[list[Tensor]]

    def step(self) -> tuple[Tensor, bool]:
        assert self.model is not None
        self.grads.append([p.grad.detach().clone() for p in self.model.parameters() if p.grad is not None])
        return super().step()


def gradients(
    path: str, batch: Batch, *, tokens: int | None, aggregation: str, mini: int | None, max_len: int | None
) -> tuple[list[list[Tensor]], int]:
    # A negligible step: the second mini-batch's gradients are then taken at the same weights in both runs (Adam's
    # first step would turn float noise in near-zero gradients into parameter differences of about lr).
    optim = OptimConfig(lr=1e-12, grad_clip=0.0)
    eng = RecordingEngine(micro_batch_size=3, micro_batch_tokens=tokens, optim=optim)
    eng.grads = []
    eng.bind(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    eng.configure_optimizer(10)
    widths: list[int] = []

    def surrogate(m: Batch, agg: MicroBatchAggregation) -> tuple[Tensor, dict[str, Tensor]]:
        assert eng.model is not None
        widths.append(m["responses"].shape[1])
        logp = forward_response(eng.model, m, output="logprobs")["logprobs"]
        ratio = torch.exp(logp - m["old_logprobs"])
        return agg.aggregate(-m["advantages"] * ratio, m["response_mask"]), {}

    eng.train(
        batch,
        surrogate,
        aggregation=aggregation,
        count_mask=lambda b: b["response_mask"],
        mini_batch_size=mini,
        max_len=max_len,
    )
    return eng.grads, min(widths)


@pytest.mark.parametrize(
    ("aggregation", "max_len"),
    [
        ("token-mean", None),
        ("seq-mean-token-mean", None),
        ("seq-mean-token-sum", None),
        ("seq-mean-token-sum-norm", 16),
        ("seq-mean-token-sum-norm", None),  # divides by the response width: only the prompts are trimmed
    ],
)
@pytest.mark.parametrize("mini", [None, 4])
def test_train_gradients_are_the_same_with_the_token_budget(
    tiny_model: str, aggregation: str, max_len: int | None, mini: int | None
) -> None:
    batch = ragged_batch()
    ref, ref_width = gradients(tiny_model, batch, tokens=None, aggregation=aggregation, mini=mini, max_len=max_len)
    got, width = gradients(tiny_model, batch, tokens=20, aggregation=aggregation, mini=mini, max_len=max_len)
    assert ref_width == 9
    assert width == 9 if (aggregation == "seq-mean-token-sum-norm" and max_len is None) else width < 9
    assert len(got) == len(ref) == (2 if mini else 1)
    for step_ref, step_got in zip(ref, got, strict=True):
        assert max(g.abs().max() for g in step_ref) > 1e-4  # a real gradient, so agreement means something
        for a, b in zip(step_ref, step_got, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * max(1.0, float(a.abs().max())))


# ---------------------------------------------------------------------------------------------- the setting
@pytest.mark.parametrize("bad", [0, -5, True, 2.5])
def test_the_setting_is_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"BatchingConfig\.micro_batch_tokens={bad!r} is invalid: expected None"):
        AlgorithmConfig(batching=BatchingConfig(micro_batch_tokens=bad))
    with pytest.raises(ValueError, match=rf"ActorRole\(path=...\): micro_batch_tokens={bad!r} is invalid.*HINT"):
        TrainEngine(micro_batch_size=2, micro_batch_tokens=bad, setting="ActorRole(path=...)")
    assert AlgorithmConfig(batching=BatchingConfig(micro_batch_tokens=4096)).batching.micro_batch_tokens == 4096
    assert AlgorithmConfig().batching.micro_batch_tokens is None


def test_the_setting_reaches_every_role_at_setup(tiny_model: str) -> None:
    import lightning as L

    from lightning_rlhf import GRPOModule

    reward: Callable[..., list[float]] = lambda prompts, completions, **kw: [0.0] * len(completions)  # noqa: E731
    module = GRPOModule(
        tiny_model,
        reward=reward,
        reference=True,
        algorithm=AlgorithmConfig(kl=KLConfig(coef=0.01), batching=BatchingConfig(micro_batch_tokens=512)),
    )
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert not module.actor.balances_ranks
    module.setup("fit")
    roles = module.roles()
    assert {"actor", "reference", "reward"} <= set(roles)
    assert all(r.train_engine.micro_batch_tokens == 512 and r.balances_ranks for r in roles.values())
