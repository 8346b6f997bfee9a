"""Sequence parallelism (``engines/train/ulysses.py``) against data parallelism on 2 ranks (gloo, float32), under
torchrun; ``tests/distributed/test_sequence_parallel_runs.py`` launches it. On 4 ranks it compares SP=2 x DP=2 with
DP=4.

A tiny Qwen2 causal LM and a token classifier (the critic's shape) are built from one seed on both ranks and sharded
with FSDP2 over both ranks by the training engine. One global batch (left-padded prompts, ragged responses) goes
through the engine twice: DP=2 (each rank half the rows, no sequence group) and SP=2 (both ranks all rows, each half
of every sequence). Per model: the scoring forward's outputs (``infer``: log-probs and entropy, values) and the
weight change of one ``train`` step (AdamW with a large ``eps``: the change is the learning rate times the gradient
over ``eps``, linear in the gradient). ``actor-lora``: the actor with LoRA adapters (``RLHFModule(lora=...)``,
rank 4 on every linear layer, peft), every ``lora_B`` set non-zero so that ``lora_A`` gets a gradient; only the
adapters train. Rank 0 writes the relative differences, the loss metrics, which weights moved (``lora_A``,
``lora_B``, other trained, frozen) and how many times the Ulysses attention ran and built a ``[T, T]`` mask to
``--out`` (JSON).

Usage: torchrun --nproc-per-node 2 tests/scripts/sequence_parallel_check.py --out F [--kv-heads 1] [--checkpointing]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from lightning_rlhf.algorithms import MicroBatchAggregation
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import OptimConfig
from lightning_rlhf.controller.dispatch import data_parallel_group
from lightning_rlhf.engines.train import TrainEngine, forward_response, ulysses
from lightning_rlhf.engines.train.engine import LossFn
from lightning_rlhf.engines.train.lora import apply_lora, resolve_lora
from lightning_rlhf.roles.base import disable_dropout
from lightning_rlhf.strategy.strategy import shutdown_process_groups

CALLS = [0]
MASKS = [0]  # [T, T] masks built by the Ulysses attention
_full_mask = ulysses.full_mask


def _counted_mask(attention_mask: Tensor) -> Tensor:
    MASKS[0] += 1
    return _full_mask(attention_mask)


def _counted(module: nn.Module, *args: object, **kwargs: object) -> object:
    CALLS[0] += 1
    return ulysses._attention(module, *args, **kwargs)  # type: ignore[arg-type]


def rollout(rows: int = 8, prompt: int = 6, response: int = 9, *, left_padded: bool = True) -> Batch:
    """Left-padded prompts (else all of ``prompt`` tokens), right-padded responses of ragged lengths, per-token
    targets (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    prompt_len = torch.randint(2, prompt + 1, (rows,), generator=g)
    if not left_padded:
        prompt_len = torch.full((rows,), prompt)
    prompt_mask = (torch.arange(prompt)[None] >= prompt - prompt_len[:, None]).long()
    resp_len = torch.randint(1, response + 1, (rows,), generator=g)
    response_mask = (torch.arange(response)[None] < resp_len[:, None]).long()
    return Batch(
        {
            "prompts": torch.randint(1, 96, (rows, prompt), generator=g) * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": torch.randint(1, 96, (rows, response), generator=g) * response_mask,
            "response_mask": response_mask,
            "targets": torch.randn(rows, response, generator=g),
        }
    )


def build(kind: str, kv_heads: int) -> nn.Module:
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation="eager" if kind == "actor-eager" else "sdpa",
        num_labels=1,
    )
    torch.manual_seed(0)
    cls = Qwen2ForTokenClassification if kind == "critic" else Qwen2ForCausalLM
    model = cls(config).float()
    disable_dropout(model)  # as the roles do (the classifier's head has dropout)
    return with_adapters(model) if kind == "actor-lora" else model


def with_adapters(model: nn.Module) -> nn.Module:
    """``model`` wrapped with LoRA adapters as ``RLHFModule(lora={"r": 4})`` gives the actor (every linear layer),
    every ``lora_B`` then set to the same non-zero values on every rank: they start at zero, which leaves ``lora_A``
    without a gradient."""
    setting = "RLHFModule(lora=...)"
    wrapped = apply_lora(model, resolve_lora({"r": 4}, setting=setting, task_type="CAUSAL_LM"), setting=setting)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return wrapped


def part(name: str, trained: bool) -> str:
    """Which kind of weight ``name`` is: ``lora_A``, ``lora_B``, another ``trained`` weight, or ``frozen``."""
    return next((k for k in ("lora_A", "lora_B") if k in name), "trained" if trained else "frozen")


