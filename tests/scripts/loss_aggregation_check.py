"""The loss and its gradients do not depend on how a mini-batch is cut (rows per micro-batch, the token budget's
packing and trimming, gradient accumulation, data-parallel ranks, sequence parallelism), for every registered loss
aggregation.

Each case updates a role over a batch of 8 rows (4 prompts x 2 samples, left-padded prompts of 2 to 5 tokens,
responses of 1 to 6, 21 of the 28 response tokens in the first half), as one mini-batch or two, and records the
gradients each optimizer step gets (taking none). The reference computes each mini-batch's loss from the
aggregation's definition, each row's sequence run alone and unpadded, and differentiates it through an unsharded
copy of the model. Cases:

- ``actor``: clipped PPO + k3 KL - entropy bonus (each term aggregated); one row's ``loss_mask`` is all 0 (DAPO's
  overlong filter), so the rows with a loss token are uneven over the ranks;
- ``actor-skip``: the policy loss alone with ``skip_zero_advantage``: the three groups whose advantages are 0 are
  left out of the forwards (``TrainEngine.train``'s ``trainable``; on 2 ranks one rank runs stand-ins only) and
  still count in the aggregation;
- ``critic``: the clipped value loss over a ``sampled_mask`` with holes (as a multi-turn episode's).

On one process ``tests/unit/test_loss_aggregation.py`` imports these parts. Under torchrun (2 processes, gloo)
:func:`main` splits the batch over the ranks as the controller does (contiguous, by tokens with the token budget,
by trained tokens for ``actor-skip``; with sequence parallelism over the groups: a group's ranks get the same rows,
each runs half of every sequence, and the group's first rank's metrics count) and prints ``RESULT <rank> <case>
<aggregation> <layout> <gradient error> <loss error>`` per case, aggregation and layout of :data:`TWO_RANKS` (the
largest gradient difference over the largest gradient, the worst of the layout's mini-batches; the largest relative
difference of the loss metrics, averaged over the data-parallel groups);
``tests/distributed/test_loss_aggregation_runs.py`` checks them.

A new way to cut the batch joins as a field of :class:`Layout`, as sequence parallelism did.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import warnings
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface

import lightning_rlhf.cpu as cpu
from lightning_rlhf.algorithms import LOSS_AGGREGATIONS
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, BatchingConfig, KLConfig, LossConfig, OptimConfig, RolloutConfig
from lightning_rlhf.controller.dispatch import ROWS_KEY, Dispatch, _mark_balance, data_parallel_group, split_args
from lightning_rlhf.engines.train import ulysses
from lightning_rlhf.roles import ActorRole, CriticRole
from lightning_rlhf.roles.base import Role

CASES = ("actor", "actor-skip", "critic")
AGGREGATIONS = tuple(LOSS_AGGREGATIONS.names())
ROWS, GROUP, PROMPT, RESPONSE = 8, 2, 5, 6
PROMPT_LENGTHS = (5, 2, 4, 3)  # per group (prompt)
RESPONSE_LENGTHS = (6, 5, 6, 4, 1, 2, 1, 3)
MAX_NEW_TOKENS = 8  # the actor's Dr.GRPO constant: wider than the batch's responses, which are trimmed
KL_COEF, ENTROPY_COEF, CLIP = 0.1, 0.01, 0.2
ULYSSES_CALLS = [0]
"""Calls of the sequence-parallel attention (counted under torchrun: :func:`main`)."""
TOLERANCE = 1e-4
"""Largest gradient difference allowed, over the largest gradient (and relative difference of a loss metric):
float32 rounding stays near 1e-6; a micro-batch or rank weighted wrongly moves them by percents."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the batch is cut: rows per micro-batch, the token budget (None: off), ranks, optimizer steps
    (mini-batches) per update, and the ranks that share each sequence (``RLHFModule(sequence_parallel=...)``:
    the data-parallel split goes over ``ranks // sequence_parallel`` groups)."""

    micro_batch_size: int
    micro_batch_tokens: int | None = None
    ranks: int = 1
    mini_batches: int = 1
    sequence_parallel: int = 1

    @property
    def groups(self) -> int:
        """Data-parallel groups: each takes its own rows."""
        return self.ranks // self.sequence_parallel

    def __str__(self) -> str:
        tokens = self.micro_batch_tokens or "off"
        sp = f"-sp{self.sequence_parallel}" if self.sequence_parallel > 1 else ""
        return f"dp{self.groups}{sp}-rows{self.micro_batch_size}-tokens{tokens}-minibatches{self.mini_batches}"


# 16 padded tokens: one or two long rows per forward, several short ones; trimmed to each micro-batch's widths
ONE_RANK = (
    *(Layout(rows, tokens) for rows in (1, 3, ROWS) for tokens in (None, 16)),
    Layout(3, mini_batches=2),
    Layout(1, 16, mini_batches=2),
)
# sequence parallelism: both ranks one group, each half of every sequence of every row
TWO_RANKS = (
    *(Layout(rows, tokens, ranks=2) for rows in (1, ROWS // 2) for tokens in (None, 16)),
    Layout(1, 16, ranks=2, mini_batches=2),
    Layout(3, ranks=2, sequence_parallel=2),
    Layout(1, 16, ranks=2, mini_batches=2, sequence_parallel=2),
)


def make_role(case: str, path: str) -> Role:
    """The case's role with the full weights loaded (same seed on every rank: the critic's new value head) and the
    CPU layer the strategy hands on a CPU; not sharded."""
    torch.manual_seed(0)
    regularised = case == "actor"
    algorithm = AlgorithmConfig(
        loss=LossConfig(entropy_coef=ENTROPY_COEF if regularised else 0.0, clip_ratio_low=CLIP, value_clip=CLIP),
        kl=KLConfig(coef=KL_COEF if regularised else 0.0),
        batching=BatchingConfig(skip_zero_advantage=case == "actor-skip"),
    )
    role: Role
    if case == "critic":
        role = CriticRole(path, algorithm=algorithm, optim=OptimConfig(lr=1e-3))
    else:
        from transformers import AutoTokenizer

        rollout = RolloutConfig(n=GROUP, max_new_tokens=MAX_NEW_TOKENS)
        tokenizer = AutoTokenizer.from_pretrained(path)
        role = ActorRole(path, tokenizer=tokenizer, rollout=rollout, algorithm=algorithm, optim=OptimConfig(lr=1e-3))
    role.train_engine.layer = cpu.device_layer(None, "cpu")
    role.load()
    return role


def rollout(seed: int = 0) -> Batch:
    """The rollout columns of the mini-batch: grouped prompts (left-padded), ragged responses, advantages."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor(PROMPT_LENGTHS).repeat_interleave(GROUP)
    prompt_mask = (torch.arange(PROMPT)[None, :] >= PROMPT - prompt_len[:, None]).long()
    prompts = torch.randint(4, 200, (ROWS // GROUP, PROMPT), generator=g).repeat_interleave(GROUP, 0)
    response_mask = (torch.arange(RESPONSE)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]).long()
    batch = Batch(
        {
            "prompts": prompts * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": torch.randint(4, 200, (ROWS, RESPONSE), generator=g) * response_mask,
            "response_mask": response_mask,
            "advantages": torch.randn(ROWS, 1, generator=g).expand(ROWS, RESPONSE) * response_mask,
        }
    )
    batch.meta["group_size"] = GROUP
    return batch


def prepared(case: str, model: nn.Module, seed: int = 1) -> Batch:
    """:func:`rollout` with the columns the case's update reads: old (and reference) log-probs, or old values and
    returns, near the model's own (so some ratios are clipped, most not), and the case's masks."""
    batch = rollout()
    g = torch.Generator().manual_seed(seed)
    mask = batch["response_mask"]
    with torch.no_grad():
        own = torch.zeros(ROWS, RESPONSE)
        for i, (out, _) in enumerate(row_outputs(case, model, batch)):
            own[i, : len(out)] = out

    def near(scale: float) -> Tensor:
        return (own + scale * torch.randn(ROWS, RESPONSE, generator=g)) * mask

    if case == "critic":
        batch["values"], batch["returns"] = near(0.1), near(1.0)
        sampled = mask.clone()
        sampled[[0, 0, 1, 3], [2, 3, 2, 1]] = 0  # tool output inside the responses
        batch["sampled_mask"] = sampled
        return batch
    batch["old_logprobs"], batch["ref_logprobs"] = near(0.15), near(0.3)
    if case == "actor":
        loss_mask = mask.clone()
        loss_mask[2] = 0  # an overlong response, filtered out
        batch["loss_mask"] = loss_mask
    else:
        # three groups with equal rewards: split over 2 ranks by the tokens they train, one rank trains no row
        batch["advantages"][GROUP:] = 0.0
    return batch


def row_outputs(case: str, model: nn.Module, batch: Batch) -> list[tuple[Tensor, Tensor | None]]:
    """Per row, at its response tokens: ``(log-probs, entropies)`` (actor) or ``(values, None)`` (critic), each
    row's prompt and response run alone, without padding."""
    outputs: list[tuple[Tensor, Tensor | None]] = []
    for i in range(len(batch)):
        prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()]
        response = batch["responses"][i][batch["response_mask"][i].bool()]
        ids = torch.cat([prompt, response])[None]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(ids[0]) - 1].float()
        if case == "critic":
            outputs.append((logits[:, 0], None))
            continue
        logp = torch.log_softmax(logits, dim=-1)
        outputs.append((logp.gather(-1, response[:, None])[:, 0], -(logp.exp() * logp).sum(-1)))
    return outputs


def reference_aggregate(rows: list[Tensor], mode: str, max_len: int) -> Tensor:
    """The aggregation's definition over the counted tokens' values of each row of the mini-batch."""
    total = sum((row.sum() for row in rows), torch.tensor(0.0))
    if mode == "token-mean":
        return total / max(sum(row.numel() for row in rows), 1)
    if mode == "seq-mean-token-sum":
        return total / len(rows)
    if mode == "seq-mean-token-mean":
        kept = [row.mean() for row in rows if row.numel()]
        return sum(kept, torch.tensor(0.0)) / max(len(kept), 1)
    if mode == "seq-mean-token-sum-norm":
        return total / (len(rows) * max_len)
    raise KeyError(f"No reference for the loss aggregation {mode!r}: write its definition in reference_aggregate.")


def reference_terms(case: str, model: nn.Module, batch: Batch, mode: str) -> dict[str, Tensor]:
    """The case's loss terms over the whole mini-batch at once, written from the losses' and the aggregation's
    definitions, by the name of the metric that reports each."""
    terms: dict[str, list[Tensor]] = {"main": [], "entropy": [], "kl": []}
    counted = batch["sampled_mask" if case == "critic" else "loss_mask" if "loss_mask" in batch else "response_mask"]
    for i, (out, entropy) in enumerate(row_outputs(case, model, batch)):
        n, keep = len(out), counted[i, : len(out)].bool()
        if case == "critic":
            old, returns = batch["values"][i, :n], batch["returns"][i, :n]
            clipped = old + (out - old).clamp(-CLIP, CLIP)
            terms["main"].append((0.5 * torch.maximum((out - returns) ** 2, (clipped - returns) ** 2))[keep])
            continue
        assert entropy is not None
        ratio, advantage = torch.exp(out - batch["old_logprobs"][i, :n]), batch["advantages"][i, :n]
        pg = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - CLIP, 1 + CLIP))
        log_ref = batch["ref_logprobs"][i, :n] - out
        terms["main"].append(pg[keep])
        terms["entropy"].append(entropy[keep])
        terms["kl"].append((torch.exp(log_ref) - log_ref - 1)[keep])
    max_len = RESPONSE if case == "critic" else MAX_NEW_TOKENS  # the critic passes none: the batch's width
    if case == "critic":
        return {"critic/vf_loss": reference_aggregate(terms["main"], mode, max_len)}
    out = {"actor/pg_loss": reference_aggregate(terms["main"], mode, max_len)}
    if case == "actor":
        out["actor/entropy"] = reference_aggregate(terms["entropy"], mode, max_len)
        out["actor/kl_loss"] = reference_aggregate(terms["kl"], mode, max_len)
    return out


