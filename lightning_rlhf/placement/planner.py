"""Auto-mapping: choose where each role runs from a cost model (HybridFlow's third idea, issue 12).

A *placement* splits the roles of a dataflow into groups. The roles of a group are colocated: they time-share
the same devices. Each group gets a pool of its own, and pools are disjoint. Roles on disjoint pools can run
their calls of one stage at the same time. Roles that share a pool run them one after another. The planner
enumerates:

1. every set partition of the roles (which roles to colocate);
2. for each, every split of the devices into pools (in units of a node, coarsened for large clusters);
3. for each, the actor's rollout tensor-parallel size (its replicas fill the actor's pool).

For each candidate it predicts the memory of every pool and the time of every stage of the dataflow, and it
returns the fastest plan that fits. Training roles are FSDP-sharded over their whole pool.

The cost model:

- Compute: FLOPs / (devices x peak x efficiency), counting the parameters of the matmuls (all but the input
  embedding, a lookup).
  - Training is 6 x parameters x tokens, plus causal attention.
  - Forwards and prefill are 2 x parameters x tokens.
  - Decoding is the larger of compute and reading the weights and the KV cache from memory, per decoding step.
  - Tensor parallelism adds two all-reduces per layer per decoding step.
- Communication: FSDP's all-gathers and reduce-scatter, overlapped with compute (the step takes the longer of
  the two), over NVLink inside a node and over the network across nodes.
- Memory, per device:
  - a trainable role holds 16 bytes per parameter over its pool (float32 weights, gradients, two Adam moments);
  - a frozen role holds 2 bytes per parameter (bfloat16);
  - the rollout engine holds 2 bytes per parameter over its tensor-parallel group, plus the KV cache in
    whatever memory is left; the KV cache bounds how many sequences decode at once (more waves when it is
    small).

- CPU processes that need more cores than the machine gives them (:attr:`Hardware.cores`) time-share them: in each
  stage, every call of a busy pool takes ``1 / core_share`` as long (:func:`core_share`).

The constants come from published datasheets for GPUs (:data:`HARDWARE`) or from this machine's measured
matmul peak and memory bandwidth (:func:`cpu_hardware`).

What is not modelled yet:

- offloading (optimizer state moved to host memory while the engine generates);
- pipeline parallelism;
- asynchronous (off-policy) stages;
- the calibration of the efficiency factors against measured runs. The GPU factors are the usual
  large-model figures, and they are a planner's assumptions, not measurements.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
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
    "calibrate_for_shape",
    "core_share",
    "cpu_hardware",
    "dataflow_for",
    "device_splits",
    "fit_call_costs",
    "hardware_for",
    "measure_call_overhead",
    "measure_host_overheads",
    "measure_memcpy_bw",
    "plan",
    "predict",
    "recipe_inputs",
    "save_call_costs",
    "set_partitions",
    "shape_of",
    "with_saved_call_costs",
]

GB = 1e9


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
    """Fraction of the peak a decoding step's compute reaches (None: ``forward_eff``). Decoding's matmuls are
    ``[sequences, hidden]`` thin; on CPUs, where a step is compute-bound, they reach less than a forward's."""
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
    """CPU cores the run's processes share (:func:`lightning_rlhf.perf.available_cores`); None for devices that do
    not share their compute (GPUs). The figures above are one process's with ``threads`` cores to itself."""
    threads: int = 1
    """Compute threads of each process (torch's intra-op threads); with ``cores``, how many processes fit on the
    cores before they time-share them (:func:`core_share`)."""
    server_copy_bw: float = 25e9
    """Bytes/s of an engine server's hand-off copies: a vLLM actor on part of the ranks generates in a server
    process per rank, whose weights travel through a shared-memory file (written by the trainer, cloned by the
    server). GPUs: host copies over PCIe; CPUs: the measured memcpy bandwidth."""
    server_call_s: float = 1e-3
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
    each run at once on ``cores`` cores: ``min(1, cores / (processes x threads))`` (1 when ``cores`` is None:
    devices that do not share compute).

    Runs on: any process (arithmetic). The operating system time-slices oversubscribed cores, so each process runs
    every part of its work (matmuls, Python, copies) ``1 / share`` times as long as it would with its ``threads``
    cores to itself: 4 single-threaded processes on 2 cores get 0.5 each; 2 of them get 1.
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
    collective_bw: float | None = None,
    layer_step_s: float = 0.0,
    layer_micro_s: float = 0.0,
    call_s: float = 0.0,
    cores: float | None = None,
    threads: int = 1,
) -> Hardware:
    """This machine as a pool of ``processes`` CPU workers, from measured figures: ``flops`` (one process's
    matmul rate with ``threads`` threads), ``memcpy_bw`` (bytes/s), ``memory`` (bytes per process), and the
    ``cores`` the processes share (:func:`lightning_rlhf.perf.available_cores`; None: as if each had ``threads``
    cores of its own).

    Runs on: any process. ``collective_bw`` defaults to half the memcpy bandwidth (gloo copies through shared
    memory twice). CPU kernels on small shapes reach less of the peak than GPUs do: training 0.7, forward 0.6.
    A stage whose busy processes need more cores than there are runs each call ``1 / core_share`` times as long.
    """
    bw = collective_bw if collective_bw is not None else memcpy_bw / 2
    return Hardware(
        "cpu", flops=flops, memory=memory, hbm_bw=memcpy_bw, intra_bw=bw, inter_bw=bw,
        devices_per_node=processes, train_eff=0.7, forward_eff=0.6, bw_eff=1.0, latency_s=200e-6,
        layer_step_s=layer_step_s, layer_micro_s=layer_micro_s, call_s=call_s, cores=cores, threads=threads,
        server_copy_bw=memcpy_bw,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (Llama family: gated MLP, grouped-query attention)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def params(self) -> float:
        """Parameter count (untied embedding and head). Runs on: any process."""
        head_dim = self.hidden // self.heads
        attn = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * self.vocab * self.hidden + self.hidden

    @property
    def matmul_params(self) -> float:
        """Parameters that take part in a token's matmuls: all but the input embedding, which is a lookup (the
        FLOP counts use it; memory and communication use :attr:`params`). Runs on: any process."""
        return self.params - self.vocab * self.hidden

    def lora_params(self, rank: int) -> float:
        """Parameters of rank-``rank`` LoRA adapters on every linear layer of the decoder (``r * (in + out)`` per
        projection: q, k, v, o, gate, up, down). Runs on: any process."""
        head_dim = self.hidden // self.heads
        q, kv = self.heads * head_dim, self.kv_heads * head_dim
        sides = (self.hidden + q) * 2 + (self.hidden + kv) * 2 + 3 * (self.hidden + self.intermediate)
        return float(rank * self.layers * sides)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> float:
        """Bytes of keys and values one token keeps in the KV cache. Runs on: any process."""
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * dtype_bytes


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
ROLES = ("actor", "critic", "reference", "reward")


def dataflow_for(roles: Sequence[str], *, old_logprobs: bool | None = None) -> list[list[Call]]:
    """The stages of a step with these model roles: the actor generates; the reference, reward model and critic
    score the rollout, and the actor computes the old log-probs when the algorithm needs them (independent calls: one
    stage); the actor and the critic update (both read only the scored batch: one stage). ``old_logprobs`` None:
    when there is a critic (PPO; GRPO's single on-policy update reuses its own detached log-probs).

    Runs on: any process. Raises :class:`InfeasiblePlacementError` without an actor or for an unknown role."""
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

    @property
    def step_s(self) -> float:
        """Predicted seconds per RL step. Runs on: any process."""
        return sum(self.stage_s)

    def pool_of(self, role: str) -> int:
        """Index of the pool that holds ``role``. Runs on: any process."""
        return next(i for i, group in enumerate(self.groups) if role in group)

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
            "predicted_step_s": round(self.step_s, 4),
            "stage_s": [round(s, 4) for s in self.stage_s],
        }