def loss_fn(kind: str, engine: TrainEngine) -> LossFn:
    def loss(micro: Batch, agg: MicroBatchAggregation) -> tuple[Tensor, dict[str, Tensor]]:
        assert engine.model is not None
        mask = micro["response_mask"].float()
        if kind != "critic":
            out = forward_response(engine.model, micro, output="logprobs", with_entropy=True)
            per_token = -out["logprobs"] * micro["targets"] - 0.01 * out["entropy"]
        else:
            values = forward_response(engine.model, micro, output="values")["values"]
            per_token = (values - micro["targets"]) ** 2
        value = agg.aggregate(per_token, mask)
        return value, {"loss": agg.report(value, mask)}

    return loss


def run(kind: str, kv_heads: int, sp: int, checkpointing: bool, group: object) -> dict[str, object]:
    """Score and train one model on the global batch with sequence-parallel size ``sp``; the outputs of every row
    and the change of every weight (full tensors)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    engine = TrainEngine(micro_batch_size=2, optim=OptimConfig(lr=100.0, eps=1e4, weight_decay=0.0, grad_clip=1e9))
    engine.bind(build(kind, kv_heads))
    engine.activation_checkpointing = checkpointing
    engine.sequence_parallel = sp
    engine.shard(mesh, param_dtype=None)
    engine.materialize(torch.device("cpu"))
    engine.configure_optimizer(10)
    assert engine.model is not None
    named = list(engine.model.named_parameters())
    before = [p.full_tensor().detach().clone() for _, p in named]
    batch = rollout(left_padded=kind != "actor-causal")
    rows = batch.chunk(world // sp)[rank // sp]  # a sequence-parallel group's ranks get the same rows
    output = "values" if kind == "critic" else "logprobs"
    with data_parallel_group(None, group if sp > 1 else None):
        scored = engine.infer(rows, lambda m, micro: forward_response(m, micro, output=output, with_entropy=True))
        acc = engine.train(
            rows, loss_fn(kind, engine), aggregation="token-mean", count_mask=lambda b: b["response_mask"]
        )
    parts: list[dict[str, Tensor] | None] = [None] * world
    dist.all_gather_object(parts, scored)  # every part, in row order: the first rank's of each group
    scored = {k: torch.cat([h[k] for h in parts[::sp] if h is not None]) for k in scored}
    after = [p.full_tensor().detach() for _, p in named]
    moved: dict[str, list[int]] = {}  # kind of weight -> [tensors that changed, tensors]
    for (name, param), a, b in zip(named, after, before, strict=True):
        count = moved.setdefault(part(name, param.requires_grad), [0, 0])
        count[0] += int(not torch.equal(a, b))
        count[1] += 1
    return {
        "scored": scored,
        "delta": torch.cat([(a - b).flatten() for a, b in zip(after, before, strict=True)]),
        "metrics": acc.result(kind),
        "moved": moved,
    }


def relative(a: Tensor, b: Tensor, mask: Tensor | None = None) -> float:
    if mask is not None:
        a, b = a[mask], b[mask]
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--checkpointing", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    AttentionInterface.register(ulysses.ATTENTION_NAME, _counted)
    ulysses.full_mask = _counted_mask  # type: ignore[assignment]
    world = dist.get_world_size()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank makes every group
    group = pairs[dist.get_rank() // 2]
    mask = rollout()["response_mask"].bool()  # the same responses with and without left padding
    report: dict[str, object] = {}
    # actor-causal: prompts without left padding, where sdpa runs its causal kernels without a mask; actor-eager:
    # the model's eager attention inside the wrapper (an additive mask); actor-lora: LoRA adapters on the actor
    for kind in ("actor", "critic", "actor-causal", "actor-eager", "actor-lora"):
        dp = run(kind, args.kv_heads, 1, args.checkpointing, None)
        calls = CALLS[0]
        sp = run(kind, args.kv_heads, 2, args.checkpointing, group)
        report[kind] = {
            "outputs": {k: relative(sp["scored"][k], v, mask) for k, v in dp["scored"].items()},  # type: ignore[index, union-attr]
            "delta": relative(sp["delta"], dp["delta"]),  # type: ignore[arg-type]
            "delta_norm": float(dp["delta"].norm()),  # type: ignore[union-attr]
            "metrics": {"dp": dp["metrics"], "sp": sp["metrics"]},
            "moved": {"dp": dp["moved"], "sp": sp["moved"]},
            "ulysses_calls": {"dp": calls, "sp": CALLS[0] - calls},
            "masks_built": MASKS[0],
        }
        CALLS[0] = MASKS[0] = 0
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps(report, indent=1))
    shutdown_process_groups()


if __name__ == "__main__":
    main()
