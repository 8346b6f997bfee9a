"""Rollouts on a transformers model: the reference engine, and the one used where vLLM is absent.

Each rank keeps an unsharded copy of the actor, refreshed after every actor update (``load_weights``), and generates
for its own prompts without any collective. On a CPU, Llama-family models are sampled with the CPU layer's own loop
(``decode_loop``, :mod:`lightning_rlhf.cpu.decode`, 2-3x faster than ``generate`` on small models), anything else
with transformers' ``generate`` (``RolloutConfig.decode`` forces one). Only :class:`SamplingParams` decide what is
sampled (the copy's ``generation_config`` is reset), and the engine reports each sampled token's log-prob
(:func:`~lightning_rlhf.engines.rollout.base.processed_logprobs`), as vLLM does.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from lightning_rlhf.data.vision import VisionInputs
from lightning_rlhf.engines.rollout.base import (
    WEIGHTS,
    EngineAbilities,
    HandoffCheck,
    RolloutOutput,
    RowRanges,
    SamplingParams,
    WeightSyncError,
    check_sequence_length,
    processed_logprobs,
    tensor_fingerprints,
    tied_aliases,
    wake_tags,
)
from lightning_rlhf.engines.rollout.hf_requests import HFRequestQueue
from lightning_rlhf.engines.train.vision import vision_kwargs

if TYPE_CHECKING:
    from lightning_rlhf.engines.device_layer import DecodeLoop
    from lightning_rlhf.engines.rollout.reshard import Slicer

__all__ = ["DECODE_CHOICES", "HFRolloutEngine", "check_hf_settings", "left_pad", "model_max_length"]

DECODE_CHOICES = ("auto", "loop", "generate")
"""How the engine samples (``HFRolloutEngine(decode=...)``, ``RolloutConfig.decode``)."""


def model_max_length(config: Any) -> int | None:
    """Longest sequence a transformers model's positions cover (``max_position_embeddings``, or GPT-2's
    ``n_positions``); None when the config states none. Runs on: any process."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(positions) if positions else None


def check_hf_settings(model_path: str, *, max_prompt_length: int | None, max_new_tokens: int) -> int | None:
    """Check that prompts of ``max_prompt_length`` tokens plus ``max_new_tokens`` fit the model's positions, reading
    only its config; returns the model's length limit (None: the config states none, nothing is checked).

    Runs on: every process, at set-up. Raises ``ValueError`` naming the settings to change.
    """
    from transformers import AutoConfig

    limit = model_max_length(AutoConfig.from_pretrained(model_path))
    if limit is not None and max_prompt_length is not None:
        check_sequence_length(
            prompt_length=max_prompt_length,
            max_new_tokens=max_new_tokens,
            limit=limit,
            engine="the model's max_position_embeddings",
            prompt_setting=f"up to max_prompt_length={max_prompt_length}",
        )
    return limit