def reference_loss(case: str, model: nn.Module, batch: Batch, mode: str) -> Tensor:
    """The case's loss over the whole mini-batch at once."""
    terms = reference_terms(case, model, batch, mode)
    if case == "critic":
        return terms["critic/vf_loss"]
    if case == "actor":
        return terms["actor/pg_loss"] - ENTROPY_COEF * terms["actor/entropy"] + KL_COEF * terms["actor/kl_loss"]
    return terms["actor/pg_loss"]


def reference_gradients(case: str, model: nn.Module, batch: Batch, mode: str) -> dict[str, Tensor]:
    """The gradients of :func:`reference_loss` by parameter name."""
    model.zero_grad(set_to_none=True)
    reference_loss(case, model, batch, mode).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def reference_metrics(case: str, model: nn.Module, batches: list[Batch], mode: str) -> dict[str, float]:
    """The loss metrics of an update over ``batches`` (one per optimizer step): each term's mean over them."""
    with torch.no_grad():
        terms = [reference_terms(case, model, batch, mode) for batch in batches]
    return {key: sum(float(t[key]) for t in terms) / len(terms) for key in terms[0]}


def use_layout(role: Role, layout: Layout, mode: str) -> None:
    """Cut the role's next update as ``layout`` says, aggregated with ``mode`` (as ``RLHFModule`` sets them)."""
    role.train_engine.micro_batch_size = layout.micro_batch_size
    role.train_engine.micro_batch_tokens = layout.micro_batch_tokens
    role.train_engine.sequence_parallel = layout.sequence_parallel
    algorithm = role.algorithm  # type: ignore[attr-defined]
    loss = dataclasses.replace(algorithm.loss, loss_agg=mode)
    mini_batch_size = None if layout.mini_batches == 1 else ROWS // layout.mini_batches
    batching = dataclasses.replace(algorithm.batching, mini_batch_size=mini_batch_size)
    role.algorithm = dataclasses.replace(algorithm, loss=loss, batching=batching)  # type: ignore[attr-defined]


