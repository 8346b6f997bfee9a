"""Build the rollout engine a strategy asked for, from the actor it generates for: the one place that decides which
parameter names a complete hand-off contains (and their tied aliases) and the engine's dtype."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch
from torch import nn

from lightning_rlhf.config import RolloutConfig, VLLMConfig
from lightning_rlhf.engines.device_layer import PLAIN, DeviceLayer
from lightning_rlhf.engines.rollout.base import RolloutEngine, tied_aliases
from lightning_rlhf.engines.rollout.hf import HFRolloutEngine, check_hf_settings
from lightning_rlhf.engines.train.lora import has_lora, unadapted_copy

__all__ = ["ENGINE_KINDS", "RolloutEngineFactory", "make_rollout_engine"]

ENGINE_KINDS = ("hf", "vllm")
"""The engines :func:`make_rollout_engine` builds."""


def make_rollout_engine(
    kind: Literal["hf", "vllm"],
    *,
    path: str,
    model: nn.Module,
    tokenizer: Any,
    rollout: RolloutConfig,
    vllm: VLLMConfig,
    device: torch.device,
    dtype: torch.dtype | None,
    max_model_len: int,
    pool: Sequence[int] | None = None,
    rank: int = 0,
    world_size: int = 1,
    pool_group: Any = None,
    layer: DeviceLayer = PLAIN,
) -> RolloutEngine:
    """Build the rollout engine of one rank: ``"hf"`` (transformers on a copy of the actor) or ``"vllm"`` over
    ``model``, the unsharded actor (real weights, or meta-device parameters: the engine waits for the first hand-off).

    Runs on: every worker rank, at set-up, before the actor is sharded (all together: a vLLM engine joins the group).

    Args:
        dtype: the training compute dtype; None keeps the actor's (hf) or float32 (vLLM).
        max_model_len: the vLLM engine's length limit, from ``check_vllm_settings`` (unused for ``"hf"``).
        pool: the global ranks of the role that generates (None: every rank); a vLLM engine for a pool of part of
            the world runs in a server process (:mod:`~lightning_rlhf.engines.rollout.vllm_server`).

    Raises:
        ValueError: an unknown ``kind``, a tokenizer without padding or end-of-sequence id, or (vLLM) a
            ``max_model_len`` below 2; before any engine is built.
    """
    _check_request(kind, path, tokenizer, max_model_len)
    served = pool is not None and len(pool) < world_size
    lora_rank: int | None = None  # a colocated vLLM engine that takes the adapters themselves (lora_handoff)
    if has_lora(model):  # the engine serves the base model; the hand-off merges the adapters into its weights
        if kind == "vllm" and vllm.lora_handoff == "adapter" and not served and vllm.tensor_parallel_size == 1:
            lora_rank = int(model.peft_config["default"].r)  # type: ignore[index, union-attr]
        model = unadapted_copy(model)
    if kind == "vllm":
        hf_config: Any = getattr(model, "config", None)
        kwargs = {
            "param_names": [name for name, _ in model.named_parameters()],
            # a server's engine sends no TP slices: each server's vLLM loaders keep their own
            "config": dataclasses.replace(vllm, weight_transfer="full") if served else vllm,
            "dtype": dtype or torch.float32,
            "device": device,
            "max_model_len": max_model_len,
            "seed": rollout.seed,
            "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
            "hf_config": hf_config,
            "eos_token_id": tokenizer.eos_token_id,
            "tied_names": tied_aliases(model),
            "layer": layer,
        }
        if served:
            from lightning_rlhf.engines.rollout.vllm_server import VLLMServerEngine

            return VLLMServerEngine(
                path, engine_kwargs=kwargs, pool_group=pool_group, pool_rank=list(pool or ()).index(rank)
            )
        from lightning_rlhf.engines.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(path, **kwargs, lora_rank=lora_rank)
    return HFRolloutEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        device=device,
        generation_batch_size=rollout.generation_batch_size,
        dtype=dtype,
        decode=rollout.decode,
        decode_loop=layer.decode_loop(),
    )


def _check_request(kind: str, path: str, tokenizer: Any, max_model_len: int) -> None:
    """:func:`make_rollout_engine`'s "Raises": an unknown ``kind``, a tokenizer without the ids the engine needs,
    a vLLM ``max_model_len`` below 2."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"make_rollout_engine(kind={kind!r}) is not an engine. HINT: one of {list(ENGINE_KINDS)}.")
    for attr in ("pad_token_id", "eos_token_id") if kind == "hf" else ("eos_token_id",):
        if getattr(tokenizer, attr, None) is None:
            raise ValueError(
                f"make_rollout_engine: the tokenizer of {path!r} has {attr}=None, which the {kind} engine needs. "
                "HINT: set it on the tokenizer (e.g. `tokenizer.pad_token = tokenizer.eos_token`) before set-up."
            )
    if kind == "vllm" and max_model_len < 2:
        raise ValueError(
            f"make_rollout_engine(max_model_len={max_model_len}) is not a length the vLLM engine can serve. "
            "HINT: pass the value check_vllm_settings returned."
        )


class EngineRequest(Protocol):
    """What a generating role declares (``roles.base.RolloutEngineRequest``): its model, tokenizer and sampling."""

    path: str
    tokenizer: Any
    rollout: RolloutConfig


class RolloutEngineFactory:
    """The rollout engines of a run, as ``RLHFStrategy`` is handed them: :meth:`check` a role's request before any
    model loads, then build its engine (:func:`make_rollout_engine`) when the strategy calls the factory. ``kind``:
    ``"vllm"``, ``"hf"``, or ``"auto"`` (vLLM when a supported version is installed, else hf)."""

    def __init__(self, kind: Literal["auto", "hf", "vllm"], vllm: VLLMConfig) -> None:
        if kind == "auto":
            from lightning_rlhf.engines.rollout.vllm import vllm_available

            kind = "vllm" if vllm_available() else "hf"
        self.kind: Literal["hf", "vllm"] = kind
        self.vllm = vllm
        self.max_model_len = 0

    def check(
        self,
        request: EngineRequest,
        *,
        max_prompt_length: int | None,
        dtype: torch.dtype | None,
        device: torch.device,
        world_size: int,
        processes_per_node: int,
    ) -> None:
        """Fail on settings the engine cannot serve (prompt plus response beyond the model's positions; for vLLM,
        every setting it checks), before any model is loaded. Runs on: every rank, at set-up."""
        max_new_tokens = request.rollout.max_new_tokens
        if self.kind == "hf":
            check_hf_settings(request.path, max_prompt_length=max_prompt_length, max_new_tokens=max_new_tokens)
            return
        from lightning_rlhf.engines.rollout.vllm import check_vllm_settings

        self.max_model_len = check_vllm_settings(
            request.path,
            self.vllm,
            dtype=dtype or torch.float32,
            device_type=device.type,
            world_size=world_size,  # the engine's ranks
            max_prompt_length=max_prompt_length,
            max_new_tokens=max_new_tokens,
            processes_per_node=processes_per_node,
        )

    def __call__(self, request: EngineRequest, *, model: nn.Module, **where: Any) -> RolloutEngine:
        """This rank's engine for ``request`` over ``model``; ``where``: :func:`make_rollout_engine`'s ``device``,
        ``dtype``, ``pool``, ``rank``, ``world_size`` and ``pool_group``. Runs on: every rank of the role's pool."""
        return make_rollout_engine(
            self.kind,
            path=request.path,
            model=model,
            tokenizer=request.tokenizer,
            rollout=request.rollout,
            vllm=self.vllm,
            max_model_len=self.max_model_len,
            **where,
        )