def _flow(algorithm: str | list[list[Call]]) -> list[list[Call]]:
    if not isinstance(algorithm, str):
        return algorithm
    if algorithm not in DATAFLOWS:
        raise InfeasiblePlacementError(f"algorithm={algorithm!r}: expected one of {sorted(DATAFLOWS)}.")
    return DATAFLOWS[algorithm]


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


def _attention_flops(model: ModelShape, wl: Workload) -> float:
    """Forward FLOPs of causal attention's two matmuls over one step's sequences."""
    length = wl.prompt_len + wl.response_len
    return 2.0 * model.layers * model.hidden * length * length * wl.sequences


def _micro_batches(wl: Workload, n: int) -> int:
    """Training micro-batches per device and step."""
    return math.ceil(wl.tokens / (n * wl.micro_tokens))


def _train_s(model: ModelShape, wl: Workload, hw: Hardware, n: int) -> float:
    # LoRA: the frozen base gets no weight gradients (the backward's weight products, a third of the FLOPs) and
    # FSDP2 reduce-scatters none of its gradients (2 of the 3 weight transfers are the gathers).
    weight_passes = 4.0 if wl.lora_rank else 6.0
    flops = weight_passes * model.matmul_params * wl.tokens + 3 * _attention_flops(model, wl)
    compute = flops / (n * hw.flops * hw.train_eff)
    transfers = 2 if wl.lora_rank else 3
    comm = 0.0 if n == 1 else transfers * 2.0 * model.params * (n - 1) / n / hw.bandwidth(n)
    comm += 0.0 if n == 1 else transfers * model.layers * hw.latency_s
    host = _micro_batches(wl, n) * model.layers * hw.layer_micro_s
    return max(compute, comm) + host


