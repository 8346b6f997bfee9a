"""The rollout engine interface every generator implements, and the rules all engines share, so that sampling and
training agree on the distribution a response was drawn from (docs/hybrid-engine.md, "Sampling and training agree"):
the settings every engine serves unchanged (:func:`check_sampling`), greedy decoding at ``temperature=0`` scored at
temperature 1 (:func:`logprob_temperature`), the log-probs an engine reports (:func:`processed_logprobs`), the
memory tags (:data:`MEMORY_TAGS`, "Memory phases") and the checked hand-off (:class:`HandoffCheck` for the names,
:func:`check_fingerprints` for the values; "Every hand-off is checked").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from lightning_rlhf.config import MAX_TEMPERATURE, MIN_TEMPERATURE, check_sampling, check_sequence_length
from lightning_rlhf.data.vision import VisionInputs
from lightning_rlhf.engines.rollout.requests import RequestQueue, RolloutOutput, SamplingParams

__all__ = [
    "KV_CACHE",
    "MAX_TEMPERATURE",
    "MEMORY_TAGS",
    "MIN_TEMPERATURE",
    "WEIGHTS",
    "EngineAbilities",
    "Fingerprint",
    "HandoffCheck",
    "RolloutEngine",
    "RolloutOutput",
    "RowRanges",
    "SamplingParams",
    "Slicer",
    "TPSlice",
    "WeightSyncError",
    "as_rows",
    "check_fingerprints",
    "check_prompt_tokens",
    "check_sampling",
    "check_sequence_length",
    "fingerprint_ranges",
    "logprob_temperature",
    "part_sums",
    "processed_logprobs",
    "range_pieces",
    "tensor_fingerprints",
    "tied_aliases",
    "wake_tags",
]


WEIGHTS = "weights"
"""The memory tag of an engine's weights (vLLM's own name for it in ``LLM.wake_up(tags=...)``)."""
KV_CACHE = "kv_cache"
"""The memory tag of an engine's key/value cache (vLLM's own name for it)."""
MEMORY_TAGS: tuple[str, ...] = (WEIGHTS, KV_CACHE)
"""Every tag :meth:`RolloutEngine.wake_up` takes, in the order the actor wakes them."""


@dataclasses.dataclass(frozen=True)
class TPSlice:
    """The region ``[start, start + length)`` along ``dim`` of a full tensor."""

    dim: int
    start: int
    length: int


Slicer = Callable[[str, tuple[int, ...], int], TPSlice | None]
"""``(name, full shape, tp rank) -> region that rank loads`` (None: the whole tensor)."""


def wake_tags(tags: Sequence[str] | None, *, owner: str) -> tuple[str, ...]:
    """The memory tags a ``wake_up(tags)`` call names, checked: ``None`` is every tag (:data:`MEMORY_TAGS`); a
    single string is refused (it would read as its letters); ``owner`` (the engine) starts the error messages.

    Runs on: worker (each engine's ``wake_up``). Raises ``ValueError`` naming the unknown tags and the ones allowed.
    """
    if tags is None:
        return MEMORY_TAGS
    if isinstance(tags, str):
        raise ValueError(
            f"{owner}.wake_up(tags={tags!r}): expected a list of tags, got one string. HINT: wake_up(tags=[{tags!r}])."
        )
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(
            f"{owner}.wake_up(tags={list(tags)!r}): unknown memory tags {unknown}. HINT: tags out of "
            f"{list(MEMORY_TAGS)}, or None to wake everything."
        )
    return tuple(t for t in MEMORY_TAGS if t in tags)


def logprob_temperature(temperature: float) -> float:
    """The temperature log-probs are computed at for a rollout sampled at ``temperature``: the same one, except
    for greedy decoding (0), whose log-probs are those of the raw policy (temperature 1). Runs on: any process."""
    return float(temperature) if temperature > 0 else 1.0


def processed_logprobs(logits: Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Log-probabilities ``[..., V]`` of the distribution an engine samples from: ``logits`` divided by
    :func:`logprob_temperature`, then cut to the ``top_k`` most likely tokens, then to the smallest set whose
    mass reaches ``top_p`` (on the top-k-renormalised distribution), renormalised. Greedy (``temperature=0``)
    applies no cut. The same order and tie rules as vLLM's sampler and transformers' warpers. Runs on: worker.
    """
    logits = logits.float() / logprob_temperature(temperature)
    if temperature > 0 and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if temperature > 0 and top_p < 1:
        ascending, order = logits.sort(dim=-1)
        remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        remove[..., -1] = False  # the most likely token always stays
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), -math.inf)
    return torch.log_softmax(logits, dim=-1)


