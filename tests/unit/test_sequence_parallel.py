"""Sequence parallelism's arithmetic and errors, in one process: the column slices, the mask of the whole sequence,
the dispatch of a sequence-parallel call (each group's ranks get the same rows; the first rank's result counts), the
groups made within each role's pool, and the settings refused before training. The forwards themselves run on 2 ranks:
``tests/distributed/test_sequence_parallel_runs.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor
from transformers import AttentionInterface, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lightning_rlhf.batch import Batch
from lightning_rlhf.controller.controller import _Plan
from lightning_rlhf.controller.dispatch import (
    Dispatch,
    data_parallel_group,
    declares_sequence_parallel,
    role_method,
    sequence_parallel_of,
    sequence_parallel_roles,
    split_args,
)
from lightning_rlhf.engines.train import forward_response, sequence_inputs, ulysses
from lightning_rlhf.engines.train.forward import left_aligned
from lightning_rlhf.engines.train.ulysses import SequenceShard, causal_suffices, check_model, check_size, full_mask
from tests.unit.test_forward import rollout_batch


def test_columns_are_padded_to_the_group_and_sliced_contiguously() -> None:
    shards = [SequenceShard(11, 3, rank) for rank in range(3)]
    assert [(s.padded, s.width, s.start, s.stop) for s in shards] == [(12, 4, 0, 4), (12, 4, 4, 8), (12, 4, 8, 12)]
    ids = torch.arange(22).reshape(2, 11)
    parts = [s.local(ids) for s in shards]
    assert torch.equal(torch.cat(parts, dim=1)[:, :11], ids) and torch.equal(parts[2][:, -1], torch.zeros(2).long())
    # the positions predicting 5 response tokens after a 6-token prompt are 5..9: each rank keeps its own
    assert [s.kept(5, 10) for s in shards] == [(5, 5), (5, 8), (8, 10)]


def test_gather_in_a_group_of_one_places_the_kept_columns_and_scales_the_gradient() -> None:
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        shard = SequenceShard(6, 1, 0, None)
        local = torch.tensor([[1.0, 2.0]], requires_grad=True)
        out = shard.gather(local, 2, 4)
        assert torch.equal(out, torch.tensor([[0.0, 0.0, 1.0, 2.0, 0.0, 0.0]]))
        out.sum().backward()
        assert torch.equal(local.grad, torch.ones(1, 2))  # times the group size (1)
        # a rank that keeps no column still sends zeros connected to its graph (its backward runs the collectives)
        none = shard.gather(local, 3, 3)
        assert torch.equal(none, torch.zeros(1, 6)) and none.requires_grad
    finally:
        torch.distributed.destroy_process_group()


def test_the_whole_sequence_mask_is_causal_without_padding_keys_and_no_empty_row() -> None:
    attention = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    mask = full_mask(attention)
    assert mask.shape == (2, 1, 6, 6) and bool(mask.any(dim=-1).all())
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(mask[1, 0], causal)
    # left padding attends to itself only; real positions never see padding; right padding sees the real tokens
    assert torch.equal(mask[0, 0, 0], torch.tensor([True, False, False, False, False, False]))
    assert torch.equal(mask[0, 0, 3], torch.tensor([False, False, True, True, False, False]))
    assert torch.equal(mask[0, 0, 5], torch.tensor([False, False, True, True, True, False]))


def test_sdpa_runs_causal_without_a_mask_only_when_no_row_is_left_padded() -> None:
    assert causal_suffices(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))  # right padding only (and the pad to N)
    assert causal_suffices(torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]))  # a row of padding only
    assert not causal_suffices(torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))  # a left-padded prompt
    assert not causal_suffices(torch.tensor([[1, 0, 1, 1]]))  # a hole


def test_left_alignment_moves_each_rows_real_tokens_to_column_zero_keeping_their_positions() -> None:
    batch = Batch(
        {
            "prompts": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 0]]),
            "prompt_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]),
            "responses": torch.tensor([[11, 0], [12, 13], [0, 0]]),
            "response_mask": torch.tensor([[1, 0], [1, 1], [0, 0]]),
        }
    )
    ids, mask, positions, shift = left_aligned(*sequence_inputs(batch, "cpu"))
    assert shift.tolist() == [2, 0, 0]
    assert ids.tolist() == [[5, 6, 11, 0, 0, 0], [7, 8, 9, 10, 12, 13], [0] * 6]
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6, [0] * 6] and causal_suffices(mask)
    assert positions.tolist() == [list(range(6))] * 3  # real tokens: 0.. as before; padding: its column


def test_a_left_padded_sequence_parallel_forward_builds_no_whole_sequence_mask(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ragged left padding in one micro-batch, in a sequence group of one rank: the attention goes through the
    Ulysses wrapper, sdpa gets no mask, and the outputs equal the plain forward's."""
    seen: list[object] = []
    inner = ulysses._attention

    def counted(module: torch.nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: object, **kw: object) -> object:
        seen.append(mask)
        return inner(module, q, k, v, mask, **kw)

    def refused(*args: object) -> None:
        raise AssertionError("a [T, T] mask was built")

    monkeypatch.setattr(ulysses, "full_mask", refused)
    AttentionInterface.register(ulysses.ATTENTION_NAME, counted)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    batch = rollout_batch()
    assert not causal_suffices(sequence_inputs(batch, "cpu")[1])  # left-padded as given
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        with torch.no_grad(), data_parallel_group(None, torch.distributed.group.WORLD):
            split = {
                k: forward_response(model, batch, output="logprobs", with_entropy=True)[k]
                for k in ("logprobs", "entropy")
            }
        with torch.no_grad():
            whole = forward_response(model, batch, output="logprobs", with_entropy=True)
    finally:
        AttentionInterface.register(ulysses.ATTENTION_NAME, inner)
        torch.distributed.destroy_process_group()
    assert seen and all(m is None for m in seen)  # every layer's inner sdpa ran causal, without a mask
    real = batch["response_mask"].bool()
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(split[key][real], whole[key][real], rtol=1e-5, atol=1e-6)


