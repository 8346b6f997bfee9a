"""A lean sampling loop for Llama-family decoders: the transformers engine's fast path (docs/architecture.md).

transformers' ``generate`` spends most of a small model's decoding step outside the model's matmuls: a growing
``DynamicCache`` concatenated at every step, grouped-query keys and values copied per head group (``repeat_kv``),
a 4-D mask rebuilt per step, and ``torch.multinomial`` on CPU (an exponential draw per vocabulary entry, ~6 ms for
64 x 4,096 logits). This loop runs the model's own modules and weights, and replaces the attention's plumbing, the
projections' calls and the sampler: preallocated key/value buffers per layer with additive float masks
(:class:`_Cache`); grouped-query attention as batched matmuls against the shared keys, softmax in float32 as
transformers' eager attention; one prompt pass per distinct prompt, its keys and values kept once for its ``n``
samples; one matmul for the projections that read the same input (:func:`_fuse`), through oneDNN's prepacked
weights on CPU (:func:`_packs`); sampling by inverse CDF (:func:`_draw`).

It serves the causal LMs of :data:`MODEL_TYPES` (:func:`decode_loop_unsupported` says why not; the engine then falls
back to ``generate``). What is sampled follows :class:`SamplingParams` exactly as the ``generate`` path does (the
same logits processing, stop handling and greedy copies); only the random stream differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_rlhf.cpu import native, onednn
from lightning_rlhf.cpu.kernels import RMS_NORM_CLASSES
from lightning_rlhf.cpu.switches import enabled
from lightning_rlhf.engines.rollout.base import SamplingParams, processed_logprobs
from lightning_rlhf.engines.rollout.hf import left_pad

__all__ = ["MODEL_TYPES", "Past", "decode_loop_unsupported", "fused_groups", "sample_loop"]

MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
"""``config.model_type`` values whose decoder layers the loop knows: pre-norm, rotary, grouped-query attention,
gated MLP (Qwen3's per-head query/key norms included)."""

_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_LAYER_PARTS = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")
_BODY_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def decode_loop_unsupported(model: Any, *, max_length: int) -> str | None:
    """Why :func:`sample_loop` cannot run ``model`` for sequences of up to ``max_length`` tokens; None when it can.
    Runs on: worker (the transformers engine asks before every ``generate``; the answer is cheap)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(MODEL_TYPES)}"
    body = getattr(model, "model", None)
    if body is None or getattr(model, "lm_head", None) is None or any(not hasattr(body, p) for p in _BODY_PARTS):
        return "the model has no `model.{embed_tokens,layers,norm,rotary_emb}` and `lm_head`"
    for layer in body.layers:
        if any(not hasattr(layer, p) for p in _LAYER_PARTS):
            return f"a decoder layer lacks one of {_LAYER_PARTS}"
        attn = layer.self_attn
        if any(not hasattr(attn, p) for p in (*_ATTENTION_PARTS, "head_dim", "scaling")):
            return f"an attention module lacks one of {_ATTENTION_PARTS} / head_dim / scaling"
        window = getattr(attn, "sliding_window", None)
        if window is not None and window < max_length:
            return f"sliding window {window} < sequence length {max_length}"
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return "logit soft-capping"
    return None


class _Cache:
    """Keys and values of every layer: the prompts' own once per prompt, shared by its ``n`` samples (``prefix_keys``/
    ``prefix_values`` ``[prompts, kv_heads, width, head_dim]``; ``prefix_bias`` ``[prompts, 1, 1, width]``, -inf on
    left padding), and the generated tokens' per sequence (``keys``/``values`` ``[prompts * n, kv_heads, new tokens,
    head_dim]``, a prompt's samples consecutive; ``bias`` ``[prompts * n, 1, 1, new tokens]``, -inf where unwritten)."""

    def __init__(
        self, model: Any, mask: Tensor, n: int, new_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        layers = model.model.layers
        head_dim = layers[0].self_attn.head_dim
        kv_heads = model.config.num_key_value_heads
        prompts, width = mask.shape
        self.n = n
        prefix = (prompts, kv_heads, width, head_dim)
        self.prefix_keys = [torch.zeros(prefix, dtype=dtype, device=device) for _ in layers]
        self.prefix_values = [torch.zeros(prefix, dtype=dtype, device=device) for _ in layers]
        self.prefix_bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, -math.inf)[:, None, None]
        shape = (prompts * n, kv_heads, new_tokens, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.bias = torch.full((prompts * n, 1, 1, new_tokens), -math.inf, dtype=torch.float32, device=device)
        self._group = model.config.num_attention_heads // kv_heads
        self._fusable = [None if hasattr(layer.self_attn, "q_norm") else layer.self_attn.scaling for layer in layers]
        self.steps: list[Callable[[Tensor, Tensor, Tensor, int], Tensor] | None] = [None] * len(layers)
        """Per layer, its decoding steps as one compiled call each, where the kernels run and the layer has no
        per-head query/key norms (Qwen3)."""
        self._compile_steps()

    def _compile_steps(self) -> None:
        if not _native_kernels(self):
            return
        for i, scaling in enumerate(self._fusable):
            if scaling is not None:
                self.steps[i] = native.DecodeStep.make(
                    self.prefix_keys[i], self.prefix_values[i], self.prefix_bias, self.keys[i], self.values[i],
                    n=self.n, group=self._group, scaling=scaling,
                )  # fmt: skip

    def keep_rows(self, rows: Tensor) -> None:
        """Keep only sequences ``rows`` (indices, ascending): the decoding batch without its finished rows. Each
        kept row gets its prompt's keys and values of its own (``n`` becomes 1)."""
        prompts = rows // self.n
        self.prefix_keys = [k.index_select(0, prompts) for k in self.prefix_keys]
        self.prefix_values = [v.index_select(0, prompts) for v in self.prefix_values]
        self.prefix_bias = self.prefix_bias.index_select(0, prompts)
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.bias = self.bias.index_select(0, rows)
        self.n = 1
        self._compile_steps()


def _written_slots_only(cache: _Cache) -> bool:
    """Whether the eager ops' attention step reads only the generated slots written so far (see :func:`_forward`):
    float32, or any dtype on a GPU. (The compiled kernel always does.)"""
    keys = cache.keys[0]
    return keys.dtype == torch.float32 or keys.device.type != "cpu"


def _native_kernels(cache: _Cache) -> bool:
    """Whether the loop's attention step, RMS norms and SiLU-gated products go through the compiled kernels (each
    falls back to the eager ops where it cannot run): on CPU, with the layer's piece ``native`` on."""
    return cache.keys[0].device.type == "cpu" and enabled("native")


def _norm(module: Any, x: Tensor, native_ok: bool) -> Tensor:
    """``module(x)`` for a decoder's RMS norm, through the compiled kernel where it is one of transformers'
    Llama-family norms (the same formula)."""
    if native_ok and type(module).__name__ in RMS_NORM_CLASSES:
        out = native.rms_norm(x, module.weight, float(module.variance_epsilon))
        if out is not None:
            return out
    return module(x)


def _fused_rows(parts: list[Tensor]) -> Tensor | None:
    """The tensor whose consecutive row blocks ``parts`` are (contiguous views of one storage, back to back), or
    None when they are not laid out that way."""
    first = parts[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for part in parts:
        if not part.is_contiguous() or part.untyped_storage().data_ptr() != storage or part.storage_offset() != offset:
            return None
        offset += part.numel()
    shape = (sum(part.shape[0] for part in parts), *first.shape[1:])
    return first.as_strided(shape, first.stride(), first.storage_offset())


def _fuse(linears: tuple[nn.Module, ...]) -> tuple[Tensor, Tensor | None]:
    """One weight ``[sum of out_features, in_features]`` (and bias) for projections that read the same input: the
    modules' parameters become consecutive row blocks of it, in place and once (their values, names and shapes do
    not change, so hand-offs that ``copy_`` into them keep working; a module moved by ``.to()`` is fused again)."""
    fused: list[Tensor | None] = []
    for attr in ("weight", "bias"):
        params = [getattr(m, attr) for m in linears]
        if all(p is None for p in params):
            fused.append(None)
            continue
        whole = _fused_rows(params)
        if whole is None:
            with torch.inference_mode(False), torch.no_grad():  # the parameters stay normal tensors
                whole = torch.cat([p.detach() for p in params])
                for p, rows in zip(params, whole.split([p.shape[0] for p in params]), strict=True):
                    p.data = rows
            whole = _fused_rows(params)
        fused.append(whole)
    assert fused[0] is not None
    return fused[0], fused[1]


class _Linear:
    """One projection of the loop: ``y = x @ weight.T + bias`` through ``F.linear``, or through oneDNN with the weight
    reordered into its blocked layout (``onednn.packed_linear``, where :func:`_packs`). The packed copy (one more copy
    of the weights while the engine generates) lives as long as the :func:`sample_loop` call that made it, so a
    hand-off that writes or rebinds the parameters is seen by the next call."""

    def __init__(self, weight: Tensor, bias: Tensor | None, rows: int | None) -> None:
        self.bias = bias
        self.weight = weight
        self._packed = onednn.packed_linear(weight, bias, rows) if rows is not None else None
        self.packed = self._packed is not None

    def __call__(self, x: Tensor) -> Tensor:
        return self._packed(x) if self._packed is not None else F.linear(x, self.weight, self.bias)


def _packs(model: Any) -> bool:
    """Whether the loop's projections go through oneDNN with prepacked weights: piece ``onednn`` on, and bfloat16 on
    a CPU whose oneDNN has the path, or float32 where oneDNN beats MKL (``onednn.fp32_through_onednn``)."""
    weight = model.lm_head.weight
    return (
        enabled("onednn") and onednn.packs(weight) and (weight.dtype != torch.float32 or onednn.fp32_through_onednn())
    )


class _Layer(NamedTuple):
    """A decoder layer's projections, each one matmul: queries, keys and values together; the output projection;
    gate and up together; down."""

    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear


def fused_groups(model: Any) -> list[tuple[str, ...]]:
    """The parameter names whose tensors the loop fuses into one (:func:`_fuse`), per group in row order: each
    layer's query/key/value weights (and biases), and its gate/up weights; laid out that way in one storage, they are
    fused as they lie. Empty for a model the loop does not serve. Runs on: worker."""
    if decode_loop_unsupported(model, max_length=0) is not None:
        return []
    groups: list[tuple[str, ...]] = []
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        for attr in ("weight", "bias"):
            if getattr(layer.self_attn.q_proj, attr, None) is not None:
                groups.append(tuple(f"{prefix}.self_attn.{m}_proj.{attr}" for m in "qkv"))
        groups.append((f"{prefix}.mlp.gate_proj.weight", f"{prefix}.mlp.up_proj.weight"))
    return groups


def _layers(model: Any, rows: int) -> tuple[list[_Layer], _Linear]:
    """:class:`_Layer` of every decoder layer of ``model`` (fusing its parameters where they are not yet), and the
    head; packed for ``rows`` rows per product where :func:`_packs` says so."""
    hint = rows if _packs(model) else None

    def linear(*modules: Any) -> _Linear:
        weight, bias = _fuse(modules) if len(modules) > 1 else (modules[0].weight, modules[0].bias)
        return _Linear(weight, bias, hint)

    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = linear(attn.q_proj, attn.k_proj, attn.v_proj)
        out.append(_Layer(qkv, linear(attn.o_proj), linear(mlp.gate_proj, mlp.up_proj), linear(mlp.down_proj)))
    return out, linear(model.lm_head)


def _forward(
    model: Any,
    linears: tuple[list[_Layer], _Linear],
    cache: _Cache,
    ids: Tensor,
    positions: Tensor,
    step: int | None,
    prompt_bias: Tensor | None = None,
) -> Tensor:
    """Run ``ids`` through the model; returns the last position's logits ``[rows, vocab]``. ``step`` None: the
    prompt pass (``ids`` ``[prompts, width]``, left-padded, with :func:`_prompt_attention`'s ``prompt_bias``; writes
    the prefix cache); else decoding step ``step`` (``ids`` ``[prompts * n, 1]``; writes generated slot ``step``).

    On CPU the attention step, the RMS norms and the SiLU-gated products run as compiled kernels
    (:func:`_native_kernels`). The eager ops' attention reads only the written slots in float32 and on GPUs (the
    hidden slots would only add exact zeros to the softmax's sums), the whole capacity in low precision on CPU: oneDNN
    copies a batch of bfloat16 matrices that are not contiguous, which costs more than the slots it skips."""
    body = model.model
    x = body.embed_tokens(ids)
    cos, sin = body.rotary_emb(x, positions)  # [rows, q, d]
    rotation: tuple[Tensor, Tensor] | None = None  # the eager ops' form, made when a layer needs it
    layers, head = linears
    native_ok = _native_kernels(cache)
    silu = native_ok and getattr(model.config, "hidden_act", None) == "silu"
    for i, (layer, weights) in enumerate(zip(body.layers, layers, strict=True)):
        qkv = weights.qkv(_norm(layer.input_layernorm, x, native_ok))  # [rows, q, (heads + 2 kv) * d]
        fused = cache.steps[i] if step is not None else None
        if fused is not None:
            out = fused(qkv, cos, sin, step)  # type: ignore[arg-type]
        else:
            if rotation is None:
                rotation = _rotation(cos, sin)
            out = _attention(layer.self_attn, qkv, rotation, i, cache, step, prompt_bias)
        x = x + weights.o(out)
        gate_up = weights.gate_up(_norm(layer.post_attention_layernorm, x, native_ok))
        gated = native.silu_mul(gate_up) if silu else None
        if gated is None:
            gate, up = gate_up.chunk(2, dim=-1)
            gated = layer.mlp.act_fn(gate) * up
        x = x + weights.down(gated)
    return head(_norm(body.norm, x[:, -1], native_ok))


def _rotation(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The rotary embedding's ``cos``/``sin`` ``[rows, q, d]`` as the eager ops apply them: rotate-half,
    ``x * cos + cat(-x2, x1) * sin``, is ``x * cos + roll(x, half) * cat(-sin1, sin2)``; both ``[rows, q, 1, d]``."""
    half = cos.shape[-1] // 2
    return cos.unsqueeze(2), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)


def _attention(
    attn: Any,
    qkv: Tensor,
    rotation: tuple[Tensor, Tensor],
    i: int,
    cache: _Cache,
    step: int | None,
    prompt_bias: Tensor | None,
) -> Tensor:
    """Layer ``i``'s attention as eager ops (and the compiled attention step where it runs): the rotary embedding
    of the fused projection's queries and keys, their writes into the cache, the attention; ``[rows, q, heads * d]``
    from ``qkv`` ``[rows, q, (heads + 2 kv) * d]``. See :func:`_forward` for ``step`` and ``prompt_bias``."""
    rows, q = qkv.shape[:2]
    d = attn.head_dim
    kv_heads = cache.keys[i].shape[1]
    qkv = qkv.view(rows, q, -1, d)  # [rows, q, heads + 2 kv, d]
    heads = qkv.shape[2] - 2 * kv_heads
    qk = qkv[:, :, : heads + kv_heads]
    if hasattr(attn, "q_norm"):  # Qwen3: per-head RMS norms before the rotation
        qk = torch.cat((attn.q_norm(qk[:, :, :heads]), attn.k_norm(qk[:, :, heads:])), dim=2)
    cos, sin = rotation
    qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
    key, value = qk[:, :, heads:].transpose(1, 2), qkv[:, :, heads + kv_heads :].transpose(1, 2)
    # The queries of a key/value head's group share its keys: [group * q, d] x [d, keys] products per (row,
    # kv head), with no copy of the keys per query head.
    query = qk[:, :, :heads].transpose(1, 2).reshape(rows, kv_heads, -1, d)  # [rows, kv_heads, group * q, d]
    if step is None:  # the prompt pass: the last q slots (the slots before them hold a kept Past's keys)
        width = cache.prefix_keys[i].shape[2]
        cache.prefix_keys[i][:, :, width - q :].copy_(key)
        cache.prefix_values[i][:, :, width - q :].copy_(value)
        assert prompt_bias is not None
        out = _prompt_attention(query, cache.prefix_keys[i], cache.prefix_values[i], prompt_bias, attn.scaling)
    else:
        cache.keys[i][:, :, step] = key[:, :, 0]
        cache.values[i][:, :, step] = value[:, :, 0]
        out = _step_attention(query, i, step, cache, attn.scaling)
    return out.view(rows, -1, q, d).transpose(1, 2).reshape(rows, q, -1)


def _prompt_attention(query: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scaling: float) -> Tensor:
    """The prompt pass's attention, ``[prompts, kv_heads, group * q, d]`` from queries of the same shape (the last
    ``q`` of the ``width`` slots); ``bias`` ``[prompts, 1, 1, q, width]`` is added to the scores (0: visible, -inf:
    hidden). Through PyTorch's fused grouped-query attention, in blocks, instead of separate passes over the whole
    ``[width, width]`` scores (a tool episode's second turn, 64 prompts of ~130 tokens, tiny model: 188 -> 136 ms)."""
    prompts, kv_heads, group_q, d = query.shape
    q = bias.shape[-2]
    heads = group_q // q * kv_heads
    out = F.scaled_dot_product_attention(
        query.view(prompts, heads, q, d),
        keys,
        values,
        attn_mask=bias[:, 0].to(query.dtype),
        scale=scaling,
        enable_gqa=heads != kv_heads,
    )
    return out.view(prompts, kv_heads, group_q, d)


def _step_attention(query: Tensor, layer: int, step: int, cache: _Cache, scaling: float) -> Tensor:
    """A decoding step's attention, ``[rows, kv_heads, group, d]`` from queries of the same shape: over the prompt's
    keys (one ``[n * group, d] x [d, width]`` product per prompt and key/value head, for its ``n`` samples at once)
    and the row's own generated ones, with one softmax over both (in float32)."""
    rows, kv_heads, group, _ = query.shape
    n = cache.n
    prompts = rows // n
    prefix_keys, prefix_values = cache.prefix_keys[layer], cache.prefix_values[layer]
    keys, values = cache.keys[layer], cache.values[layer]
    if _native_kernels(cache):
        out = native.decode_attention(
            query, prefix_keys, prefix_values, cache.prefix_bias, keys, values, n=n, span=step + 1, scaling=scaling
        )
        if out is not None:
            return out
    width = prefix_keys.shape[2]
    span = step + 1 if _written_slots_only(cache) else keys.shape[2]
    keys, values = keys[:, :, :span], values[:, :, :span]  # views: the written slots

    def by_prompt(t: Tensor) -> Tensor:  # [rows, kv, group, k] -> [prompts, kv, n * group, k]
        return t.reshape(prompts, n, kv_heads, group, -1).transpose(1, 2).reshape(prompts, kv_heads, n * group, -1)

    def by_row(t: Tensor) -> Tensor:  # the inverse
        return t.view(prompts, kv_heads, n, group, -1).transpose(1, 2).reshape(rows, kv_heads, group, -1)

    on_prompt = torch.matmul(by_prompt(query), prefix_keys.transpose(-1, -2)).mul_(scaling)
    on_prompt = on_prompt.float().add_(cache.prefix_bias)
    on_own = torch.matmul(query, keys.transpose(-1, -2)).mul_(scaling).float()
    if span > step + 1:
        on_own.add_(cache.bias[..., :span])
    probs = torch.softmax(torch.cat((by_row(on_prompt), on_own), dim=-1), dim=-1).to(values.dtype)
    out = torch.matmul(probs[..., width:], values)  # contiguous: by_row's result may be a view of any strides
    return out.add_(by_row(torch.matmul(by_prompt(probs[..., :width]), prefix_values)))


def _pick(scores: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """One token per row and its log-prob, both ``[rows]``, from ``scores`` ``[rows, vocab]`` (float32 logits, stop
    tokens already masked): the argmax when greedy, else a draw by inverse CDF (:func:`_draw`) from
    :func:`processed_logprobs`' distribution. Without top-k/top-p that is one fused ``softmax`` at the temperature (its
    vectorised exp is faster than ``exp`` alone), and the log-prob is the log of the picked token's probability
    (exact to float32 rounding; a token of probability 0 is never drawn)."""
    if params.is_greedy:
        lp = processed_logprobs(scores, temperature=params.sampling_temperature)
        token = lp.argmax(dim=-1)
        return token, lp.gather(1, token[:, None]).squeeze(1)
    cut: Tensor | None = None  # top-k/top-p log-probs; without them the log is taken of the picked entries only
    if params.top_k or params.top_p < 1:
        cut = processed_logprobs(scores, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        probs = cut.exp()
    else:
        probs = torch.softmax(scores / params.temperature if params.temperature != 1 else scores, dim=-1)
    token = _draw(probs)
    picked = probs.gather(1, token[:, None])
    if bool((picked == 0).any()):  # float rounding at the very end of a cumulative sum: take the likeliest token
        token = torch.where((picked == 0).squeeze(1), probs.argmax(dim=-1), token)
        picked = probs.gather(1, token[:, None])
    out = picked.log() if cut is None else cut.gather(1, token[:, None])
    return token, out.squeeze(1)


_BLOCK = 64
"""Vocabulary entries per block of :func:`_draw`'s two-level search."""


def _draw(probs: Tensor) -> Tensor:
    """One index per row of ``probs`` ``[rows, vocab]`` (non-negative, any positive sum), drawn with probability
    proportional to its entry: one uniform per row, located in the cumulative sums (``right=True``: an entry of
    probability 0 is never the answer, up to float rounding at the very end). A cumulative sum is serial per row (~1 ns
    an entry): where the vocabulary splits into blocks of :data:`_BLOCK`, the draw finds the block in the cumulative
    sums of the blocks' totals, then the entry in that block's: ``vocab / BLOCK + BLOCK`` serial steps, not ``vocab``.
    """
    rows, vocab = probs.shape
    u = torch.rand((rows, 1), device=probs.device, dtype=probs.dtype)
    if vocab % _BLOCK or vocab < 4 * _BLOCK:
        cdf = probs.cumsum(dim=-1)
        return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=vocab - 1)
    blocks = probs.view(rows, -1, _BLOCK)
    outer = blocks.sum(dim=-1).cumsum_(dim=-1)  # [rows, blocks]
    u = u * outer[:, -1:]
    block = torch.searchsorted(outer, u, right=True).clamp_(max=outer.shape[1] - 1)  # [rows, 1]
    before = outer.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)
    inner = blocks.gather(1, block[:, :, None].expand(-1, -1, _BLOCK)).squeeze(1).cumsum_(dim=-1)  # [rows, BLOCK]
    entry = torch.searchsorted(inner, u - before, right=True).clamp_(max=_BLOCK - 1)
    return (block * _BLOCK + entry).squeeze(1)


class Past(NamedTuple):
    """A sequence's keys and values kept from a :func:`sample_loop` call, so that a later call continues it without
    running its tokens through the model again (a multi-turn episode's next turn: the conversation so far, then the
    observation's tokens). ``ids``: the tokens they cover (the prompt and every sampled token but the last, which was
    never fed); ``keys``/``values``: per layer, ``[kv_heads, len(ids), head_dim]``."""

    ids: list[int]
    keys: list[Tensor]
    values: list[Tensor]


def _held(past: Past | None, prompt: list[int]) -> int:
    """How many of ``prompt``'s first tokens ``past`` covers (their common prefix), short of the prompt's last token,
    which runs again: its logits start the sampling."""
    if past is None:
        return 0
    limit = min(len(past.ids), len(prompt) - 1)
    if past.ids[:limit] == prompt[:limit]:
        return limit
    return next(k for k, (a, b) in enumerate(zip(past.ids, prompt, strict=False)) if a != b)


def _place_pasts(cache: _Cache, pasts: list[Past | None], prompts: list[list[int]]) -> int:
    """Write the kept keys and values of ``pasts`` into the prompt cache's slots; returns how many of the last slots
    the prompt pass must still run (every row's tokens that no past covers; 1 at least)."""
    width = cache.prefix_keys[0].shape[2]
    held = [_held(past, prompt) for past, prompt in zip(pasts, prompts, strict=True)]
    run = max(len(prompt) - h for prompt, h in zip(prompts, held, strict=True))
    if run >= width:
        return width
    for row, (past, prompt) in enumerate(zip(pasts, prompts, strict=True)):
        take = len(prompt) - run  # the row's tokens before the slots that run: all covered (held >= take)
        if past is None or take <= 0:
            continue
        start = width - len(prompt)
        for layer, (keys, values) in enumerate(zip(past.keys, past.values, strict=True)):
            cache.prefix_keys[layer][row, :, start : start + take] = keys[:, :take]
            cache.prefix_values[layer][row, :, start : start + take] = values[:, :take]
    return run


def _kept(
    cache: _Cache, rows: list[int], seqs: list[int], prompts: list[list[int]], n: int, tokens: Tensor, fed: list[int]
) -> dict[int, Past]:
    """The :class:`Past` of the cache's sequences ``rows``, by their row of the result ``seqs`` (``prompts``: every
    prompt, ``n`` samples each; ``tokens``: every row's sampled tokens): its prompt's keys and values and those of
    its first ``fed`` sampled tokens (those run through the model at their own positions)."""
    width = cache.prefix_keys[0].shape[2]
    pasts = {}
    for row, seq, ids, k in zip(rows, seqs, tokens[seqs].tolist(), fed, strict=True):
        prompt = prompts[seq // n]
        start, at = width - len(prompt), row // cache.n
        keys = [torch.cat((p[at, :, start:], g[row, :, :k]), dim=1) for p, g in zip(
            cache.prefix_keys, cache.keys, strict=True)]  # fmt: skip
        values = [torch.cat((p[at, :, start:], g[row, :, :k]), dim=1) for p, g in zip(
            cache.prefix_values, cache.values, strict=True)]  # fmt: skip
        pasts[seq] = Past(prompt + ids[:k], keys, values)
    return pasts


def _prompt_pass(
    model: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    pad_token_id: int,
    device: torch.device,
    pasts: list[Past | None] | None,
) -> tuple[_Cache, tuple[list[_Layer], _Linear], Tensor, Tensor]:
    """Run the prompts through the model (only the slots no past covers, see :func:`_place_pasts`): returns the
    cache holding their keys and values (``n``: 1 if greedy, else ``params.n`` samples per prompt; room for
    ``params.max_new_tokens`` more), the model's linears for ``prompts * n`` rows, and the next token's logits and
    position of each of the ``prompts * n`` sequences (``[rows, vocab]``, ``[rows, 1]``)."""
    n = 1 if params.is_greedy else params.n
    ids, mask = left_pad(prompts, pad_token_id, device)
    rows, width = ids.shape
    cache = _Cache(model, mask, n, params.max_new_tokens, next(model.parameters()).dtype, device)
    positions = (mask.long().cumsum(-1) - 1).clamp_(min=0)  # as transformers' generate: padding takes no position
    # A query sees the prompt's tokens up to its own slot, and always itself (a padding query would otherwise see
    # nothing, and the NaN of its softmax would reach the next layers' keys).
    slots = torch.arange(width, device=device)
    query_slots = slots[:, None]
    seen = ((slots[None, :] <= query_slots) & mask[:, None, :]) | (slots[None, :] == query_slots)
    prompt_bias = torch.zeros(seen.shape, device=device).masked_fill_(~seen, -math.inf)[:, None, None]
    linears = _layers(model, rows * n)
    run = width if pasts is None else _place_pasts(cache, pasts, prompts)
    logits = _forward(model, linears, cache, ids[:, -run:], positions[:, -run:], None, prompt_bias[..., -run:, :])
    if n > 1:
        logits = logits.repeat_interleave(n, dim=0)
        positions = positions.repeat_interleave(n, dim=0)
    return cache, linears, logits, positions[:, -1:]


KEEP_ROWS_FROM = 16
"""The decoding batch drops its finished rows once at most half of them still decode, from this many rows on (a tool
episode's first turn: most calls end near 25 tokens, the longest near 70; 64 rows of the tool model decode a step in
2.8 ms, 32 in 1.1 ms)."""


@torch.inference_mode()
def sample_loop(
    model: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    stops: set[int],
    pad_token_id: int,
    device: torch.device,
    pasts: list[Past | None] | None = None,
    keep: list[Past] | None = None,
    limits: list[int] | None = None,
    finished: Callable[[list[int], Tensor, Tensor], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample one response per prompt (greedy) or ``params.n`` per prompt, consecutively.

    Runs on: worker (inside :meth:`HFRolloutEngine.generate`, under its seeded RNG). Every prompt must hold at
    least one token. Returns ``(tokens, logprobs)``, both ``[rows, steps]``: rows that stopped early continue with
    junk after their stop token (callers cut at the first stop), ``steps <= params.max_new_tokens`` (the loop ends
    when every row has stopped).

    ``pasts`` (one per prompt, or None): what an earlier call kept of a sequence each prompt continues; the prompt
    pass then runs only the slots no past covers (its keys and values are the same up to float rounding: the same
    tokens at the same positions). ``keep``: a list to append each row's :class:`Past` to. ``limits`` (one per
    prompt, or None): each prompt's own bound on its responses' tokens (at most ``params.max_new_tokens``); a row
    stops there as at a stop token, and what follows it is junk as after one. ``finished``: called, between decoding
    steps, with the rows that have just stopped (at a stop token or their limit) and their tokens and log-probs so
    far, so that a caller can act on a response while the others still decode (a multi-turn episode's tool call).
    ``stop``: asked between decoding steps; True ends the loop there, every row that has not stopped holding the tokens
    it has so far (an interrupted request, continued later from its prefix).
    """
    cache, linears, logits, position = _prompt_pass(model, prompts, params, pad_token_id, device, pasts)
    n = cache.n
    stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=device)
    total = len(prompts) * n
    done = torch.zeros(total, dtype=torch.bool, device=device)
    live = torch.arange(total, device=device)  # the decoding batch's sequences (rows of the result)
    bounds = [params.max_new_tokens] * total if limits is None else [b for b in limits for _ in range(n)]
    bound = None if limits is None else torch.tensor(bounds, device=device)
    # A row past its own bound decodes junk at its last valid position (positions past the model's context would move
    # a dynamic rotary embedding's frequencies for every row).
    cap = None if bound is None else position + bound[:, None] - 1
    tokens = torch.full((total, params.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((total, params.max_new_tokens), device=device)
    kept: dict[int, Past] = {}
    steps = params.max_new_tokens
    for step in range(params.max_new_tokens):
        scores = logits.float()
        if step < params.min_new_tokens:
            scores[:, stop_ids] = -math.inf
        token, logprob = _pick(scores, params)
        tokens[live, step] = token
        logprobs[live, step] = logprob
        stopped = torch.isin(token, stop_ids)
        if bound is not None:
            stopped |= bound[live] <= step + 1
        if finished is not None and bool((stopped & ~done).any()):
            ended = live[stopped & ~done]
            finished(ended.tolist(), tokens[ended, : step + 1], logprobs[ended, : step + 1])
        done |= stopped
        running = int(done.numel() - done.sum())
        if step + 1 == params.max_new_tokens or running == 0 or (stop is not None and stop()):
            steps = step + 1
            break
        if done.numel() >= KEEP_ROWS_FROM and 2 * running <= done.numel():  # finished rows leave the batch
            stay = (~done).nonzero().squeeze(1)
            if keep is not None:
                gone = done.nonzero().squeeze(1).tolist()
                old = live[gone].tolist()
                kept.update(_kept(cache, gone, old, prompts, n, tokens, [min(step, bounds[r]) for r in old]))
            cache.keep_rows(stay)
            live, token, position, done = live[stay], token[stay], position[stay], done[stay]
            cap = None if cap is None else cap[stay]
        cache.bias[..., step] = 0.0
        position = position + 1 if cap is None else torch.minimum(position + 1, cap)
        logits = _forward(model, linears, cache, token[:, None], position, step)
    if keep is not None:
        now = live.tolist()
        kept.update(
            _kept(cache, list(range(len(now))), now, prompts, n, tokens, [min(steps - 1, bounds[r]) for r in now])
        )
        keep.extend(kept[r] for r in range(total))
    return tokens[:, :steps], logprobs[:, :steps]
