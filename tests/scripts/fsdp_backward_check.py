"""Checks FSDP2's pre-backward hooks in the training forwards, under torchrun with 2 processes (gloo); the test
``tests/unit/test_fsdp_backward_hooks.py`` launches it with the tiny model's folder in ``FSDP_CHECK_MODEL``.

Each case loads a role's model as the trainer does (``ActorRole``/``CriticRole``, with the engine's default CPU
layers: oneDNN linears, fused RMS norms), shards it with FSDP2 (``reshard_after_forward=True``: each decoder layer
is sharded again after its forward) and runs our forward (``forward_response``: per row, and the actor's packed
shared-prompt forward), then backward, on two micro-batches per rank. ``critic-plain`` gives the critic PyTorch's
own linear layers (as in bfloat16 or with ``LIGHTNING_RLHF_ONEDNN=0``), whose value head returns a view, and a
loss that modifies the model's output in place. The same model unsharded, bound the same way, runs both ranks'
micro-batches in this process. Per case the script asserts:

- after each forward every decoder layer's parameters are sharded (the backward has to gather them again), and
  the root's are not (FSDP2 keeps the root whole);
- in each backward the pre-backward hook of every FSDP unit (each layer and the root) ran, and afterwards every
  unit is sharded again;
- the gradients, gathered, equal the unsharded model's for the mean loss over both ranks;
- FSDP2 warned nothing: in particular not "FSDP2-wrapped module (...) returned a view tensor ... will silently
  drop the pre-backward hook" (issue 31, item 4).

Prints ``OK <rank> <case> <units whose pre-backward hook ran>/<units> <warnings> <view outputs copied>`` per case
(the copies by ``shard_model``'s forward hook: none where the model returns no view).
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
from torch.distributed.tensor import DTensor

import lightning_rlhf.cpu as cpu
import lightning_rlhf.engines.train.fsdp as fsdp  # the module: its view-copying hook is counted
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, BatchingConfig, OptimConfig, RolloutConfig
from lightning_rlhf.cpu.onednn import plain_linears
from lightning_rlhf.engines.train import forward_response, sequence_inputs
from lightning_rlhf.roles import ActorRole, CriticRole
from lightning_rlhf.roles.base import Role
from lightning_rlhf.strategy.strategy import shutdown_process_groups

GROUP = 4


def micro_batch(seed: int) -> Batch:
    """Two prompts x :data:`GROUP` samples (consecutive rows share a prompt, left-padded differently per group),
    ragged responses, and per-token weights for the losses."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * GROUP
    prompts = torch.randint(4, 200, (2, 6), generator=g).repeat_interleave(GROUP, 0)
    prompt_mask = torch.ones(rows, 6, dtype=torch.long)
    prompt_mask[GROUP:, :2] = 0  # the second group's prompt is 4 tokens, left-padded
    resp_len = torch.randint(2, 8, (rows,), generator=g)
    response_mask = (torch.arange(7)[None, :] < resp_len[:, None]).long()
    return Batch(
        {
            "prompts": prompts * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": torch.randint(4, 200, (rows, 7), generator=g) * response_mask,
            "response_mask": response_mask,
            "weights": torch.randn(rows, 7, generator=g) * response_mask,
        }
    )


def actor_loss(group_size: int) -> Callable[[nn.Module, Batch], Tensor]:
    """A policy-gradient-shaped loss over ``forward_response``'s log-probs and (differentiable) entropy."""

    def loss(model: nn.Module, batch: Batch) -> Tensor:
        out = forward_response(model, batch, output="logprobs", with_entropy=True, group_size=group_size)
        mask = batch["response_mask"]
        return -((out["logprobs"] * batch["weights"]).sum() + 0.01 * (out["entropy"] * mask).sum()) / mask.sum()

    return loss


def critic_loss(model: nn.Module, batch: Batch) -> Tensor:
    """A value loss over ``forward_response``'s values."""
    values = forward_response(model, batch, output="values")["values"]
    mask = batch["response_mask"]
    return (((values - batch["weights"]) ** 2) * mask).sum() / mask.sum()


def critic_inplace_loss(model: nn.Module, batch: Batch) -> Tensor:
    """The value loss with the model's output modified in place first: what FSDP2's warning is about (an in-place op
    on a returned view detaches the unit's pre-backward hook from the graph)."""
    input_ids, attention_mask, position_ids = sequence_inputs(batch, "cpu")
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits.mul_(2.0)
    resp_len = batch["responses"].shape[1]
    values = logits[:, -resp_len - 1 : -1, 0]
    mask = batch["response_mask"]
    return (((values - batch["weights"]) ** 2) * mask).sum() / mask.sum()


