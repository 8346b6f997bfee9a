"""The training engine: how one role's model is sharded, loaded, looped over in micro-batches and stepped.

Roles say *what* to compute (a forward, a loss over one micro-batch); the engine says *how* (micro-batches, loss
scaling, optimizer steps and where the optimizer state lives). Frozen roles use it without an optimizer.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lightning_rlhf.algorithms import MicroBatchAggregation, uses_global_token_count
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import OptimConfig
from lightning_rlhf.controller.dispatch import current_group, current_sequence_group
from lightning_rlhf.engines.device_layer import PLAIN, DeviceLayer
from lightning_rlhf.engines.train.fsdp import clip_grad_norm, move_optimizer_state, shard_model
from lightning_rlhf.engines.train.microbatch import (
    has_rollout_layout,
    plan_micro_batches,
    row_spans,
    split_to_count,
    trim_padding,
)

__all__ = [
    "LossFn",
    "MetricAccumulator",
    "TrainEngine",
    "check_compute_dtype",
    "global_token_count",
    "make_optimizer",
    "minibatches",
    "resolve_dtype",
    "world",
]

LossFn = Callable[[Batch, MicroBatchAggregation], tuple[Tensor, dict[str, Tensor]]]
"""A role's loss over one micro-batch: ``(loss, metrics)``; the loss is already aggregated with the given
:class:`~lightning_rlhf.algorithms.MicroBatchAggregation` (the engine applies its ``scale`` and calls backward)."""


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the data-parallel group: the role's pool while a role call runs, else all ranks
    (``(0, 1)`` without torch.distributed); in a sequence-parallel call, each group of ranks that share the rows
    counts once. Runs on: any process."""
    if dist.is_available() and dist.is_initialized():
        group = current_group()
        n = sequence_parallel_size()
        return dist.get_rank(group) // n, dist.get_world_size(group) // n
    return 0, 1


def sequence_parallel_size() -> int:
    """The ranks that share each row of the role call running here (1: no sequence parallelism). Runs on: any."""
    group = current_sequence_group()
    return 1 if group is None else dist.get_world_size(group)


def global_token_count(mask: Tensor) -> Tensor:
    """Number of masked-in tokens summed over the data-parallel group. Runs on: every worker rank (an all-reduce)."""
    count = mask.sum().float()
    if world()[1] > 1:
        count = count.to(_reduce_device())
        dist.all_reduce(count, group=current_group())
        count = count / sequence_parallel_size()  # the ranks of a sequence-parallel group hold the same rows
    return count.to(mask.device)


def _reduce_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def minibatches(batch: Batch, *, mini_batch_size: int, epochs: int) -> Iterator[Batch]:
    """This rank's mini-batches for all epochs. ``mini_batch_size`` counts samples over all ranks.

    Runs on: every worker rank, each yielding as many (the batch arithmetic was checked before training).
    """
    local = mini_batch_size // world()[1]
    for _ in range(epochs):
        yield from batch.split(local)


def _reduce(key: str, values: Tensor) -> Tensor:
    """Metrics named ``*_max`` / ``*_min`` keep their extreme; the others are averaged."""
    return values.max() if key.endswith("_max") else values.min() if key.endswith("_min") else values.mean()


class MetricAccumulator:
    """Averages scalar metrics over micro-batches and mini-batches on one rank. Runs on: every worker rank."""

    def __init__(self) -> None:
        self._values: dict[str, list[Tensor]] = defaultdict(list)

    def add(self, metrics: dict[str, Tensor]) -> None:
        """Record one value per metric (detached, as float)."""
        for k, v in metrics.items():
            self._values[k].append(v.detach().float().reshape(()))

    def add_means(self, other: MetricAccumulator) -> None:
        """Record one value per metric of ``other``: its mean (or extreme) over the values ``other`` holds."""
        for k, values in other._values.items():
            self._values[k].append(_reduce(k, torch.stack([v.to(values[0].device) for v in values])))

    def result(self, prefix: str) -> dict[str, float]:
        """Means as Python floats named ``<prefix>/<metric>`` (one host sync per update, not per micro-batch)."""
        if not self._values:
            return {}
        keys = list(self._values)
        # Most values live on the compute device, a few on the host (the learning rate): gather them where most are.
        every = (v.device for values in self._values.values() for v in values)
        device = next((d for d in every if d.type != "cpu"), torch.device("cpu"))
        stacked = [torch.stack([v.to(device) for v in self._values[k]]) for k in keys]
        means = torch.stack([_reduce(k, v) for k, v in zip(keys, stacked, strict=True)]).cpu().tolist()
        return {f"{prefix}/{k}": v for k, v in zip(keys, means, strict=True)}