def left_pad(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(ids, mask)``, both ``[prompts, longest]``: each prompt right-aligned after ``pad`` ids, the boolean mask
    True on its tokens. Runs on: worker (both of the transformers engine's sampling paths)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = True
    return ids.to(device), mask.to(device)


class HFRolloutEngine:
    """Rollout engine on a deep copy of a transformers causal LM ``model`` (the actor before sharding). A model
    whose parameters are on the meta device gives a copy with empty storage on ``device`` (rotary frequencies
    recomputed, tied weights tied) that reports ``weights_discarded=True`` until the first complete hand-off. Runs on:
    every worker rank.

    Args:
        dtype: dtype of the engine's copy (the training compute dtype); None keeps the actor's.
        decode: ``"auto"`` samples with ``decode_loop`` on a CPU where the loop knows the model, else with
            transformers' ``generate``; ``"loop"`` always uses the loop; ``"generate"`` always uses ``generate``.
        decode_loop: the device layer's sampling loop (None: ``generate`` only).

    Raises:
        ValueError: an unknown ``decode``, or ``"loop"`` for a model the loop does not know (or without a loop).
    """

    tp_size: int = 1
    tp_rank: int = 0
    slicer: Slicer | None = None
    offload_optimizer: bool = False
    """Only the vLLM engine, which reserves a KV cache, asks for the optimizer state's offload."""

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_token_id: int,
        eos_token_id: int,
        device: torch.device,
        generation_batch_size: int = 64,
        dtype: torch.dtype | None = None,
        decode: str = "auto",
        decode_loop: DecodeLoop | None = None,
    ) -> None:
        if decode not in DECODE_CHOICES:
            raise ValueError(
                f"HFRolloutEngine(decode={decode!r}) is invalid: expected one of {list(DECODE_CHOICES)}. HINT: set "
                "RolloutConfig.decode to 'auto' (the own loop on CPU, generate on a GPU), 'loop' or 'generate'."
            )
        if decode == "loop":
            why = "no decoding loop was given" if decode_loop is None else None
            why = why or decode_loop.decode_loop_unsupported(model, max_length=0)  # type: ignore[union-attr]
            if why is not None:
                raise ValueError(
                    f"RolloutConfig.decode='loop' but the transformers engine's decoding loop cannot run this model: "
                    f"{why}. HINT: RolloutConfig.decode='auto' (or 'generate') samples it with transformers' "
                    "generate; the loop is the CPU layer's (a CPU run, or RLHFStrategy(cpu_kernels=True))."
                )
        on_meta = any(p.is_meta for p in model.parameters())
        engine_model: Any = copy.deepcopy(model)
        if on_meta:
            _materialize(engine_model, device)
        engine_model = engine_model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        # Only SamplingParams decide what is sampled (the model's generation_config.json would fill in the
        # settings left unset: repetition penalties, bad words, ...).
        engine_model.generation_config = GenerationConfig(
            bos_token_id=getattr(engine_model.config, "bos_token_id", None),
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        self.model: Any = engine_model
        self.max_length = model_max_length(self.model.config)  # None: unknown, not checked
        self._params = dict(self.model.named_parameters())
        self._check = HandoffCheck(type(self).__name__, self._params, tied_aliases(self.model))
        self.param_names: list[str] = list(self._params)
        self.dtype: torch.dtype = next(iter(self._params.values())).dtype
        self.weights_discarded = on_meta
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.device = torch.device(device)
        self.generation_batch_size = generation_batch_size
        self.decode = decode
        self.loop = decode_loop
        self._bound_to: dict[str, Tensor] | None = None  # what bind_weights bound the parameters to (None: own)
        self._pasts: dict[Hashable, Any] = {}  # the decoding loop's kept sequences (sample's keep_as), by session
        self._requests = HFRequestQueue(self)

    def decodes_with_loop(self, prompts: list[list[int]], params: SamplingParams) -> bool:
        """Whether :meth:`generate` samples these prompts with the engine's own loop rather than transformers'
        ``generate``: ``decode="auto"`` on a CPU, or ``"loop"``, where the loop supports the model (``"loop"`` raises
        where it does not); never with ``"generate"``, or for an empty prompt. Runs on: worker."""
        if self.loop is None or self.decode == "generate" or (self.decode == "auto" and self.device.type != "cpu"):
            return False
        if not prompts or any(not p for p in prompts):
            return False
        longest = max(len(p) for p in prompts) + params.max_new_tokens
        why = self.loop.decode_loop_unsupported(self.model, max_length=longest)
        if why is not None and self.decode == "loop":
            raise ValueError(
                f"RolloutConfig.decode='loop' but the decoding loop cannot sample these prompts: {why}. HINT: "
                "RolloutConfig.decode='auto' falls back to transformers' generate."
            )
        return why is None

    @property
    def abilities(self) -> EngineAbilities:
        """Requests interrupted between decoding steps, each weight copied as it arrives, and on CPU weights bound to a
        store the host's engines share (:meth:`bind_weights`). Runs on: worker."""
        return EngineAbilities(interrupts=True, copies_each_weight=True, binds_shared_weights=self.device.type == "cpu")

    @property
    def context_length(self) -> int | None:
        """The model's positions (None: its config states none). Runs on: worker."""
        return self.max_length

    @property
    def requests(self) -> HFRequestQueue:
        """The engine's requests: a session's next turn runs only its new tokens through the decoding loop (its keys
        and values kept between turns, as vLLM's prefix cache does), and a request that ends is handed on while the
        others still decode (:class:`~lightning_rlhf.engines.rollout.hf_requests.HFRequestQueue`). Runs on: worker."""
        return self._requests

    def drop_sessions(self, sessions: Iterable[Hashable] | None = None) -> None:
        """Drop the kept sequences of ``sessions`` (None: all of them). Runs on: worker."""
        if sessions is None:
            self._pasts.clear()
        for key in sessions or ():
            self._pasts.pop(key, None)

    def agree(self, calls: int, busy: bool) -> tuple[int, bool]:
        """One rank per engine: its own ``(calls, busy)`` (``RolloutEngine.agree``). Runs on: worker."""
        return calls, busy

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, vision: Sequence[VisionInputs | None] | None = None
    ) -> RolloutOutput:
        """Sample ``params.n`` responses per prompt (greedy: one, repeated ``n`` times); ``vision``: each prompt's
        images (transformers' ``generate`` then samples them). Runs on: worker."""
        return self.sample(prompts, params, vision=vision)

    def sample(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        continues: Sequence[Hashable | None] | None = None,
        keep_as: Sequence[Hashable] | None = None,
        limits: Sequence[int] | None = None,
        on_done: Callable[[int, list[int], list[float]], None] | None = None,
        stop: Callable[[], bool] | None = None,
        vision: Sequence[VisionInputs | None] | None = None,
    ) -> RolloutOutput:
        """:meth:`generate` with what the engine's request queue asks of it. Runs on: worker.

        With the decoding loop only: ``continues`` (a key per prompt, or None) names a sequence kept by an earlier call
        that the prompt goes on from (only its new tokens run; each kept sequence serves once), ``keep_as`` (a key per
        response) keeps each response's sequence for a later call, and ``on_done(index, response, logprobs)`` gets
        each response the loop stopped before ``max_new_tokens`` while the others still decode. ``limits``: each
        prompt's own bound on its responses' tokens (at most ``params.max_new_tokens``), so that prompts near the end
        of the model's context share a call with the others. ``stop``: asked between decoding steps (either path); True
        ends the call there, each response not ended by then holding the tokens it has so far.
        """
        params.check()
        if limits is not None:
            limits = [min(b, params.max_new_tokens) for b in limits]
            if not self.decodes_with_loop(prompts, params):  # transformers' generate: one bound a call
                return self._by_limit(prompts, params, limits, stop)
        bounds = [params.max_new_tokens] * len(prompts) if limits is None else list(limits)
        self._check_can_generate(prompts, bounds)
        stops = {self.eos_token_id, *params.stop_token_ids}
        copies = params.n if params.is_greedy else 1
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        devices = [self.device] if self.device.type == "cuda" else []
        has_images = vision is not None and any(v is not None for v in vision)
        loop = not has_images and self.decodes_with_loop(prompts, params)  # the loop knows text models only
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            # On a CPU device only the CPU generator draws: `torch.manual_seed` would also queue a CUDA seeding with
            # a captured stack (`torch.cuda._lazy_call`) on every call, 3% of a tool episode's generation.
            seed = torch.manual_seed if devices else torch.random.default_generator.manual_seed
            seed(params.seed)
            for start in range(0, len(prompts), self.generation_batch_size):
                chunk = prompts[start : start + self.generation_batch_size]
                if stop is not None and stop():  # interrupted before this chunk began: no tokens
                    responses += [[] for _ in range(len(chunk) * params.n)]
                    logprobs += [[] for _ in range(len(chunk) * params.n)]
                    continue
                if loop:
                    pasts = None if continues is None else [
                        None if key is None else self._pasts.pop(key, None)
                        for key in continues[start : start + len(chunk)]
                    ]  # fmt: skip
                    kept: list[Any] | None = None if keep_as is None else []
                    report = None if on_done is None else _reporter(on_done, start, params.n, copies, bounds, stops)
                    assert self.loop is not None
                    generated, token_lps = self.loop.sample_loop(
                        self.model, chunk, params, stops=stops, pad_token_id=self.pad_token_id, device=self.device,
                        pasts=pasts, keep=kept, limits=None if limits is None else bounds[start : start + len(chunk)],
                        finished=report, stop=stop,
                    )  # fmt: skip
                    if kept is not None and keep_as is not None:  # n responses a prompt (greedy: one, copied)
                        keys = keep_as[start * params.n : (start + len(chunk)) * params.n]
                        repeated = [past for past in kept for _ in range(copies)]
                        self._pasts.update(zip(keys, repeated, strict=True))
                else:
                    images = None if vision is None else vision[start : start + len(chunk)]
                    generated, token_lps = self._sample_with_generate(chunk, params, stops, stop, images)
                rows = range(len(generated))
                for _, response, lps in _responses(rows, generated, token_lps, start, params.n, copies, bounds, stops):
                    responses.append(response)
                    logprobs.append(lps)
        return RolloutOutput(responses=responses, logprobs=logprobs)

    def _check_can_generate(self, prompts: list[list[int]], bounds: list[int]) -> None:
        """Refuse to generate without valid weights, or for a prompt whose own bound on new tokens (``bounds``, one
        per prompt) reaches past the model's positions."""
        if self.weights_discarded:
            raise WeightSyncError(
                "HFRolloutEngine.generate: the engine holds no valid weights (it was built from a meta-device "
                "model, or the last hand-off failed). HINT: hand the actor's weights over first "
                "(`engine.load_weights(weights_for(engine, model))`, which ActorRole.sync_weights does)."
            )
        longest, bound = max(((len(p), b) for p, b in zip(prompts, bounds, strict=True)), key=sum, default=(0, 0))
        if self.max_length is not None:  # the prompt that reaches furthest decides
            check_sequence_length(
                prompt_length=longest,
                max_new_tokens=bound,
                limit=self.max_length,
                engine="the model's max_position_embeddings",
                prompt_setting=f"{longest}",
            )

    def _sample_with_generate(
        self,
        chunk: list[list[int]],
        params: SamplingParams,
        stops: set[int],
        stop: Callable[[], bool] | None = None,
        vision: Sequence[VisionInputs | None] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Sample ``chunk``'s responses with transformers' ``generate`` (inside :meth:`generate`'s seeded RNG):
        the tokens ``[rows, steps]`` (junk after a row's stop) and their log-probs."""
        greedy = params.is_greedy
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,  # unused when greedy (the defaults fill them)
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else params.top_k,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens or None,
            num_return_sequences=1 if greedy else params.n,
            eos_token_id=sorted(stops),
            pad_token_id=self.pad_token_id,
        )
        ids, mask = left_pad(chunk, self.pad_token_id, self.device)
        recorder = _TokenLogprobs(params)
        extra = vision_kwargs(self.model.config, ids, vision)
        out = self.model.generate(
            input_ids=extra.pop("input_ids", ids),
            attention_mask=mask.long(),
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder]),
            stopping_criteria=StoppingCriteriaList([_Interrupt(stop)] if stop is not None else []),
            **extra,
        )
        generated = out[:, ids.shape[1] :]
        return generated, recorder.result(generated)

    def _by_limit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        limits: Sequence[int],
        stop: Callable[[], bool] | None = None,
    ) -> RolloutOutput:
        """:meth:`generate` with a bound per prompt on transformers' ``generate`` path: one call per distinct bound,
        the responses put back in the prompts' order."""
        n = params.n
        responses: list[list[int]] = [[] for _ in range(len(prompts) * n)]
        logprobs: list[list[float]] = [[] for _ in range(len(prompts) * n)]
        for bound in sorted(set(limits)):
            which = [i for i, b in enumerate(limits) if b == bound]
            out = self.sample([prompts[i] for i in which], dataclasses.replace(params, max_new_tokens=bound), stop=stop)
            lps = out.logprobs or [[] for _ in out.responses]
            for k, i in enumerate(which):
                responses[i * n : (i + 1) * n] = out.responses[k * n : (k + 1) * n]
                logprobs[i * n : (i + 1) * n] = lps[k * n : (k + 1) * n]
        return RolloutOutput(responses=responses, logprobs=logprobs)

    def bind_weights(self, tensors: dict[str, Tensor]) -> None:
        """Make every parameter's data ``tensors[name]`` (e.g. views of a store every engine of the host reads), so that
        the engine generates with whatever they hold from now on; the same dict as the last bind's is taken unchecked
        (the check costs 0.1 ms on the small vs-TRL model). Runs on: worker, after the tensors were written. Raises
        ``WeightSyncError`` for a missing name or a tensor of another shape or dtype."""
        self._pasts.clear()  # new weights: kept keys and values are the old model's
        if tensors is self._bound_to:
            self.weights_discarded = False
            return
        for name, param in self._params.items():  # every tensor checked before any parameter is bound
            tensor = tensors.get(name)
            if tensor is None or tensor.shape != param.shape or tensor.dtype != param.dtype:
                got = "nothing" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
                raise WeightSyncError(
                    f"HFRolloutEngine.bind_weights: {name!r} got {got}, the parameter is {tuple(param.shape)} "
                    f"{param.dtype}. HINT: full tensors of the engine's parameters in `engine.dtype`."
                )
        for name, param in self._params.items():
            tensor = tensors[name]
            if param.data_ptr() != tensor.data_ptr() or param.stride() != tensor.stride():
                param.data = tensor
        self._bound_to = tensors
        self.weights_discarded = False

    def _unbind(self) -> None:
        """Give bound parameters storage of their own again (a copy of what they hold), before writing into them."""
        if self._bound_to is None:
            return
        with torch.no_grad():
            for param in self._params.values():
                param.data = param.data.clone()
        self._bound_to = None

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """Copy new weights in by transformers name; returns the bytes received. Runs on: worker.

        Raises:
            WeightSyncError: an unknown or repeated name, a tensor of another shape than its parameter, or a
                parameter missing at the end (``weights_discarded`` then stays True until a complete hand-off).
        """
        received = 0
        self._pasts.clear()  # new weights: kept keys and values are the old model's
        self._unbind()  # shared with the host's other engines: this hand-off is this engine's own
        self.weights_discarded = True  # a hand-off that stops part-way leaves a mix of old and new weights
        check = self._check
        check.begin()
        with torch.no_grad():
            for name, tensor in weights:
                canonical = check.take(name)
                if canonical is None:  # a tied alias of a parameter already loaded in this hand-off
                    continue
                param = self._params[canonical]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise WeightSyncError(
                        f"HFRolloutEngine.load_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's "
                        f"parameter {tuple(param.shape)}. HINT: hand over full (unsharded) tensors of the model the "
                        "engine was built from (`weights_for(engine, model)` gathers FSDP shards)."
                    )
                param.copy_(tensor)
                received += tensor.numel() * tensor.element_size()
        check.finish()
        self.weights_discarded = False
        return received

    fingerprint_rtol: float = 1e-9
    """Float64 sums of the values the engine holds: equal to the trainer's up to the order of summation."""

    def fingerprint(self, ranges: Mapping[str, RowRanges]) -> dict[str, Tensor]:
        """The float64 sums of those rows of each parameter as the engine holds it (its own copy, or the shared store
        it is bound to): :func:`~lightning_rlhf.engines.rollout.base.tensor_fingerprints`. Runs on: worker, after a
        hand-off."""
        with torch.no_grad():
            return tensor_fingerprints(self._params, ranges)

    def sleep(self) -> None:
        """Move the weights to host memory on a GPU; nothing to free on CPU. Runs on: worker."""
        if self.device.type != "cpu":
            self.model.to("cpu")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring the weights back to the device when ``tags`` names ``"weights"`` (or is None); ``"kv_cache"`` wakes
        nothing (each ``generate`` allocates its own). Runs on: worker. Raises ``ValueError`` for a tag not in
        ``MEMORY_TAGS``."""
        if WEIGHTS in wake_tags(tags, owner=type(self).__name__) and self.device.type != "cpu":
            self.model.to(self.device)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give a model whose parameters are on the meta device empty storage on ``device``, in place: parameters
    hold garbage until the first hand-off; tied parameters are tied again (``to_empty`` makes one tensor per
    registration); buffers that held values keep them, meta buffers are recomputed by the model's own
    initialisation (transformers' ``_init_weights``: rotary frequencies). Runs on: every worker rank (engine
    construction). Raises ``ValueError`` for a meta buffer nothing can recompute."""
    aliases = tied_aliases(model)
    kept = {name: buf for name, buf in model.named_buffers() if not buf.is_meta}
    owners = {name.rpartition(".")[0] for name, buf in model.named_buffers() if buf.is_meta}
    init = getattr(model, "_init_weights", None)
    if owners and init is None:
        meta = sorted(name for name, buf in model.named_buffers() if buf.is_meta)
        raise ValueError(
            f"HFRolloutEngine cannot build from this model: its buffers {meta} are on the meta device and "
            f"{type(model).__name__} has no `_init_weights` to recompute them. HINT: build the model with only its "
            "parameters on meta (buffers on a real device), or pass a model with real weights."
        )
    model.to_empty(device=device)
    for alias, canonical in aliases.items():
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(canonical))
    with torch.no_grad():
        for name, value in kept.items():
            model.get_buffer(name).copy_(value)
        for owner in sorted(owners):
            assert init is not None
            init(model.get_submodule(owner))