def _forward_s(model: ModelShape, wl: Workload, hw: Hardware, n: int) -> float:
    flops = 2.0 * model.matmul_params * wl.tokens + _attention_flops(model, wl)
    compute = flops / (n * hw.flops * hw.forward_eff)
    comm = 0.0 if n == 1 else 2.0 * model.params * (n - 1) / n / hw.bandwidth(n) + model.layers * hw.latency_s
    host = _micro_batches(wl, n) * model.layers * hw.layer_micro_s / 3
    return max(compute, comm) + host


def _generate_s(
    model: ModelShape, wl: Workload, hw: Hardware, n: int, tp: int, free_bytes: float, *, server: bool = False
) -> float:
    """Prefill + decoding on ``n // tp`` replicas, in waves of as many sequences as the KV cache holds, plus
    the weight hand-off from the FSDP shards (``server``: through an engine server's shared-memory file, two
    more copies of each rank's weights, and one request per call)."""
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
    trainable role (float32 weights, gradients, two Adam moments), 2 for a frozen one (bfloat16). LoRA: a trainable
    role keeps its frozen float32 base (4 per parameter) and 16 per adapter parameter; the reference is the actor's
    base with its adapters off, nothing of its own, where it shares the actor's pool (elsewhere it needs a copy)."""
    if not wl.lora_rank:
        return (16.0 if role in TRAINABLE else 2.0) * model.params
    if role in TRAINABLE:
        return 4.0 * model.params + 16.0 * model.lora_params(wl.lora_rank)
    if role == "reference" and "actor" in pool:
        return 0.0
    return 2.0 * model.params


def _pool_memory(
    roles: Sequence[str], model: ModelShape, wl: Workload, hw: Hardware, n: int, tp: int, *, server: bool = False
) -> tuple[float, float]:
    """``(bytes per device that stay, bytes per device left for the KV cache)`` of a pool (``server``: the
    engine lives in its own process and keeps its weights while training runs)."""
    states = sum(_state_bytes(role, roles, model, wl) / n for role in roles)
    training = any(role in TRAINABLE for role in roles)
    activations = wl.micro_tokens * model.hidden * (2.0 * model.layers + 34.0) if training else 0.0
    engine = 2.0 * model.params / tp if "actor" in roles else 0.0
    budget = hw.memory * hw.usable_memory
    # A colocated engine's weights and training's activations take turns; an engine server's stay.
    fixed = states + (activations + engine if server else max(activations, engine))
    return fixed, budget - states - engine


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
    """The cost model's prediction for one placement (``algorithm``: a name in :data:`DATAFLOWS` or the stages
    of :func:`dataflow_for`; ``hardware``: a :class:`Hardware` or a device type of :data:`HARDWARE`, any case;
    ``engine_servers``: the rollout engine is vLLM, which serves an actor on part of the devices from one engine
    server process per device, :mod:`lightning_rlhf.engines.rollout.vllm_server`).

    Runs on: any process (the controller, before any model loads). Raises :class:`InfeasiblePlacementError` for a
    role of the dataflow in no pool or in two, a TP size that does not divide the actor's pool, or a pool whose
    roles do not fit in its memory (the message names the pool and the bytes).
    """
    hardware = hardware_for(hardware) if isinstance(hardware, str) else hardware
    flow = _flow(algorithm)
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
    actor_pool = next(i for i, g in enumerate(groups) if "actor" in g)
    if devices[actor_pool] % rollout_tp:
        raise InfeasiblePlacementError(
            f"rollout_tp={rollout_tp} does not divide the actor's pool of {devices[actor_pool]} devices. HINT: pick "
            "a TP size that divides it."
        )
    served = engine_servers and devices[actor_pool] < sum(devices)
    memory, free = [], []
    for group, n in zip(groups, devices, strict=True):
        fixed, left = _pool_memory(group, model, workload, hardware, n, rollout_tp, server=served and "actor" in group)
        budget = hardware.memory * hardware.usable_memory
        kv_one = model.kv_bytes_per_token() * (workload.prompt_len + workload.response_len) / rollout_tp
        if fixed > budget or ("actor" in group and left < kv_one):
            raise InfeasiblePlacementError(
                f"pool {list(group)} on {n} x {hardware.name}: needs {fixed / GB:.3g} GB per device (+ KV cache) of "
                f"{budget / GB:.3g} GB usable. HINT: give the pool more devices, or colocate fewer roles on it."
            )
        memory.append(fixed)
        free.append(left)
    stage_s = []
    for stage in flow:
        busy = sorted({next(j for j, g in enumerate(groups) if role in g) for role, _ in stage})
        # CPU processes of the pools busy in this stage time-share the cores when they need more than there are.
        share = core_share(cores=hardware.cores, processes=sum(devices[j] for j in busy), threads=hardware.threads)
        per_pool: dict[int, float] = {}
        for role, kind in stage:
            i = next(j for j, g in enumerate(groups) if role in g)
            n = devices[i]
            if kind == "generate":
                t = _generate_s(model, workload, hardware, n, rollout_tp, free[i], server=served)
            elif kind == "train":
                t = _train_s(model, workload, hardware, n)
            else:
                t = _forward_s(model, workload, hardware, n)
            t += hardware.call_s + (hardware.train_call_s if kind == "train" else 0.0)
            per_pool[i] = per_pool.get(i, 0.0) + t / share  # calls on one pool run one after another
        stage_s.append(max(per_pool.values()))  # pools run their calls at the same time
    return Plan(tuple(tuple(g) for g in groups), tuple(devices), rollout_tp, tuple(stage_s), tuple(memory))