def check_prompt_tokens(prompts: list[list[int]], *, vocab_size: int | None, engine: str) -> None:
    """Refuse prompts an engine would fail on only inside its generation loop: an empty prompt, or a token id outside
    the model's vocabulary (``vocab_size`` rows; None: not checked). vLLM runs without a tokenizer, so it checks no
    prompt id: one past the embedding's rows reaches the lookup (on a GPU a device-side assert that ends the process).

    Runs on: worker (an engine's ``generate``, before any request reaches it). Raises ``ValueError`` naming the
    prompt, the id and the fix.
    """
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(
                f"{engine}.generate: prompt {i} of {len(prompts)} has no tokens; vLLM refuses an empty prompt. "
                "HINT: every prompt needs at least one token (a row whose prompt_mask is all 0 reached generation: "
                "check the dataflow that built the batch, or give the prompt a BOS/template token)."
            )
        if vocab_size is None:
            continue
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"{engine}.generate: prompt {i} holds token id {bad}, outside the model's vocabulary of {vocab_size} "
                "ids (the engine's embedding lookup would fail inside generation). HINT: tokenize with the "
                "tokenizer the model was saved with, or resize the model to the tokenizer "
                "(`model.resize_token_embeddings(len(tokenizer))`, then save it) before training."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineAbilities:
    """What a rollout engine offers beyond the members every :class:`RolloutEngine` has: each engine declares its own
    (``RolloutEngine.abilities``), and the callers read it instead of probing the engine for attributes. An ability
    left out is not offered (every field defaults to False)."""

    interrupts: bool = False
    """Its request queue's ``interrupt`` ends a running step at the next decoding step, each request keeping its
    tokens so far, so that new weights need not wait for the slowest requests (partial rollouts): the transformers
    engine, and vLLM's at TP 1 (in process or in an engine server)."""
    copies_each_weight: bool = False
    """``load_weights`` copies each tensor before it takes the next one from the stream, so ``weights_for`` may hand it
    views of a reused buffer (the transformers engine, the vLLM engine server)."""
    takes_adapters: bool = False
    """A LoRA actor hands over its adapters (``load_adapter``) rather than merged weights (vLLM built with
    ``lora_rank``)."""
    binds_shared_weights: bool = False
    """``bind_weights`` may give the engine's parameters memory it shares with the host's other engines (a device
    layer's ``weight_store``; ``weight_layout`` says how it is laid out): the transformers engine on CPU."""


class WeightSyncError(RuntimeError):
    """A weight hand-off into a rollout engine was incomplete or named parameters the engine does not have (the engine
    then reports ``weights_discarded=True`` and refuses to generate until a complete hand-off arrives), or the
    engine's fingerprints differ from the trainer's."""


RowRanges = list[tuple[int, int]]
"""Row ranges ``[start, stop)`` of a tensor seen as :func:`as_rows` (a tensor-parallel engine's: of its slice)."""
Fingerprint = tuple[RowRanges, Tensor]
"""The trainer's side of a verified hand-off, per tensor: the row ranges to sum, and their float64 sums followed by
the sums of their absolute values (what the comparison's tolerance scales with)."""


def as_rows(tensor: Tensor) -> Tensor:
    """``tensor`` as ``[rows, -1]`` (a 1-D tensor: one value a row; a scalar: one row). Runs on: any process."""
    return tensor.flatten(1) if tensor.dim() > 1 else tensor.reshape(-1, 1)