def _responses(
    rows: Iterable[int],
    tokens: Tensor,
    logprobs: Tensor,
    start: int,
    n: int,
    copies: int,
    bounds: list[int],
    stops: set[int],
) -> Iterator[tuple[int, list[int], list[float]]]:
    """``(index, response, log-probs)`` of sampled rows ``rows`` of the chunk of prompts from ``start`` (``tokens``/
    ``logprobs``: a row each): each cut at its prompt's bound and its first stop token, under its index in the call's
    responses (``copies`` indices when greedy decoding sampled one row for ``n`` responses)."""
    per = 1 if copies > 1 else n  # sampled rows a prompt
    for row, ids, lps in zip(rows, tokens.tolist(), logprobs.float().cpu().tolist(), strict=True):
        response = _cut_at_stop(ids[: bounds[start + row // per]], stops)
        for c in range(copies):
            yield (start * per + row) * copies + c, list(response), lps[: len(response)]


def _reporter(
    on_done: Callable[[int, list[int], list[float]], None],
    start: int,
    n: int,
    copies: int,
    bounds: list[int],
    stops: set[int],
) -> Callable[[list[int], Tensor, Tensor], None]:
    """The decoding loop's ``finished`` for the chunk of prompts from ``start``: each stopped row's response, as
    :meth:`HFRolloutEngine.generate` returns it, handed to ``on_done`` under its index."""

    def finished(rows: list[int], tokens: Tensor, logprobs: Tensor) -> None:
        for index, response, lps in _responses(rows, tokens, logprobs, start, n, copies, bounds, stops):
            on_done(index, response, lps)

    return finished


def _cut_at_stop(row: list[int], stops: set[int]) -> list[int]:
    """Keep tokens up to and including the first stop token (the rest is padding)."""
    return next((row[: i + 1] for i, tok in enumerate(row) if tok in stops), row)


class _TokenLogprobs(LogitsProcessor):
    """Records the engine's log-prob of every generated token while ``generate`` runs (at step ``t`` the token chosen
    at ``t - 1`` is the last input id). It runs on the raw logits, before transformers' warpers (the engine's
    ``generation_config`` adds no other processor), and applies them itself (:func:`processed_logprobs`)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._last: Tensor | None = None
        self._picked: list[Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._last is not None:
            self._picked.append(self._last.gather(1, input_ids[:, -1:]))
        p = self.params
        self._last = processed_logprobs(scores, temperature=p.sampling_temperature, top_k=p.top_k, top_p=p.top_p)
        return scores

    def result(self, generated: Tensor) -> Tensor:
        """``[rows, generated tokens]`` log-probs (padding after a stop token holds junk; callers cut it)."""
        if self._last is not None and len(self._picked) < generated.shape[1]:
            self._picked.append(self._last.gather(1, generated[:, len(self._picked) : len(self._picked) + 1]))
        if not self._picked:
            return torch.zeros(generated.shape, dtype=torch.float32)
        return torch.cat(self._picked, dim=1).float().cpu()


class _Interrupt(StoppingCriteria):
    """Ends transformers' ``generate`` for every row once ``stop()`` says so (an interrupted request)."""

    def __init__(self, stop: Callable[[], bool]) -> None:
        self.stop = stop

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.stop(), dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]