def plan(
    *,
    model: ModelShape,
    hardware: Hardware | str,
    devices: int,
    workload: Workload,
    algorithm: str | list[list[Call]] = "ppo",
    tp_sizes: Sequence[int] = (1, 2, 4, 8),
    unit: int | None = None,
    actor_devices: int | None = None,
    engine_servers: bool = False,
) -> Plan:
    """The fastest placement that fits: every colocation choice x device split x rollout TP size.

    Runs on: any process (the controller, before any model loads). Ties go to fewer pools, then to the order of
    enumeration. Raises :class:`InfeasiblePlacementError` when nothing fits, with the smallest shortfall.
    ``hardware``: a :class:`Hardware` or a device type of :data:`HARDWARE` (any case: ``"H100"``).
    ``unit``: devices per pool step (None: a whole node once there is more than one; 1 splits single processes,
    as ``RLHFStrategy(placement="auto")`` does for CPU processes). ``actor_devices``: only placements whose actor
    pool has this many devices. ``engine_servers``: the rollout engine is vLLM (an actor pool smaller than
    ``devices`` pays its engine servers' hand-off copies, requests and memory; see :func:`predict`).
    """
    hardware = hardware_for(hardware) if isinstance(hardware, str) else hardware
    flow = _flow(algorithm)
    roles = sorted({role for stage in flow for role, _ in stage})
    if unit is None:
        unit = hardware.devices_per_node if devices >= hardware.devices_per_node else 1
    if devices % unit:
        raise InfeasiblePlacementError(
            f"devices={devices}: not a whole number of {unit}-device nodes. HINT: plan for whole nodes."
        )
    best: Plan | None = None
    last_error: InfeasiblePlacementError | None = None
    for groups in set_partitions(roles):
        for split in device_splits(devices, len(groups), unit):
            for tp in tp_sizes:
                actor_n = split[next(i for i, g in enumerate(groups) if "actor" in g)]
                if actor_n % tp or tp > hardware.devices_per_node:
                    continue
                if actor_devices is not None and actor_n != actor_devices:
                    continue
                try:
                    candidate = predict(
                        groups, split, tp, model=model, hardware=hardware, workload=workload, algorithm=flow,
                        engine_servers=engine_servers,
                    )  # fmt: skip
                except InfeasiblePlacementError as err:
                    last_error = err
                    continue
                key = (candidate.step_s, len(candidate.groups))
                if best is None or key < (best.step_s, len(best.groups)):
                    best = candidate
    if best is None:
        raise InfeasiblePlacementError(
            f"no placement of {roles} fits on {devices} x {hardware.name} ({last_error}). HINT: more devices, or "
            "a smaller model."
        )
    return best


KNOWN_SHAPES: dict[str, ModelShape] = {
    "Qwen/Qwen2.5-0.5B-Instruct": ModelShape(
        layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936
    ),
    "Qwen/Qwen2.5-1.5B-Instruct": ModelShape(
        layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151936
    ),
    "Qwen/Qwen2.5-7B-Instruct": ModelShape(
        layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064
    ),
}
"""Shapes of hub models the recipes name (their ``config.json``), for planning without downloading them."""