def rank_parts(role: Role, batch: Batch, ranks: int, sequence_parallel: int = 1) -> list[Batch]:
    """Each rank's part of ``batch`` as the controller splits a ``DP_SPLIT`` call (after :func:`use_layout`); with
    ``sequence_parallel``, the ranks of each group get the same part."""
    if ranks == 1:
        return [batch]
    costs = role.split_costs("update", batch) if isinstance(role, ActorRole) else None
    marked = _mark_balance(batch, role.balances_ranks, costs)
    parts = split_args(Dispatch.DP_SPLIT, (marked,), {}, ranks, where="update", sequence_parallel=sequence_parallel)
    return [part[0][0] for part in parts if part is not None]


_SEQUENCE_GROUPS: dict[int, object] = {}


def sequence_group(size: int) -> object:
    """This rank's sequence-parallel group of ``size`` consecutive ranks (made once, on every rank together, as
    ``ulysses.give_sequence_groups`` does at set-up); None for 1."""
    if size == 1:
        return None
    if size not in _SEQUENCE_GROUPS:
        groups = [dist.new_group(list(range(r, r + size))) for r in range(0, dist.get_world_size(), size)]
        _SEQUENCE_GROUPS[size] = groups[dist.get_rank() // size]
    return _SEQUENCE_GROUPS[size]


def mini_batch_rows(parts: list[Batch], mini_batches: int) -> list[list[int]]:
    """The rows of the whole batch that make up each optimizer step's mini-batch: each data-parallel group's part
    (``parts``: one per group) cut into ``mini_batches`` in order (``TrainEngine.train``)."""
    size = len(parts[0])
    rows = [part.meta.get(ROWS_KEY, list(range(r * size, (r + 1) * size))) for r, part in enumerate(parts)]
    local = size // mini_batches
    return [[i for own in rows for i in own[k * local : (k + 1) * local]] for k in range(mini_batches)]


def update_gradients(
    role: Role, batch: Batch, sequence: object = None
) -> tuple[list[dict[str, Tensor]], dict[str, float]]:
    """The gradients ``role.update(batch)`` hands each optimizer step, gathered whole by parameter name, and the
    metrics it returns (this rank's); no step is taken (the weights stay as they are, for the next mini-batch and
    layout). ``sequence``: this rank's sequence-parallel group (the controller's call context for a method declared
    ``sequence_parallel=True``). All ranks call it together."""
    engine = role.train_engine
    assert engine.model is not None
    grads: list[dict[str, Tensor]] = []

    def step() -> tuple[Tensor, bool]:
        assert engine.model is not None
        found = {}
        for name, p in engine.model.named_parameters():
            if p.grad is not None:
                found[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        grads.append(found)
        engine.model.zero_grad(set_to_none=True)
        return torch.tensor(1.0), True

    engine.step = step  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():  # the schedule steps after an optimizer that did not
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
            with data_parallel_group(None, sequence):
                metrics = role.update(batch)  # type: ignore[attr-defined]
    finally:
        del engine.step
    return grads, metrics


def rank_mean(
    metrics: dict[str, float], keys: Iterable[str], ranks: int, sequence_parallel: int = 1
) -> dict[str, float]:
    """``metrics[key]`` averaged over the ranks, as the controller merges a ``DP_SPLIT`` call's results: with
    ``sequence_parallel``, the first rank's of each group."""
    keys = sorted(keys)
    values = torch.tensor([metrics[key] for key in keys], dtype=torch.float64)
    if ranks > 1:
        values *= float(dist.get_rank() % sequence_parallel == 0)
        dist.all_reduce(values)
    return dict(zip(keys, (values / (ranks // sequence_parallel)).tolist(), strict=True))


def metric_error(got: dict[str, float], want: dict[str, float]) -> float:
    """The largest relative difference of the loss metrics (0 when none is compared)."""
    return max((abs(got[key] - value) / max(abs(value), 1e-3) for key, value in want.items()), default=0.0)


def error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """The largest difference between the two gradients over the largest reference gradient (absolute where the
    reference is 0: a mini-batch whose advantages are all 0)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    largest = max(float(g.abs().max()) for g in want.values())
    return max(float((got[name] - g).abs().max()) for name, g in want.items()) / (largest or 1.0)


def layout_errors(
    case: str, role: Role, reference: nn.Module, batch: Batch, mode: str, layouts: Iterable[Layout], rank: int = 0
) -> Iterator[tuple[Layout, float, float]]:
    """``(layout, gradient error, loss metric error)`` of the role's update of ``batch`` cut as each layout says,
    aggregated with ``mode``, against the reference of each mini-batch (the worst of them); every layout's
    ``ranks`` is the role's world. The metrics of an update that leaves rows out (``actor-skip``) average the
    trained rows: not compared."""
    wants: dict[tuple[int, ...], dict[str, Tensor]] = {}
    for layout in layouts:
        use_layout(role, layout, mode)
        parts = rank_parts(role, batch, layout.ranks, layout.sequence_parallel)
        steps = [tuple(rows) for rows in mini_batch_rows(parts[:: layout.sequence_parallel], layout.mini_batches)]
        for rows in steps:
            if rows not in wants:
                wants[rows] = reference_gradients(case, reference, batch.select(list(rows)), mode)
        calls = ULYSSES_CALLS[0]
        got, metrics = update_gradients(role, parts[rank], sequence_group(layout.sequence_parallel))
        split = ULYSSES_CALLS[0] - calls  # the update split its sequences exactly when the layout says so
        assert (split > 0) == (layout.sequence_parallel > 1), f"{layout}: {split} sequence-parallel attention calls"
        assert len(got) == len(steps), f"{layout}: {len(got)} optimizer steps"
        want_metrics = reference_metrics(case, reference, [batch.select(list(rows)) for rows in steps], mode)
        if case == "actor-skip":
            want_metrics = {}
        got_metrics = rank_mean(metrics, want_metrics, layout.ranks, layout.sequence_parallel)
        grad_error = max(error(g, wants[rows]) for g, rows in zip(got, steps, strict=True))
        yield layout, grad_error, metric_error(got_metrics, want_metrics)


def check(case: str, path: str, layouts: list[Layout], rank: int) -> Iterator[tuple[str, Layout, float, float]]:
    """``(aggregation, layout, gradient error, metric error)`` for every aggregation and layout, the model sharded
    over the processes of the default group (each layout's ``ranks``)."""
    role = make_role(case, path)
    assert role.model is not None
    reference = copy.deepcopy(role.model)
    batch = prepared(case, reference)
    world = dist.get_world_size()
    assert all(layout.ranks == world for layout in layouts), (layouts, world)
    role.shard(init_device_mesh("cpu", (world,)), param_dtype=None)
    role.materialize(torch.device("cpu"))
    role.configure_optimizer(10)
    for mode in AGGREGATIONS:
        for layout, grad_error, loss_error in layout_errors(case, role, reference, batch, mode, layouts, rank):
            yield mode, layout, grad_error, loss_error


def _counted(*args: object, **kwargs: object) -> object:
    ULYSSES_CALLS[0] += 1
    return ulysses._attention(*args, **kwargs)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    AttentionInterface.register(ulysses.ATTENTION_NAME, _counted)
    torch.set_num_threads(1)
    layouts = [layout for layout in TWO_RANKS if layout.ranks == dist.get_world_size()]
    lines = []
    for case in CASES:
        for mode, layout, grad_error, loss_error in check(case, args.model, layouts, rank):
            lines.append(f"RESULT {rank} {case} {mode} {layout} {grad_error:.3e} {loss_error:.3e}\n")
    sys.stdout.write("".join(lines))  # one write: the ranks share stdout
    sys.stdout.flush()
    dist.barrier()
    from lightning_rlhf.strategy.strategy import shutdown_process_groups

    shutdown_process_groups()  # as fsdp_backward_check.py: no interpreter finalisation under gloo's threads
    os._exit(0)


if __name__ == "__main__":
    main()