class _Scorer:
    name = "scorer"
    sequence_parallel = 2

    @role_method(Dispatch.DP_SPLIT, sequence_parallel=True)
    def score(self, batch: Batch) -> Batch:
        return batch

    @role_method(Dispatch.DP_SPLIT)
    def generate(self, batch: Batch) -> Batch:
        return batch


def test_a_sequence_parallel_call_gives_each_group_the_same_rows_and_keeps_its_first_result() -> None:
    role = _Scorer()
    assert sequence_parallel_of(role, "score") == 2 and sequence_parallel_of(role, "generate") == 1
    assert declares_sequence_parallel(role) and not declares_sequence_parallel(SimpleNamespace())
    batch = Batch({"x": torch.arange(8)})
    parts = split_args(Dispatch.DP_SPLIT, (batch,), {}, 4, where="scorer.score", sequence_parallel=2)
    rows = [part[0][0]["x"].tolist() for part in parts if part is not None]
    assert rows == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    assert parts[0][0][0] is not parts[1][0][0]  # a batch of its own on each rank
    results = [Batch({"y": torch.tensor([r, r])}) for r in range(4)]
    merged = _Plan(Dispatch.DP_SPLIT, [0, 1, 2, 3], sequence_parallel=2).merge(results)
    assert merged["y"].tolist() == [0, 0, 2, 2]
    with pytest.raises(ValueError, match=r"6 rows cannot be split evenly over 4 ranks \(8 / sequence_parallel=2\)"):
        split_args(Dispatch.DP_SPLIT, (Batch({"x": torch.arange(6)}),), {}, 8, where="s", sequence_parallel=2)


def test_sequence_parallel_is_declared_on_dp_split_methods_only() -> None:
    with pytest.raises(ValueError, match="DP_SPLIT"):
        role_method(Dispatch.ONE_TO_ALL, sequence_parallel=True)


@pytest.mark.parametrize("value", [0, -2, True, 1.5, "2"])
def test_a_size_that_is_not_an_integer_of_at_least_one_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"RLHFModule\(sequence_parallel\)=.*integer >= 1"):
        check_size(value, setting="RLHFModule(sequence_parallel)")
    assert check_size(3, setting="x") == 3