def shape_of(model: str, *, override: str | None = None) -> ModelShape:
    """The shape of the actor ``model`` of a recipe. Resolution order:

    1. ``override``: a name in :data:`MODELS`;
    2. a local folder, or an embedded model, with a ``config.json``;
    3. :data:`KNOWN_SHAPES`.

    Runs on: the ``plan`` command's process. Raises :class:`InfeasiblePlacementError` naming ``--model-shape`` when
    none of them applies.
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
            vocab=c.vocab_size,
        )  # fmt: skip
    if model in KNOWN_SHAPES:
        return KNOWN_SHAPES[model]
    raise InfeasiblePlacementError(
        f"actor {model!r}: no local config.json and not a known hub model ({sorted(KNOWN_SHAPES)}). HINT: pass "
        f"--model-shape with one of {sorted(MODELS)}."
    )


def recipe_inputs(recipe: str, *, model_shape: str | None = None) -> tuple[list[list[Call]], ModelShape, Workload]:
    """The dataflow, the actor's shape and one step's workload a recipe describes: its module's model roles
    (a ``critic``; a ``reference``; a ``reward`` that is a model path rather than a function's import path), the
    data module's ``batch_size`` and ``max_prompt_length``, and ``rollout.n`` and ``rollout.max_new_tokens`` (the
    defaults of :class:`~lightning_rlhf.config.RolloutConfig` when the recipe leaves them out).

    Runs on: the ``plan`` command's process, before any model loads.
    """
    import yaml

    from lightning_rlhf.config import RolloutConfig

    with open(recipe) as f:
        config = yaml.safe_load(f) or {}
    module = (config.get("model") or {}).get("init_args") or {}
    data = (config.get("data") or {}).get("init_args") or {}
    if "actor" not in module:
        raise InfeasiblePlacementError(f"{recipe}: no model.init_args.actor. HINT: pass an RLHF recipe.")
    roles = ["actor"]
    if module.get("critic"):
        roles.append("critic")
    if module.get("reference"):
        roles.append("reference")
    reward = module.get("reward")
    if isinstance(reward, str) and (Path(reward).is_dir() or reward.count("/") == 1):  # a folder or "org/name"
        roles.append("reward")
    rollout = module.get("rollout") or {}
    defaults = RolloutConfig()
    workload = Workload(
        prompts=int(data.get("batch_size", 8)),
        n=int(rollout.get("n", defaults.n)),
        prompt_len=int(data.get("max_prompt_length") or 512),
        response_len=int(rollout.get("max_new_tokens", defaults.max_new_tokens)),
        lora_rank=int((module.get("lora") or {}).get("r", 8)) if module.get("lora") else 0,
    )
    return dataflow_for(roles), shape_of(str(module["actor"]), override=model_shape), workload


def _best_of(fn: Any, repeats: int, timer: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn``, after one untimed warm-up call."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = timer()
        fn()
        best = min(best, timer() - t0)
    return best


def measure_memcpy_bw(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """This process's memory copy bandwidth, bytes/s (read + write of a ``nbytes`` buffer, best of ``repeats``).
    Runs on: the ``plan`` command's process."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_of(lambda: dst.copy_(src), repeats)