def fingerprint_ranges(start: int, stop: int, *, one_dim: bool) -> RowRanges:
    """The rows a fingerprint sums of the rows ``[start, stop)`` (a rank's share of a tensor): the first, the middle
    and the last one, and all of them for a tensor of one value a row (norms, biases). Runs on: any process."""
    if stop <= start:
        return []
    rows = sorted({start, (start + stop) // 2, stop - 1})
    return [(r, r + 1) for r in rows] + ([(start, stop)] if one_dim and stop - start > 1 else [])


def range_pieces(rows: Tensor, ranges: RowRanges, offset: int = 0) -> tuple[list[Tensor], list[int]]:
    """The values of row ranges ``ranges`` of ``rows`` (shifted by ``offset``) as flat pieces, and the length of each
    range's values, for :func:`part_sums`. Each piece is a row or a slice, a view of ``rows`` (no copy, no index tensor
    sent to the device: on a GPU a list index costs a host-to-device copy per tensor). Runs on: worker."""
    pieces = [rows[a + offset] if b - a == 1 else rows[a + offset : b + offset].reshape(-1) for a, b in ranges if b > a]
    return pieces, [(b - a) * rows.shape[1] for a, b in ranges if b > a]


def part_sums(
    pieces: list[Tensor], lengths: list[int], dtype: torch.dtype | None = None, *, with_scale: bool = False
) -> Tensor:
    """The float64 sums of consecutive runs of ``lengths`` values of the concatenated ``pieces`` (cast to ``dtype``
    first; then, ``with_scale``, the sums of their absolute values), in a few calls whatever their number. Runs on:
    worker."""
    if not pieces:
        return torch.zeros(len(lengths) * (2 if with_scale else 1), dtype=torch.float64)
    flat = torch.cat(pieces)
    flat = (flat if dtype is None else flat.to(dtype)).double()
    counts = torch.tensor(lengths, device=flat.device)
    sums = [torch.segment_reduce(flat, "sum", lengths=counts)]
    if with_scale:
        sums.append(torch.segment_reduce(flat.abs(), "sum", lengths=counts))
    return torch.cat(sums).cpu()


def tensor_fingerprints(tensors: Mapping[str, Tensor], ranges: Mapping[str, RowRanges]) -> dict[str, Tensor]:
    """Per name of ``ranges``, the float64 sums of those rows of ``tensors[name]`` (:func:`as_rows`), all summed in
    one pass: what an engine that holds its weights as tensors answers to ``fingerprint``. Runs on: worker."""
    pieces: list[Tensor] = []
    lengths: list[int] = []
    for name, rows in ranges.items():
        got = range_pieces(as_rows(tensors[name]), rows)
        pieces += got[0]
        lengths += got[1]
    sums = part_sums(pieces, lengths).split([len(rows) for rows in ranges.values()])
    return dict(zip(ranges, sums, strict=True))


def check_fingerprints(
    engine: str, expected: Mapping[str, Fingerprint], held: Mapping[str, Tensor], *, rtol: float, tp_rank: int = 0
) -> None:
    """Compare the trainer's fingerprints ``expected`` with the sums the engine reports for the same rows (``held``):
    each within ``rtol`` times the sum of the absolute values. Runs on: worker (after a hand-off).

    Raises:
        WeightSyncError: naming the first tensor (and TP rank) whose weights differ, or that the engine does not report.
    """
    where = f" on TP rank {tp_rank}" if tp_rank else ""
    names = [name for name, (rows, _) in expected.items() if rows]
    lost = next((n for n in names if held.get(n) is None or len(held[n]) != len(expected[n][0])), None)
    if lost is not None:
        raise WeightSyncError(
            f"{engine}: after the weight hand-off the engine{where} reports no weights for {lost!r} (it reports "
            f"{len(held)} tensors). HINT: the engine's `fingerprint()` must cover every name in `param_names`."
        )
    if not names:
        return
    counts = [len(expected[n][0]) for n in names]
    values = torch.cat([expected[n][1][:k] for n, k in zip(names, counts, strict=True)])
    scales = torch.cat([expected[n][1][k:] for n, k in zip(names, counts, strict=True)])
    have = torch.cat([held[n].double().cpu() for n in names])
    bad = ((have - values).abs() > rtol * scales + 1e-30).nonzero()
    if len(bad):
        name = names[int(torch.searchsorted(torch.tensor(counts).cumsum(0), bad[0, 0], right=True))]
        k = len(expected[name][0])
        raise WeightSyncError(
            f"{engine}: after the weight hand-off the engine{where} holds other values than the trainer in "
            f"{name!r}: the sums of its rows {expected[name][0]} are {held[name].tolist()}, the trainer's "
            f"{expected[name][1][:k].tolist()}. The hand-off dropped or corrupted this tensor, or the engine kept "
            "weights it was meant to replace (e.g. a sleep-mode wake that restored old ones). HINT: report it with the "
            "engine and its settings; RolloutConfig.verify_every=0 turns this check off."
        )


@functools.lru_cache(maxsize=16)
def generation_eos_ids(model_path: str) -> tuple[int, ...]:
    """The end-of-sequence ids of a checkpoint's ``generation_config.json`` (``eos_token_id``, one id or a list),
    or ``()`` when it has none. Instruct models often list more than their tokenizer's EOS (Qwen2.5-Instruct:
    ``<|im_end|>`` and ``<|endoftext|>``); transformers' ``generate`` and vLLM stop at each. Runs on: every worker
    rank holding a rollout engine (read once per path and process)."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's EOS alone
        return ()
    if eos is None:
        return ()
    return tuple(sorted({int(i) for i in ([eos] if isinstance(eos, int) else eos)}))


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Names under which ``model`` registers a parameter a second time (tied weights), mapped to the first name
    ``named_parameters()`` gives it, e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``. Runs on: any process
    (reads the module tree only; works on meta-device models)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


class HandoffCheck:
    """Counts the names of one weight hand-off (``engine``'s) against ``expected``, the parameters a complete one must
    contain; ``aliases`` (:func:`tied_aliases`) count as the parameter they alias: a parameter received under a
    second alias in the same hand-off is skipped, the same name twice is refused. A TP slice counts as its parameter.

    Runs on: every worker rank (inside an engine's ``load_weights``; every rank sees the same names in the same
    order, so every rank raises at the same point of a collective stream).
    """

    def __init__(self, engine: str, expected: Iterable[str], aliases: Mapping[str, str] | None = None) -> None:
        self.engine = engine
        self.expected: list[str] = list(expected)
        self._expected = set(self.expected)
        self.aliases = {a: c for a, c in (aliases or {}).items() if a not in self._expected}
        unknown = sorted(c for c in self.aliases.values() if c not in self._expected)
        if unknown:
            raise ValueError(f"{engine}: tied aliases point at names that are not parameters: {unknown}")
        self._names: set[str] = set()
        self._loaded: set[str] = set()

    def begin(self) -> None:
        """Start counting a new hand-off."""
        self._names.clear()
        self._loaded.clear()

    def take(self, name: str) -> str | None:
        """Count ``name``; returns the parameter it loads, or None when an alias of it was already loaded in this
        hand-off (the caller skips the tensor). Raises :class:`WeightSyncError` for a name that is not a parameter
        of the engine, or arrived twice."""
        canonical = self.aliases.get(name, name)
        if canonical not in self._expected:
            raise WeightSyncError(
                f"{self.engine}.load_weights received {name!r}, which is not one of the engine's "
                f"{len(self.expected)} parameters (e.g. {self.expected[:3]}). HINT: hand over the actor's own "
                "transformers parameter names (`named_parameters()` of the model the engine was built from, as "
                "`weights_for(engine, model)` streams them)."
            )
        if name in self._names:
            raise WeightSyncError(
                f"{self.engine}.load_weights received {name!r} twice in one hand-off. HINT: stream each parameter "
                "once (`named_parameters()`, not a list that repeats names)."
            )
        self._names.add(name)
        if canonical in self._loaded:
            return None
        self._loaded.add(canonical)
        return canonical

    def finish(self) -> None:
        """End the hand-off. Raises :class:`WeightSyncError` listing the parameters (the first ten and the count) it
        did not contain."""
        missing = [n for n in self.expected if n not in self._loaded]
        if missing:
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise WeightSyncError(
                f"{self.engine}.load_weights: the hand-off missed {len(missing)} of the engine's "
                f"{len(self.expected)} parameters: {missing[:10]}{more}. The engine now holds a mix of old and new "
                "weights and will not generate until a complete hand-off arrives. HINT: stream every name in "
                "`engine.param_names` in one load_weights call (`weights_for(engine, model)` over the whole actor, "
                "not a filtered or partial iterator)."
            )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the actor role, the resharding code and the strategy need from a generator; every engine (transformers,
    vLLM, the vLLM engine server) implements every member
    (:func:`~lightning_rlhf.engines.rollout.factory.make_rollout_engine` builds them). Runs on: every worker.

    Abilities: what an engine offers beyond these members it declares in ``abilities`` (:class:`EngineAbilities`:
    views of a reused buffer in ``load_weights``, LoRA adapters, shared weights); the callers read it and never probe
    the engine for attributes. An engine of one's own (``RLHFStrategy(engine_factory=...)``) declares
    ``abilities = EngineAbilities()`` when it offers none of them, and may serve ``requests`` through its ``generate``
    (``requests = BatchedRequestQueue(self)``).

    Verified hand-offs: :meth:`fingerprint` says what the engine holds and ``fingerprint_rtol`` how closely that
    agrees with the trainer's (``HybridEngine`` checks hand-offs with them; "Every hand-off is checked").

    Memory phases (docs/hybrid-engine.md, "Memory phases"): the actor calls ``wake_up(tags=["weights"])``,
    ``load_weights(...)`` (when needed), releases the trainer's memory, then ``wake_up(tags=["kv_cache"])``,
    ``generate(...)`` and ``sleep()``, so that a device never holds two full copies of the weights beside the trainer's
    shards. An engine that cannot free a kind of memory accepts its tag and does nothing for it.
    """

    @property
    def abilities(self) -> EngineAbilities:
        """What the engine offers beyond the members every engine has (:class:`EngineAbilities`)."""
        ...

    @property
    def requests(self) -> RequestQueue:
        """The engine's requests (:class:`~lightning_rlhf.engines.rollout.requests.RequestQueue`): what multi-turn
        episodes submit their turns to. An engine of one's own may serve them through its ``generate``
        (:class:`~lightning_rlhf.engines.rollout.requests.BatchedRequestQueue`)."""
        ...

    @property
    def context_length(self) -> int | None:
        """The most tokens a prompt and its response may hold together (None: unbounded, or not known)."""
        ...

    @property
    def device(self) -> torch.device:
        """The device the engine generates on (a hand-off's tensors are received there)."""
        ...

    @property
    def fingerprint_rtol(self) -> float:
        """How closely :meth:`fingerprint` agrees with the trainer's sums, relative to the sums of absolute values: to
        rounding, or to the precision of the kernels an engine reads its weights through (vLLM's repacked CPU
        linears)."""
        ...

    @property
    def weights_discarded(self) -> bool:
        """True while the engine holds no valid weights (built without them, after a failed hand-off, after a vLLM
        level-2 sleep): the actor then hands its weights over even if they did not change."""
        ...

    @property
    def param_names(self) -> list[str]:
        """The transformers parameter names a complete hand-off contains, each once (tied aliases such as
        ``lm_head.weight`` are accepted in place of the name they alias, and are not listed)."""
        ...

    @property
    def tp_size(self) -> int:
        """Ranks per tensor-parallel engine (1: every rank runs a whole engine)."""
        ...

    @property
    def tp_rank(self) -> int:
        """This rank's place in its engine's TP group (0 at TP 1): which slice of each tensor its engine holds (a
        checked hand-off compares the trainer's sums of the same slice)."""
        ...

    @property
    def slicer(self) -> Slicer | None:
        """``(name, full shape, tp rank) -> TPSlice | None``: which region of each tensor a TP rank's engine
        loads (``reshard.Slicer``), so that ``weights_for`` moves only those; None: hand over full tensors."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the engine's weights (hand-offs are cast to it; resharded slices travel in it)."""
        ...

    @property
    def offload_optimizer(self) -> bool:
        """Whether the trainer should move its optimizer state off the device while the engine generates (the
        engine's weights and KV cache then share the device's memory with the trainer's parameters only)."""
        ...

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, vision: Sequence[VisionInputs | None] | None = None
    ) -> RolloutOutput:
        """Sample ``params.n`` responses for each prompt (token ids without padding; with ``vision``, each row's images,
        their placeholders repeated per merged patch in the ids). Raises :class:`WeightSyncError` while
        ``weights_discarded`` is True."""
        ...

    def agree(self, calls: int, busy: bool) -> tuple[int, bool]:
        """For callers that make a varying number of :meth:`generate` calls (a queue's rounds of requests): the most
        calls any rank of this engine's TP group makes in the coming round, and whether any of them still has work. At
        TP > 1 every call is collective, so a rank with fewer calls makes the rest with no prompts; at TP 1 the rank's
        own ``(calls, busy)``."""
        ...

    def fingerprint(self, ranges: Mapping[str, RowRanges]) -> dict[str, Tensor]:
        """What the engine holds: per name, the float64 sums of those rows of the tensor (:func:`as_rows`; at TP > 1
        of this rank's slice), as :func:`tensor_fingerprints` takes them of tensors. A name the engine does not hold
        is left out (:func:`check_fingerprints` names it)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """Take new weights: ``(transformers parameter name, full tensor or TP slice)`` for every name in
        ``param_names``, each once; returns the bytes received. Clears ``weights_discarded``. Raises
        :class:`WeightSyncError` (and leaves ``weights_discarded`` True) when a name is unknown or
        repeated, or the hand-off did not contain every parameter.
        """
        ...

    def sleep(self) -> None:
        """Free accelerator memory while training runs (a no-op where that is not possible): whatever is awake,
        after a partial wake too."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`sleep` for the memory named by ``tags`` (out of :data:`MEMORY_TAGS`; None: all of it) before
        generating. Raises ``ValueError`` for a tag not in :data:`MEMORY_TAGS`."""
        ...