def _tiny(heads: int = 4, kv: int = 1, attention: str = "sdpa") -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        attn_implementation=attention,
    )
    return Qwen2ForCausalLM(config)


def test_models_the_wrapper_cannot_split_are_refused_with_the_rule() -> None:
    check_model(_tiny(kv=1), 2, setting="ActorRole")  # 1 key/value head: replicated to the group, accepted
    check_model(_tiny(attention="eager"), 4, setting="ActorRole")
    with pytest.raises(ValueError, match="sequence_parallel=3 must divide the model's num_attention_heads=4"):
        check_model(_tiny(), 3, setting="ActorRole")
    model = _tiny()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"attn_implementation in .*'flex_attention'"):
        check_model(model, 2, setting="ActorRole")
    with pytest.raises(ValueError, match="attention interface; Linear has none"):
        check_model(torch.nn.Linear(2, 2), 2, setting="CriticRole")


def test_the_size_must_divide_the_pool_of_every_role_it_applies_to() -> None:
    """The roles declaring sequence-parallel methods get the size; a pool (or a run) it does not divide is refused,
    naming the setting, the role's ranks and the fix."""
    roles = {"actor": _Scorer(), "reward": SimpleNamespace()}
    assert sequence_parallel_roles(2, roles, {}, world_size=4) == {"actor": 2}  # the reward model's calls do not split
    assert sequence_parallel_roles(2, roles, {"actor": [2, 3], "reward": [0]}, world_size=4) == {"actor": 2}
    assert sequence_parallel_roles(1, roles, {}, world_size=3) == {}
    with pytest.raises(ValueError, match=r"sequence_parallel=2\) .* 'actor' runs on the pool \[0, 1, 2\]\. HINT: give "
                       r"'actor' a pool of a multiple of 2 ranks .* or sequence_parallel in \[1, 3\]"):  # fmt: skip
        sequence_parallel_roles(2, roles, {"actor": [0, 1, 2]}, world_size=4)
    with pytest.raises(ValueError, match=r"'actor' runs on the pool \[1\]\. .* sequence_parallel in \[1\] \(1: off\)"):
        sequence_parallel_roles(2, roles, {"actor": [1], "reward": [0]}, world_size=2)
    with pytest.raises(ValueError, match=r"runs on all 3 ranks of the run\. HINT: run a multiple of 2 processes"):
        sequence_parallel_roles(2, roles, {}, world_size=3)


def test_each_role_gets_the_group_of_consecutive_ranks_of_its_own_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """``give_sequence_groups`` on every rank of 4: the actor's pool [0, 1] and the reference's [2, 3], SP=2. Every
    rank makes the same groups in the same order (a new group is collective), one per distinct set of ranks; a rank
    gets the group within each pool it is in, none for a pool it is not in."""
    made: list[list[list[int]]] = []

    def new_group(ranks: list[int]) -> tuple[int, ...]:
        made[-1].append(ranks)
        return tuple(ranks)

    monkeypatch.setattr(ulysses.dist, "new_group", new_group)
    pools = {"actor": (0, 1), "reward": (0, 1), "reference": (2, 3)}
    got = []
    for rank in range(4):
        made.append([])
        roles = {
            name: SimpleNamespace(train_engine=SimpleNamespace(sequence_parallel=n, sequence_group=None, model=None))
            for name, n in (("actor", 2), ("reward", 1), ("reference", 2))
        }
        ulysses.give_sequence_groups(roles, pools, world_size=4, rank=rank)
        got.append({name: role.train_engine.sequence_group for name, role in roles.items()})
    assert all(groups == [[0, 1], [2, 3]] for groups in made), made
    assert got[0]["actor"] == got[1]["actor"] == (0, 1) and got[2]["actor"] is None and got[3]["actor"] is None
    assert got[2]["reference"] == got[3]["reference"] == (2, 3) and got[0]["reference"] is None
    assert all(g["reward"] is None for g in got)