def measure_host_overheads(repeats: int = 5, *, timer: Callable[[], float] = time.thread_time) -> tuple[float, float]:
    """``(layer_step_s, layer_micro_s)`` of this machine: the host time per decoder layer of one decoding step
    (the transformers engine's own loop) and of one training micro-batch (forward and backward), from the
    difference between a 1-layer and a 5-layer random Qwen2 of width 32, where the arithmetic is negligible.

    Runs on: the calling process (about 2 s). The default clock is the calling thread's CPU time
    (``time.thread_time``: a width-32 model's operations, backward included, run on the calling thread), so the
    time other jobs take the cores away is not counted: the figures are those of a process with a core to itself,
    as the cost model wants them (:func:`core_share` accounts for the run's own processes sharing cores). Each size
    is timed ``repeats`` times, the two sizes in turn (a burst of load falls on both alike), and each keeps its
    fastest time (load only ever adds time). A cost is never negative: should the 5-layer model still come out
    faster, that cost is taken as 0 with a warning. ``timer``: the clock in seconds (a parameter, so that tests can
    give the timings).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.engines.rollout.base import SamplingParams

    if repeats < 1:
        raise ValueError(f"measure_host_overheads(repeats={repeats}): expected at least 1.")
    steps = 32
    params = SamplingParams(n=1, max_new_tokens=steps, min_new_tokens=steps)
    prompts = [[3, 4, 5, 6]] * 8
    ids = torch.randint(2, 64, (4, 16))
    cpu = torch.device("cpu")

    def decode(model: Any) -> None:
        CPULayer().decode_loop().sample_loop(model.eval(), prompts, params, stops={1}, pad_token_id=0, device=cpu)

    def train(model: Any) -> None:
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()

    models = {}
    for layers in (1, 5):
        config = Qwen2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64,
        )  # fmt: skip
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        models[layers] = Qwen2ForCausalLM(config)
        decode(models[layers])  # warm-up, untimed
        train(models[layers])
    best = {(layers, kind): math.inf for layers in models for kind in ("decode", "train")}
    for _ in range(repeats):
        for layers, model in models.items():
            for kind, fn in (("decode", decode), ("train", train)):
                t0 = timer()
                fn(model)
                best[layers, kind] = min(best[layers, kind], timer() - t0)
    step_s = (best[5, "decode"] - best[1, "decode"]) / 4 / steps
    micro_s = (best[5, "train"] - best[1, "train"]) / 4
    return _not_negative("layer_step_s", step_s), _not_negative("layer_micro_s", micro_s)


def _not_negative(name: str, value: float) -> float:
    """``value``, or 0 with a warning when it is negative: a measured cost below 0 would predict faster steps for
    more work."""
    if value >= 0:
        return value
    import warnings

    warnings.warn(
        f"measure_host_overheads: {name} came out {value:.3g} s (the 5-layer model timed faster than the 1-layer "
        "one: the machine was busy while it measured); taken as 0. HINT: plan on an idle machine for this figure.",
        RuntimeWarning,
        stacklevel=3,
    )
    return 0.0


def calibrate_for_shape(hw: Hardware, model: ModelShape, wl: Workload, repeats: int = 2) -> Hardware:
    """``hw`` with its efficiency factors measured on this process for ``model``'s width: a training micro-batch,
    a no-grad forward and a decoding step of a 2-layer random Qwen2 of the same hidden size, MLP, heads and
    vocabulary, timed (best of ``repeats``), the per-layer host time subtracted, and divided by their FLOPs at
    ``hw.flops``.

    Runs on: the calling process, on CPUs (its thread count is the one measured; a second or two for models of a
    few million parameters, growing with the width). The large-matmul peak overstates what a small model's shapes
    reach, which is what these factors correct. With one torch thread the timings are the thread's CPU time (other
    jobs on the machine do not lower the factors); with more, wall time. Returns a new :class:`Hardware`; ``hw`` is
    unchanged.
    """

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_rlhf.cpu import CPULayer
    from lightning_rlhf.engines.rollout.base import SamplingParams

    layers = 2
    # Sized to take seconds whatever the model and workload: at most 512 positions, 1,024 tokens per micro-batch and
    # a 32,768-entry vocabulary (the factors are rates; the attention's share at longer lengths, and the head's at
    # larger vocabularies, are the cost model's own arithmetic).
    shape = dataclasses.replace(model, layers=layers, vocab=min(model.vocab, 32768))
    prompt_len = max(1, min(wl.prompt_len, 256))
    response_len = max(1, min(wl.response_len, 512 - prompt_len))
    wl = Workload(
        prompts=wl.prompts, n=wl.n, prompt_len=prompt_len, response_len=response_len,
        micro_tokens=min(wl.micro_tokens, 1024),
    )  # fmt: skip
    head_dim = model.hidden // model.heads
    config = Qwen2Config(
        vocab_size=shape.vocab, hidden_size=model.hidden, intermediate_size=model.intermediate,
        num_hidden_layers=layers, num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
        max_position_embeddings=wl.prompt_len + wl.response_len + 1, tie_word_embeddings=False,
    )  # fmt: skip
    config.head_dim = head_dim
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    net = Qwen2ForCausalLM(config)
    length = wl.prompt_len + wl.response_len
    rows = max(1, wl.micro_tokens // length)
    ids = torch.randint(0, shape.vocab, (rows, length))
    sub = Workload(prompts=rows, n=1, prompt_len=wl.prompt_len, response_len=wl.response_len)

    def train() -> None:
        net.train()
        net(input_ids=ids, labels=ids).loss.backward()
        net.zero_grad(set_to_none=True)

    def forward() -> None:
        with torch.no_grad():
            net.eval()(input_ids=ids)

    batch = max(1, min(64, wl.sequences))
    steps = min(16, wl.response_len)
    params = SamplingParams(n=1, max_new_tokens=steps, min_new_tokens=steps)
    prompts = [[int(t) for t in ids[0, : min(8, wl.prompt_len)]]] * batch  # a short context: the weights dominate

    def decode() -> None:
        CPULayer().decode_loop().sample_loop(
            net.eval(), prompts, params, stops=set(), pad_token_id=0, device=torch.device("cpu")
        )

    # One thread: its CPU time is what the work takes with a core to itself, whatever else runs on the machine.
    # Several: wall time (CPU time would count every thread's share, and their waits).
    timer = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    t_train = _best_of(train, repeats, timer) - layers * hw.layer_micro_s
    t_forward = _best_of(forward, repeats, timer) - layers * hw.layer_micro_s / 3
    t_step = _best_of(decode, repeats, timer) / steps - layers * hw.layer_step_s
    train_flops = 6.0 * shape.matmul_params * sub.tokens + 3 * _attention_flops(shape, sub)
    forward_flops = 2.0 * shape.matmul_params * sub.tokens + _attention_flops(shape, sub)
    step_flops = 2.0 * shape.matmul_params * batch
    return dataclasses.replace(
        hw,
        train_eff=min(1.0, train_flops / (max(t_train, 1e-9) * hw.flops)),
        forward_eff=min(1.0, forward_flops / (max(t_forward, 1e-9) * hw.flops)),
        decode_eff=min(1.0, step_flops / (max(t_step, 1e-9) * hw.flops)),
    )


def fit_call_costs(
    hw: Hardware,
    model: ModelShape,
    wl: Workload,
    devices: int,
    *,
    forward_s: Sequence[float],
    train_s: Sequence[float],
) -> Hardware:
    """``hw`` with ``call_s`` and ``train_call_s`` fitted to a measured run: the median time each no-grad forward
    call (``forward_s``) and each training call (``train_s``) took beyond what the cost model gives its compute,
    all calls of the run on one pool of ``devices``.

    Runs on: any process (arithmetic). The calibration step of ``benchmarks/placement_validation.py``: it fits on a
    colocated run and predicts the other placements. On oversubscribed CPU cores (:func:`core_share` of the
    ``devices`` busy processes below 1) the measured times are scaled back to a process with its cores to itself,
    as :func:`predict` scales them up. Returns a new :class:`Hardware`; the costs are never negative.
    """
    import statistics

    bare = dataclasses.replace(hw, call_s=0.0, train_call_s=0.0)
    forward = _forward_s(model, wl, bare, devices)
    train = _train_s(model, wl, bare, devices)
    share = core_share(cores=hw.cores, processes=devices, threads=hw.threads)
    call_s = max(0.0, statistics.median(t * share - forward for t in forward_s)) if forward_s else hw.call_s
    extra = max(0.0, statistics.median(t * share - train for t in train_s) - call_s) if train_s else hw.train_call_s
    return dataclasses.replace(hw, call_s=call_s, train_call_s=extra)


CALL_COSTS_FILE = "placement_call_costs.json"
"""The file, in the embedded models' cache folder, where a calibration run (``benchmarks/placement_validation.py``)
leaves the call costs it fitted, for ``plan --device-type cpu`` and ``placement="auto"`` on the same machine."""


def _call_costs_key(model: ModelShape, processes: int) -> str:
    from lightning_rlhf.perf import cpu_model_name

    return (
        f"{cpu_model_name()} | processes={processes} | {model.layers}x{model.hidden}x{model.intermediate}x{model.vocab}"
    )


def save_call_costs(hw: Hardware, model: ModelShape, processes: int, *, cache_dir: str | None = None) -> str:
    """Keep ``hw``'s fitted ``call_s`` and ``train_call_s`` for ``model`` on this CPU with ``processes`` ranks; returns
    the file. Runs on: the calibration run's driver."""
    import os

    from lightning_rlhf.config.models import embedded_cache_dir
    from lightning_rlhf.perf import read_json, write_json

    path = os.path.join(cache_dir or embedded_cache_dir(), CALL_COSTS_FILE)
    table = read_json(path)
    table[_call_costs_key(model, processes)] = {"call_s": hw.call_s, "train_call_s": hw.train_call_s}
    write_json(path, table)
    return path