def make_role(kind: str, path: str) -> Role:
    """The role whose model the case trains, loaded with the full weights (same seed on every rank, so the
    critic's new value head is the same everywhere)."""
    torch.manual_seed(0)
    optim = OptimConfig(lr=1e-3)
    algorithm = AlgorithmConfig(batching=BatchingConfig(micro_batch_size=2 * GROUP))
    role: Role
    if kind.startswith("critic"):
        role = CriticRole(path, algorithm=algorithm, optim=optim)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        rollout = RolloutConfig(n=GROUP, max_new_tokens=7)
        role = ActorRole(path, tokenizer=tokenizer, rollout=rollout, algorithm=algorithm, optim=optim)
    role.train_engine.layer = cpu.device_layer(None, "cpu")  # as the strategy hands it at set-up
    role.load()
    return role


def param_groups(unit: FSDPModule) -> list[Any]:
    """The unit's FSDP parameter groups (one per unit in the torch releases without several)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return list(groups)


def sharded(unit: FSDPModule) -> bool:
    return all(group.is_sharded for group in param_groups(unit))


def check(kind: str, path: str, rank: int) -> tuple[int, int, int, int]:
    """One case; returns (units whose pre-backward hook ran in every backward, units, FSDP warnings, outputs that
    ``shard_model``'s hook copied because they were views)."""
    role = make_role(kind, path)
    assert role.model is not None
    if kind == "critic-plain":  # PyTorch's own linear layers: with a bias, a 3-D input's output is a view
        plain_linears(role.model)
    reference = copy.deepcopy(role.model)  # unsharded, bound to the same layers (copied with the model)
    world = dist.get_world_size()
    role.shard(init_device_mesh("cpu", (world,)), param_dtype=None)
    role.materialize(torch.device("cpu"))
    model = role.model
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    layers = [unit for unit in units if unit is not model]
    assert len(layers) >= 2, f"{kind}: expected one FSDP unit per decoder layer, got {len(layers)}"
    losses = {"critic": critic_loss, "critic-plain": critic_inplace_loss}
    loss_fn = losses.get(kind) or actor_loss(GROUP if kind == "actor-packed" else 1)
    batches = [[micro_batch(100 * r + k) for k in range(2)] for r in range(world)]

    ran: list[nn.Module] = []
    pre_backward, cloned_views = FSDPState._pre_backward, fsdp._cloned_views
    copies = [0]

    def recording(self: FSDPState, grad: Tensor) -> Tensor:
        ran.extend(self._modules)
        return pre_backward(self, grad)

    def counting(value: Any) -> Any:  # it calls itself by this name for what a container holds
        copies[0] += isinstance(value, Tensor) and value.requires_grad and value._base is not None
        return cloned_views(value)

    FSDPState._pre_backward = recording  # type: ignore[method-assign]  # hooks bind it at each forward
    fsdp._cloned_views = counting
    try:
        hooked = set(range(len(units)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for micro in batches[rank]:
                ran.clear()
                loss = loss_fn(model, micro)
                assert all(sharded(unit) for unit in layers), f"{kind}: a layer stayed whole after its forward"
                assert not sharded(model), f"{kind}: FSDP2 resharded the root after forward"  # its documented rule
                loss.backward()
                hooked &= {i for i, unit in enumerate(units) if any(m is unit for m in ran)}
                assert all(sharded(unit) for unit in units), f"{kind}: a unit stayed whole after backward"
    finally:
        FSDPState._pre_backward, fsdp._cloned_views = pre_backward, cloned_views  # type: ignore[method-assign]
    for k in range(2):  # FSDP2 averages the ranks' gradients: the mean of the ranks' losses, per micro-batch
        sum(loss_fn(reference, batches[r][k]) for r in range(world)).div(world).backward()
    want = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    largest = max(float(g.abs().max()) for g in want.values())
    assert largest > 1e-4, f"{kind}: the reference's gradients are all but 0"
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{kind}: {name} got no gradient"
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(got, want[name], rtol=1e-4, atol=1e-5 * largest, msg=f"{kind}: {name}")
    # last, so that a failure here says the hooks ran and the gradients were right all the same
    fsdp_warnings = [str(w.message) for w in caught if "FSDP" in str(w.message)]
    assert not fsdp_warnings, f"{kind}: hooks ran in {len(hooked)}/{len(units)} units; FSDP2 warned: {fsdp_warnings}"
    return len(hooked), len(units), len(fsdp_warnings), copies[0]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    path = os.environ["FSDP_CHECK_MODEL"]
    for kind in ("actor", "actor-packed", "critic", "critic-plain"):
        ran, units, warned, copies = check(kind, path, rank)
        sys.stdout.write(f"OK {rank} {kind} {ran}/{units} {warned} {copies}\n")  # one write: the ranks share stdout
        sys.stdout.flush()
    dist.barrier()
    shutdown_process_groups()  # as reshard_check.py: no interpreter finalisation under gloo's threads
    os._exit(0)


if __name__ == "__main__":
    main()