def make_optimizer(
    params: list[nn.Parameter], cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and a per-RL-step schedule (warm-up, then constant / linear / cosine decay). On CPUs and CUDA GPUs
    AdamW runs fused (the same update up to float rounding): on the vs-TRL small model's 2-rank CPU update the step
    took 9.4 ms against 23.8 ms with PyTorch's per-tensor CPU default.

    Runs on: every process, in ``configure_optimizers`` (after sharding, so ``params`` are the shards).
    """
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True if fused else None
    )
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        decay = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


class TrainEngine:
    """One role model's engine: shard and materialise it, run it in micro-batches, step its optimizer.

    Runs on: every worker rank (one engine per role model per process; all ranks call its methods together).

    Args:
        micro_batch_size: rows per forward (and backward) on one rank.
        micro_batch_tokens: None: micro-batches of ``micro_batch_size`` consecutive rows. An integer: rollout
            batches are packed by :meth:`micro_batches` under this many padded tokens each, and the role's
            ``DP_SPLIT`` calls balance rows over ranks by tokens (``AlgorithmConfig.batching.micro_batch_tokens``).
        optim: optimizer settings; None for a frozen model (no optimizer, no ``train``).
        setting: how the user names this role's model in errors, e.g. ``"ActorRole(path=...)"``.
        fused_norms: switch the bound model's Llama-family RMS norms to the layer's fused RMS norm (the CPU
            layer's: the same forward, bitwise; docs/performance-log.md).
        onednn_linears: switch the bound model's ``nn.Linear`` layers to the layer's products (the CPU layer's:
            oneDNN's float32 products, 2-2.4x faster than MKL's on AMD CPUs with AVX-512).
        layer: the device layer (:class:`~lightning_rlhf.engines.device_layer.DeviceLayer`, PyTorch's own by
            default); the strategy hands the one it chose at set-up.
    """

    def __init__(
        self,
        *,
        micro_batch_size: int,
        micro_batch_tokens: int | None = None,
        optim: OptimConfig | None = None,
        setting: str = "role",
        fused_norms: bool = True,
        onednn_linears: bool = True,
        layer: DeviceLayer = PLAIN,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"{setting}: micro_batch_size={micro_batch_size} must be >= 1.")
        self.micro_batch_size = micro_batch_size
        self.setting = setting
        self.micro_batch_tokens = micro_batch_tokens
        self.optim = optim
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.sharded = False
        self.param_dtype: torch.dtype | None = None  # the compute dtype the model was sharded with (None: its own)
        self._offloaded = False
        self._attn_implementation: str | None = None
        self._checkpointing = False
        self.sequence_parallel = 1
        """Ranks that share each sequence in the model's forwards (:mod:`~lightning_rlhf.engines.train.ulysses`),
        each holding ``1/N`` of the columns; 1: off. Set by ``RLHFModule(sequence_parallel=...)``."""
        self.sequence_group: object | None = None
        """This rank's sequence-parallel group (set by the strategy at set-up when ``sequence_parallel > 1``)."""
        self.fused_norms = fused_norms
        self.onednn_linears = onednn_linears
        self._layer = layer
        self.reshard_in_update = True
        """False: an update gathers each FSDP unit's parameters once and keeps them, and the gradients, whole until
        its optimizer step (see ``RLHFStrategy(reshard_in_update=...)``)."""

    @property
    def micro_batch_tokens(self) -> int | None:
        """Padded tokens per micro-batch at most (None: fixed row micro-batches, untrimmed)."""
        return self._micro_batch_tokens

    @micro_batch_tokens.setter
    def micro_batch_tokens(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"{self.setting}: micro_batch_tokens={value!r} is invalid: expected None or an integer >= 1. "
                "HINT: AlgorithmConfig.batching.micro_batch_tokens caps the padded tokens of one forward on a rank, "
                "e.g. 8192."
            )
        self._micro_batch_tokens = value

    @property
    def balances_ranks(self) -> bool:
        """Whether the role's ``DP_SPLIT`` rollout batches are split over ranks by tokens (the token budget is on)."""
        return self._micro_batch_tokens is not None

    def micro_batches(
        self, batch: Batch, *, trim_responses: bool = True, equalize: bool = True
    ) -> list[tuple[list[int] | None, Batch]]:
        """``(rows, micro-batch)`` pairs covering ``batch``.

        Runs on: every worker rank, each on its own rows (with several ranks, one all-reduce of the plan's length).
        Without a token budget (or for a batch without the rollout layout) they are ``micro_batch_size``
        consecutive rows with ``rows=None``. With ``micro_batch_tokens`` set, the rows (indices into ``batch``) are
        planned by :mod:`~lightning_rlhf.engines.train.microbatch`, split until every rank has as many micro-batches
        (each forward is an FSDP collective; ``equalize=False``: not, the caller evens the counts out), and trimmed
        of padding (the response side too unless ``trim_responses`` is False).
        """
        if self._micro_batch_tokens is None or not has_rollout_layout(batch):
            return [(None, micro) for micro in batch.split(self.micro_batch_size)]
        width_r = batch["response_mask"].shape[1]
        lengths = [(max(1, p), max(1, r) if trim_responses else width_r) for p, r in row_spans(batch)]
        plan = plan_micro_batches(lengths, max_rows=self.micro_batch_size, max_tokens=self._micro_batch_tokens)
        if world()[1] > 1 and equalize:
            plan = split_to_count(plan, lengths, _max_over_ranks(len(plan)))
        return [(rows, trim_padding(batch.select(rows), responses=trim_responses)) for rows in plan]

    @property
    def layer(self) -> DeviceLayer:
        """The device layer of the model's forwards, FSDP collectives and token log-prob kernels. Set by the
        strategy at set-up, before the model is sharded; a model already bound is prepared by the new layer."""
        return self._layer

    @layer.setter
    def layer(self, layer: DeviceLayer) -> None:
        self._layer = layer
        if self.model is not None:
            layer.prepare_model(self.model, norms=self.fused_norms, linears=self.onednn_linears)

    def bind(self, model: nn.Module | None) -> None:
        """Make ``model`` the engine's model, with the engine's ``attn_implementation`` if one is set and the
        layer's forwards (:meth:`~lightning_rlhf.engines.device_layer.DeviceLayer.prepare_model`). Runs on: every
        process, when the role's model is built (before sharding)."""
        self.model = model
        self._apply_attn_implementation()
        self.activation_checkpointing = self._checkpointing
        if model is not None:
            self._layer.prepare_model(model, norms=self.fused_norms, linears=self.onednn_linears)

    @property
    def attn_implementation(self) -> str | None:
        """The attention kernel of the model's forwards (transformers' ``attn_implementation``: ``"sdpa"``,
        ``"eager"``, ``"flash_attention_2"``, ...); None keeps the one the model was loaded with."""
        return self._attn_implementation

    @attn_implementation.setter
    def attn_implementation(self, value: str | None) -> None:
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(
                f"{self.setting}: attn_implementation={value!r} is invalid: expected None or a transformers "
                "attention name. HINT: RLHFModule(attn_implementation='sdpa' | 'eager' | 'flash_attention_2')."
            )
        self._attn_implementation = value
        self._apply_attn_implementation()

    @property
    def activation_checkpointing(self) -> bool:
        """Whether each transformer block of the model keeps only its input in the forward and recomputes the rest
        in the backward (:mod:`~lightning_rlhf.engines.train.checkpointing`): less memory, one more forward."""
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, value: bool) -> None:
        from lightning_rlhf.engines.train.checkpointing import enable_activation_checkpointing

        self._checkpointing = value
        if value and self.model is not None:
            enable_activation_checkpointing(self.model, setting=self.setting)

    def _apply_attn_implementation(self) -> None:
        """Switch the bound model to ``attn_implementation`` (transformers checks the name and the kernel)."""
        name = self._attn_implementation
        setter = getattr(self.model, "set_attn_implementation", None)
        if name is None or setter is None:
            return
        try:
            setter(name)
        except (ValueError, ImportError) as err:
            raise ValueError(
                f"{self.setting}: attn_implementation={name!r} cannot be used by {type(self.model).__name__}: {err} "
                "HINT: RLHFModule(attn_implementation=None) keeps the model's default ('sdpa' on most models)."
            ) from err

    @property
    def device(self) -> torch.device:
        """Where the model's (local shards of) parameters live."""
        assert self.model is not None
        return next(self.model.parameters()).device

    def shard(self, mesh: DeviceMesh, *, param_dtype: torch.dtype | None) -> None:
        """Shard the model with FSDP2 over ``mesh`` (on the meta device when its loading was deferred). Runs on:
        every worker rank, at set-up. Raises ValueError when the model's largest parameter has fewer rows than
        ``mesh`` has ranks."""
        if self.model is None or self.sharded:
            return
        ranks = mesh.size()
        rows = max((p.shape[0] for p in self.model.parameters() if p.dim()), default=0)
        if ranks > 1 and rows < ranks:
            raise ValueError(
                f"{self.setting}: the model's largest parameter has {rows} rows, fewer than the {ranks} ranks it is "
                f"sharded over, so {ranks - rows} of them would hold none of it. HINT: run this role on at most "
                f"{rows} processes, or use a larger model."
            )
        shard_model(self.model, mesh, param_dtype=param_dtype, layer=self._layer)
        self.sharded = True
        self.param_dtype = param_dtype

    def materialize(self, device: torch.device) -> None:
        """Give the model real storage on ``device``: read this rank's shard rows from the checkpoint when its
        loading was deferred, else move it there. Runs on: every worker rank, at set-up, after :meth:`shard`."""
        if self.model is None:
            return
        from lightning_rlhf.engines.train.loading import materialize, needs_materialize

        if needs_materialize(self.model):
            materialize(self.model, device=device)
        else:
            self.model.to(device)

    def infer(self, batch: Batch, forward: Callable[[nn.Module, Batch], dict[str, Tensor]]) -> dict[str, Tensor]:
        """Run ``forward(model, micro_batch)`` over ``batch`` in micro-batches without gradients; each output
        concatenated on the host, in the rows' order in ``batch``. With ``micro_batch_tokens`` set, every output must
        have one row per micro-batch row (ValueError), and one as wide as the trimmed responses is padded back with 0.

        Runs on: every worker rank (FSDP forwards).
        """
        assert self.model is not None, f"{self.setting}: no model loaded"
        parts: dict[str, list[Tensor]] = defaultdict(list)
        order: list[int] = []
        full = batch["response_mask"].shape[1] if has_rollout_layout(batch) else 0
        with torch.no_grad(), _kept_whole(self.model, not self.reshard_in_update, backward=False):
            for rows, micro in self.micro_batches(batch):
                outputs = forward(self.model, micro)
                width = -1 if rows is None else micro["response_mask"].shape[1]  # rows None: as they are
                for key, value in outputs.items():
                    if rows is not None and (value.dim() == 0 or value.shape[0] != len(rows)):
                        raise ValueError(
                            f"{self.setting}: the forward's output {key!r} has shape {tuple(value.shape)} for a "
                            f"micro-batch of {len(rows)} rows; with micro_batch_tokens={self._micro_batch_tokens} "
                            "the rows are reordered, so every output needs one row per input row. HINT: return "
                            "per-row outputs, or set AlgorithmConfig.batching.micro_batch_tokens=None."
                        )
                    parts[key].append(
                        _pad_dim1(value.cpu(), full) if value.dim() >= 2 and value.shape[1] == width else value.cpu()
                    )
                order.extend(rows or ())
        out = {key: torch.cat(values) for key, values in parts.items()}
        if order:
            restore = torch.argsort(torch.tensor(order))
            out = {key: value[restore] for key, value in out.items()}
        return out

    def train(
        self,
        batch: Batch,
        loss_fn: LossFn,
        *,
        aggregation: str,
        count_mask: Callable[[Batch], Tensor],
        mini_batch_size: int | None = None,
        epochs: int = 1,
        max_len: int | None = None,
        trainable: Callable[[Batch], Tensor] | None = None,
    ) -> MetricAccumulator:
        """Epochs x mini-batches x micro-batches of forward-backward, one clipped optimizer step per mini-batch.

        Runs on: every worker rank. Each micro-batch's loss comes from ``loss_fn`` with a
        :class:`~lightning_rlhf.algorithms.MicroBatchAggregation` for ``aggregation`` (with the mini-batch's global
        token count, from ``count_mask``, when the mode needs it); its metrics, ``grad_norm`` and ``update_skipped``
        (1 when the norm was not finite and the step was skipped) are accumulated.

        Args:
            count_mask: the tokens that count in the loss of a batch (e.g. ``response_mask``).
            mini_batch_size: rows per optimizer step over all ranks; None: the whole batch (one step per epoch).
            max_len: the constant length of ``"seq-mean-token-sum-norm"``.
            trainable: per row of a mini-batch, whether its loss can have a nonzero gradient (``[B]`` bool). Rows
                it rules out are left out of the forwards and backwards but still count in the aggregation, so the
                gradient is the whole mini-batch's up to float rounding: the caller must know the loss of such a row
                is constant (e.g. advantages all 0, no KL or entropy term). Reported as ``skipped_rows``. A
                mini-batch in which no rank has a row to train is trained whole.

        With ``micro_batch_tokens`` set, each micro-batch is weighted by its share of the mini-batch's rows (exact
        aggregations); ``"seq-mean-token-sum-norm"`` without ``max_len`` keeps the response columns untrimmed.
        """
        assert self.model is not None, f"{self.setting}: no model loaded"
        mini_size = mini_batch_size or len(batch) * world()[1]
        global_tokens = uses_global_token_count(aggregation)
        trim_responses = not (aggregation == "seq-mean-token-sum-norm" and max_len is None)
        acc = MetricAccumulator()
        self.model.train()
        root = self._layer.keeps_root_in_update()
        with _kept_whole(self.model, not self.reshard_in_update, backward=True, root=root) as units:
            for mini in minibatches(batch, mini_batch_size=mini_size, epochs=epochs):
                num_tokens = global_token_count(count_mask(mini)) / world()[1] if global_tokens else None
                share = _share_of(mini, aggregation, count_mask)
                plan, skipped = self._training_micro_batches(mini, trainable, trim_responses)
                parts = None if skipped else sum(real for _, real in plan)  # see MicroBatchAggregation.report
                per_mini = MetricAccumulator()  # the mini-batches weigh the same in the metrics
                for k, (micro, real) in enumerate(plan):
                    for unit in units:  # kept whole through the update: gradients reduced with the last one only
                        unit.set_requires_gradient_sync(k == len(plan) - 1, recurse=False)
                    agg = MicroBatchAggregation(aggregation, num_tokens, share(micro), max_len, real, parts)
                    loss, metrics = loss_fn(micro, agg)
                    # A stand-in micro-batch (see _training_micro_batches) only keeps the FSDP collectives in step.
                    (loss * (agg.scale if real else 0.0)).backward()
                    if real:
                        per_mini.add(metrics)
                acc.add_means(per_mini)
                if trainable is not None:
                    acc.add({"skipped_rows": torch.tensor(skipped / max(len(mini), 1))})
                for unit in units:  # the step updates the shards, which the next gather reads
                    unit.reshard()
                grad_norm, stepped = self.step()
                acc.add({"grad_norm": grad_norm, "update_skipped": torch.tensor(float(not stepped))})
        return acc

    def _training_micro_batches(
        self, mini: Batch, trainable: Callable[[Batch], Tensor] | None, trim_responses: bool
    ) -> tuple[list[tuple[Batch, bool]], int]:
        """``([(micro-batch, real)], rows left out)`` for one mini-batch of :meth:`train`: the micro-batches of the
        rows ``trainable`` keeps (all rows without it). Every rank runs as many forwards and backwards (each is an
        FSDP collective), so a rank with fewer repeats its first row as a stand-in (``real=False``: its loss times
        0). When no rank keeps a row, the whole mini-batch is trained, so its metrics are still measured.

        Runs on: every worker rank (with several ranks, one all-reduce of a count).
        """
        if trainable is not None:
            keep = trainable(mini).reshape(-1).nonzero().flatten().tolist()
            plan: list[tuple[Batch, bool]] = []
            if keep:
                rows = mini if len(keep) == len(mini) else mini.select(keep)
                plan = [(m, True) for _, m in self.micro_batches(rows, trim_responses=trim_responses, equalize=False)]
            count = _max_over_ranks(len(plan)) if world()[1] > 1 else len(plan)
            if count:
                if len(plan) < count:  # one row, trimmed like any micro-batch of the token budget
                    one = self.micro_batches(mini.select([0]), trim_responses=trim_responses, equalize=False)[0][1]
                    plan += [(one, False)] * (count - len(plan))
                return plan, len(mini) - len(keep)
        return [(micro, True) for _, micro in self.micro_batches(mini, trim_responses=trim_responses)], 0

    def configure_optimizer(
        self, total_steps: int
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """Create AdamW and its schedule over this rank's shards. Runs on: every process, after sharding."""
        if self.optim is None or self.model is None:
            raise TypeError(f"{self.setting} is not trainable: it has no optimizer to configure.")
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(params, self.optim, total_steps)
        return self.optimizer, self.scheduler

    def step(self) -> tuple[Tensor, bool]:
        """Clip, step and zero the optimizer; skip the step when the gradient norm is not finite. Returns
        ``(grad_norm, stepped)``. Runs on: every worker rank (the norm is a collective)."""
        assert self.optimizer is not None and self.model is not None and self.optim is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = clip_grad_norm(params, self.optim.grad_clip)
        stepped = bool(torch.isfinite(norm))
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach(), stepped

    def step_scheduler(self) -> float:
        """Advance the learning-rate schedule by one RL step; returns the rate the step just used."""
        assert self.scheduler is not None
        lr = float(self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        return lr

    def offload_optimizer(self) -> None:
        """Move the optimizer state to host memory (while a rollout engine needs the device's memory). Runs on:
        every worker rank (local shards, no collective)."""
        if self.optimizer is not None and not self._offloaded:
            move_optimizer_state(self.optimizer, "cpu")
            self._offloaded = True

    def onload_optimizer(self) -> None:
        """Bring the optimizer state back next to the parameters. Runs on: every worker rank."""
        if self.optimizer is not None and self._offloaded:
            move_optimizer_state(self.optimizer, self.device)
            self._offloaded = False


@contextlib.contextmanager
def _kept_whole(model: nn.Module, whole: bool, *, backward: bool, root: bool = False) -> Iterator[list[FSDPModule]]:
    """``whole`` (``TrainEngine.reshard_in_update`` off): the FSDP modules of ``model`` set to stay unsharded after
    forward (and, for an update, after backward) for the call's duration, and resharded afterwards; else the root unit
    alone for a call without backward (FSDP2 keeps the root's embedding and head whole after a forward: a scoring
    role would hold them between steps) or with ``root`` (the device layer's ``keeps_root_in_update``), else none.
    Runs on: every worker rank."""
    units: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)] if whole else []
    if not units and (root or not backward) and isinstance(model, FSDPModule):
        units = [model]  # FSDP2 leaves the root whole after a forward: a no-grad call reshards it when done
    inner = [unit for unit in units if unit is not model]  # the root does not reshard after forward anyway
    for unit in inner:
        unit.set_reshard_after_forward(False, recurse=False)
    if backward:
        for unit in units:
            unit.set_reshard_after_backward(False, recurse=False)
    try:
        yield units
    finally:
        for unit in inner:
            unit.set_reshard_after_forward(True, recurse=False)
        for unit in units:
            unit.reshard()
            if backward:
                unit.set_reshard_after_backward(True, recurse=False)
                unit.set_requires_gradient_sync(True, recurse=False)


def _share_of(mini: Batch, aggregation: str, count_mask: Callable[[Batch], Tensor]) -> Callable[[Batch], float]:
    """A micro-batch's share of ``mini`` for :class:`MicroBatchAggregation`: its rows over the mini-batch's (for
    ``"seq-mean-token-mean"``: its rows with a loss token over the mini-batch's on all ranks per rank, an all-reduce:
    the ranks can hold unequal numbers of them), so the micro-batch losses sum to the mini-batch's loss whichever
    rows each one holds."""
    if aggregation != "seq-mean-token-mean":
        return lambda micro: len(micro) / len(mini)
    total = float(global_token_count(count_mask(mini).bool().any(dim=-1))) / world()[1] or 1.0
    return lambda micro: int(count_mask(micro).bool().any(dim=-1).sum()) / total


def _max_over_ranks(value: int) -> int:
    """The largest ``value`` of the data-parallel group's ranks (an all-reduce)."""
    t = torch.tensor([value], dtype=torch.long, device=_reduce_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=current_group())
    return int(t.item())


def _pad_dim1(value: Tensor, width: int) -> Tensor:
    """``value`` right-padded with 0 along dim 1 to ``width`` columns."""
    missing = width - value.shape[1]
    if missing <= 0:
        return value
    return torch.nn.functional.pad(value, [0, 0] * (value.dim() - 2) + [0, missing])


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_DTYPES |= {"float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(value: str | torch.dtype | None, *, setting: str) -> torch.dtype | None:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` (and float32, float16) as a ``torch.dtype``; None stays None.
    Runs on: any process, when settings are made. Raises ValueError naming ``setting`` for anything else."""
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in _DTYPES.values():
            raise ValueError(f"{setting}={value} is not supported. HINT: use torch.float32 or torch.bfloat16.")
        return value
    key = str(value).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(
            f"{setting}={value!r} is not a dtype lightning_rlhf computes in. HINT: 'float32' or 'bfloat16'."
        )
    return _DTYPES[key]


def check_compute_dtype(dtype: torch.dtype | None, device: torch.device, *, setting: str) -> None:
    """Refuse (ValueError) a dtype that ``device`` cannot compute the models in, before any model loads: float16 on
    CPUs (several kernels the models need have no float16 CPU version), bfloat16 on a GPU without it. Runs on: every
    process, at set-up."""
    if dtype is None or dtype == torch.float32:
        return
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError(
            f"{setting}=float16 cannot run on CPU: PyTorch lacks float16 CPU kernels for parts of the models. "
            "HINT: use bfloat16 (fast on CPUs with AVX512-BF16 or AMX) or float32."
        )
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"{setting}=bfloat16, but {torch.cuda.get_device_name(device)} has no bfloat16 support. "
            "HINT: use float16 or float32 on this GPU."
        )