def with_saved_call_costs(hw: Hardware, model: ModelShape, processes: int, *, cache_dir: str | None = None) -> Hardware:
    """``hw`` with the call costs a calibration run left for ``model`` on this CPU with ``processes`` ranks, if it
    left any (else ``hw`` as it is). Runs on: the planning process (``plan --device-type cpu``, ``"auto"``)."""
    import os

    from lightning_rlhf.config.models import embedded_cache_dir
    from lightning_rlhf.perf import read_json

    entry = read_json(os.path.join(cache_dir or embedded_cache_dir(), CALL_COSTS_FILE)).get(
        _call_costs_key(model, processes)
    )
    if not isinstance(entry, dict):
        return hw
    return dataclasses.replace(
        hw, call_s=float(entry.get("call_s", hw.call_s)), train_call_s=float(entry.get("train_call_s", 0.0))
    )


def measure_call_overhead(rows: int = 64, length: int = 48, repeats: int = 5) -> float:
    """Seconds of host work one role call costs besides its compute, on this machine: what the control plane does to
    a rollout batch of ``rows`` x ``length`` tokens for 2 ranks (split it, pickle each part and unpickle it, as the
    scatter does; pickle and unpickle the results, as the gather does; merge them), best of ``repeats``.

    Runs on: the calling process (a fraction of a second). Timed in the calling thread's CPU time (the work is
    Python on one thread), so other jobs on the machine do not inflate it. The transport itself (gloo over shared
    memory) is not in it: the validation in ``benchmarks/placement_validation.py`` shows what that leaves out.
    """
    import pickle

    import torch

    from lightning_rlhf.batch import Batch
    from lightning_rlhf.controller.dispatch import Dispatch, merge_results, split_args

    def one_batch() -> Batch:
        return Batch(
            {
                "input_ids": torch.randint(0, 4096, (rows, length)),
                "attention_mask": torch.ones(rows, length, dtype=torch.long),
                "prompt_mask": torch.ones(rows, length // 3, dtype=torch.bool),
                "response_mask": torch.ones(rows, length - length // 3, dtype=torch.bool),
                "logprobs": torch.randn(rows, length - length // 3),
                "scores": torch.rand(rows),
            },
            {"prompt": [f"Add {i} and {i}. Answer:" for i in range(rows)], "answer": [str(i) for i in range(rows)]},
        )

    def call() -> None:
        parts = split_args(Dispatch.DP_SPLIT, (one_batch(),), {}, 2, where="calibration")
        results = [pickle.loads(pickle.dumps(part))[0][0] for part in parts if part is not None]
        merge_results(Dispatch.DP_SPLIT, [pickle.loads(pickle.dumps(r)) for r in results])

    return _best_of(call, repeats, timer=time.thread_time)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``lightning-rlhf plan --config RECIPE --devices N --device-type TYPE [--model-shape S] [--rollout E]``: print
    the fastest placement of the recipe's roles, the predicted time of each stage and, as the last line, one JSON
    object (``placement``, ``parallel``, ``predicted_step_s``, ...). Returns that object.

    Runs on: one process; loads no model. ``--device-type`` takes any case (``H100``). ``--device-type cpu``
    calibrates on this machine: the matmul peak of one process with the threads Lightning gives each of
    ``--devices`` processes, the memory bandwidth, the host time per layer and per role call, what the actor's
    shapes reach of the peak (:func:`calibrate_for_shape`), and the cores the processes share
    (:func:`~lightning_rlhf.perf.available_cores`): a stage whose busy processes need more cores than there are
    runs proportionally slower (:func:`core_share`).
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="lightning-rlhf plan", description=main.__doc__.splitlines()[0] if main.__doc__ else None
    )
    parser.add_argument("--config", required=True, help="an RLHF recipe (YAML)")
    parser.add_argument("--devices", type=int, required=True, help="devices (GPUs, or CPU processes) to plan for")
    parser.add_argument(
        "--device-type", required=True, type=str.lower, choices=[*HARDWARE, "cpu"], help="any case (H100 or h100)"
    )
    parser.add_argument("--model-shape", choices=sorted(MODELS), help="plan for this shape instead of the actor's")
    parser.add_argument("--tp-sizes", default="1,2,4,8", help="rollout tensor-parallel sizes to consider")
    parser.add_argument(
        "--rollout",
        choices=["vllm", "hf"],
        default="vllm",
        help="the rollout engine: vllm (an actor on part of the devices pays its engine servers' hand-off copies "
        "and memory) or hf",
    )
    args = parser.parse_args(argv)
    if args.devices < 1:
        parser.error(f"--devices {args.devices}: expected at least 1")
    flow, shape, workload = recipe_inputs(args.config, model_shape=args.model_shape)
    if args.device_type == "cpu":
        import os

        import torch

        from lightning_rlhf.perf import available_cores, cpu_matmul_peak, threads_per_process

        cores = available_cores()
        threads = threads_per_process(args.devices)  # what Lightning gives each process of the run
        torch.set_num_threads(threads)
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        layer_step_s, layer_micro_s = measure_host_overheads()
        hardware = cpu_hardware(
            flops=cpu_matmul_peak(torch.float32), memcpy_bw=measure_memcpy_bw(), memory=total / args.devices,
            processes=args.devices, layer_step_s=layer_step_s, layer_micro_s=layer_micro_s,
            call_s=measure_call_overhead(), cores=cores, threads=threads,
        )  # fmt: skip
        hardware = with_saved_call_costs(calibrate_for_shape(hardware, shape, workload), shape, args.devices)
        share = core_share(cores=cores, processes=args.devices, threads=threads)
        print(
            f"cpu: {cores:g} cores for {args.devices} processes of {threads} thread(s): each gets {share:.2f} of its "
            "compute while every process is busy"
        )
    else:
        hardware = hardware_for(args.device_type)
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    # CPU processes are split one by one, as placement="auto" does: the machine is one "node" of all of them, and
    # whole-node pools would leave colocation as the only choice.
    unit = 1 if args.device_type == "cpu" else None
    best = plan(
        model=shape, hardware=hardware, devices=args.devices, workload=workload, algorithm=flow, tp_sizes=tp_sizes,
        unit=unit, engine_servers=args.rollout == "vllm",
    )  # fmt: skip
    tokens = f"{workload.prompt_len} + {workload.response_len} tokens"
    print(
        f"{args.config}: {shape.params / 1e9:.2f}B parameters, {workload.sequences} sequences of {tokens} per step, "
        f"{args.devices} x {hardware.name}"
    )
    for i, (group, n) in enumerate(zip(best.groups, best.devices, strict=True)):
        print(f"  pool {i}: {n} devices, {', '.join(group)} (peak {best.memory[i] / GB:.2f} GB per device)")
    for stage, seconds in zip(flow, best.stage_s, strict=True):
        print(f"  stage {' + '.join(f'{role}.{kind}' for role, kind in stage)}: {seconds:.3f} s")
    out = best.to_json() | {"devices": args.devices, "device_type": hardware.name}
    print(f"  predicted step: {best.step_s:.3f} s (rollout TP {best.rollout_tp})")
    print(json.dumps(out))
    return out
