"""Export the trained actor as a transformers model folder (safetensors, config, generation config, tokenizer).

Two sources: a live module at the end of training (:func:`export_actor`, what ``ExportActor`` calls) and a
checkpoint written by ``trainer.save_checkpoint`` with ``RLHFStrategy`` (:func:`export_checkpoint`, the
``lightning-rlhf export`` command). docs/cli.md ("export") says what the folder holds and where a checkpoint's
config, tokenizer and LoRA settings come from.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_rlhf.compat.lightning import attached_trainer
from lightning_rlhf.compat.peft import (
    LORA_MARK,
    adapter_layers,
    base_layer_weight,
    config_scale,
    merge_stream,
    wrapped_name,
)
from lightning_rlhf.config.models import resolve_model_path
from lightning_rlhf.engines.train.lora import has_lora, merged_weights, write_adapter

if TYPE_CHECKING:
    from lightning_rlhf.module import RLHFModule

__all__ = [
    "CHECKPOINT_KEY",
    "BestCheckpoint",
    "actor_files",
    "best_checkpoint",
    "export_actor",
    "export_checkpoint",
    "lora_files",
    "resolve_dtype",
]

CHECKPOINT_KEY = "lightning_rlhf_actor_files"
"""Top-level checkpoint entry with the actor's config/tokenizer files (``{file name: bytes}``)."""

ACTOR_PREFIX = "actor.model."
"""Prefix of the actor's weights in the module's state dict (the ``actor`` role's ``model``)."""

_METADATA = "meta.pt"  # Lightning's non-tensor part of a sharded checkpoint (lightning.fabric's _METADATA_FILENAME)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype name (``"bfloat16"``, ``"torch.bfloat16"``) or dtype -> its ``torch.dtype``; None: None. Runs on: any."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"export dtype={dtype!r} is not supported. Valid: {sorted(_DTYPES)} (or None: as trained).")
    return _DTYPES[name]


def actor_files(module: RLHFModule) -> dict[str, bytes]:
    """The actor's ``config.json``, ``generation_config.json`` (if any) and tokenizer files (reloaded from its path: not
    the training-time padding side), as bytes, for checkpoints to export without the original model. Runs on: any
    process."""
    from transformers import AutoTokenizer

    model = module.actor.model
    config = getattr(model, "config", None)
    if config is None and not module.holds_role("actor"):  # placed on other ranks: read its configuration
        from transformers import AutoConfig

        path = resolve_model_path(module.actor.path, setting="ActorRole(path=...)")
        config = AutoConfig.from_pretrained(path)
    if config is None:
        raise RuntimeError("actor_files: the actor's model is not loaded yet. HINT: call it after trainer setup.")
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(module.tokenizer.name_or_path).save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    return files | lora_files(module)


def lora_files(module: RLHFModule) -> dict[str, bytes]:
    """What ``export`` needs to save a LoRA actor's adapters or merge them: peft's ``adapter_config.json`` naming the
    model the run started from; ``{}`` for a full-weight actor. Stored in every checkpoint of a LoRA run. Runs on: every
    process (no model needed: the role's settings only)."""
    lora = getattr(getattr(module, "actor", None), "lora", None)
    if lora is None:
        return {}
    adapter = lora.to_dict() | {"base_model_name_or_path": module.actor.path}
    return {ADAPTER_CONFIG: json.dumps(adapter, default=sorted).encode()}


ADAPTER_FOLDER = "adapter"
"""Where a LoRA actor's export keeps its adapters (``peft.PeftModel.from_pretrained(base, out/adapter)``)."""
ADAPTER_CONFIG = "adapter_config.json"
"""peft's file name of an adapter's settings (stored in a LoRA run's checkpoints with the actor's files)."""


def export_actor(module: RLHFModule, out: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None) -> str:
    """Write the live actor as a transformers folder at ``out`` in ``dtype`` (None: as trained); a LoRA actor's holds
    the merged model and, in ``out/adapter``, the adapters as ``peft`` saves them. Runs on: every process when the
    actor is sharded (one all-gather per tensor, in the same order everywhere); only the lowest rank of the actor's
    pool (rank 0 without a placement) keeps the gathered tensors and writes. All ranks return ``out`` when the folder
    is complete (created; files in it are replaced)."""
    distributed = dist.is_available() and dist.is_initialized()
    if not module.holds_role("actor"):  # placed on other ranks: they gather and write
        if distributed:
            dist.barrier()
        return os.fspath(out)
    model = module.actor.model
    if model is None:
        raise RuntimeError("export_actor: the actor has no model (configure_model has not run).")
    target = resolve_dtype(dtype)
    pools = getattr(getattr(attached_trainer(module), "strategy", None), "pools", None) or {}
    writer = min(pools["actor"]) if "actor" in pools else 0  # the lowest rank that holds the actor writes
    rank = dist.get_rank() if distributed else 0
    lora = has_lora(model)
    state: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}  # tied weights are one parameter under two names: gather it once
    for name, tensor in model.state_dict(keep_vars=True).items():  # the parameters themselves, not copies
        key = id(tensor)
        if key not in gathered:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            kept = full.detach() if lora else _cast(full.detach(), target)  # LoRA: merged in float32 below
            gathered[key] = kept.cpu() if rank == writer else torch.empty(0)
            del full
        if rank == writer:
            state[name] = gathered[key]
    if rank == writer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(module.tokenizer.name_or_path)
        if lora:  # the adapters as peft saves them, and the merged model (what vLLM and transformers load)
            model.save_pretrained(os.path.join(out, ADAPTER_FOLDER), state_dict=state)  # type: ignore[operator]
            state = dict(merged_weights(model, iter(state.items()), target))
        _save_pretrained(state, model.config, getattr(model, "generation_config", None), tokenizer, out)
    if distributed:
        dist.barrier()
    return os.fspath(out)


@dataclass(frozen=True)
class BestCheckpoint:
    """The best checkpoint a monitoring ``ModelCheckpoint`` recorded (:func:`best_checkpoint`)."""

    path: str
    """The checkpoint (file or sharded folder) to export."""
    monitor: str
    """The metric that chose it."""
    mode: str
    """``"min"`` or ``"max"``."""
    score: float | None
    """Its ``monitor`` value."""
    step: int | None
    """The ``global_step`` it was saved at."""

    def describe(self) -> str:
        """One line for logs: which checkpoint, which step, and why. Runs on: any process."""
        score = "?" if self.score is None else f"{self.score:.4f}"
        return f"{self.path} (step {self.step}: the best {self.monitor}={score}, mode {self.mode})"


def best_checkpoint(checkpoint: str) -> BestCheckpoint:
    """The best checkpoint by the metric a ``ModelCheckpoint(monitor=...)`` watched, as recorded in ``checkpoint``.

    Runs on: one process, on CPU. Any checkpoint of the run (``last.ckpt``) names the best of those saved up to it
    (``ModelCheckpoint`` stores its ``best_model_path`` in each); one that moved with its run folder is found beside.

    Raises:
        ValueError: no monitoring ``ModelCheckpoint`` saved ``checkpoint``, or several did (with the paths).
        FileNotFoundError: the best checkpoint is gone.
    """
    meta = _checkpoint_meta(checkpoint)
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for key, state in (meta.get("callbacks") or {}).items():
        if str(key).startswith("ModelCheckpoint") and state.get("monitor") and state.get("best_model_path"):
            found[state["best_model_path"]] = (str(key), state)
    if not found:
        raise ValueError(
            f"best_checkpoint({checkpoint!r}): no ModelCheckpoint with a monitor saved this checkpoint, so it names "
            "no best one. HINT: train with ModelCheckpoint(monitor='val/loss', mode='min') (val/score/mean, mode max "
            "for RL), or ExportActor(monitor=..., mode=...), which exports the best weights itself."
        )
    if len(found) > 1:
        listed = "; ".join(f"{s['monitor']}: {p}" for p, (_, s) in found.items())
        raise ValueError(
            f"best_checkpoint({checkpoint!r}): several ModelCheckpoints monitor a metric ({listed}). HINT: export "
            "the one you want by its path, without best."
        )
    ((recorded, (key, state)),) = found.items()
    path = Path(recorded)
    if not path.exists() and (Path(checkpoint).parent / path.name).exists():
        path = Path(checkpoint).parent / path.name  # the run folder moved
    if not path.exists():
        raise FileNotFoundError(
            f"best_checkpoint({checkpoint!r}): the best checkpoint by {state['monitor']}, {recorded!r}, is gone. "
            "HINT: ModelCheckpoint(save_top_k=...) deletes all but the best k; export one that exists by its path."
        )
    mode = re.search(r"'mode': '(\w+)'", key)
    score = state.get("best_model_score")
    step = _checkpoint_meta(str(path)).get("global_step")
    return BestCheckpoint(
        path=str(path),
        monitor=str(state["monitor"]),
        mode=mode.group(1) if mode else "min",
        score=None if score is None else float(score),
        step=None if step is None else int(step),
    )


def export_checkpoint(
    checkpoint: str,
    out: str,
    *,
    dtype: Literal["bfloat16", "float16", "float32"] | None = None,
    base: str | None = None,
    best: bool = False,
    merge: bool = False,
) -> str:
    """Write a checkpoint's actor as a model folder (LoRA: the peft adapter folder, or the merged model with merge).

    The ``lightning-rlhf export CKPT OUT`` command. Runs on: one process, on CPU (no process group needed).
    Reads only the actor's tensors of a sharded checkpoint, and memory-maps a single-file one, so optimizer
    states are never loaded.

    Args:
        checkpoint: a sharded folder (``save_distributed_checkpoint=True``, the default) or a single file.
        out: folder to write (created; files in it are replaced); returned.
        dtype: weight dtype of the folder; None keeps the saved dtype.
        base: folder or hub id of the model the run started from, for the config and tokenizer of a checkpoint
            saved without ``ExportActor``, and the base weights a LoRA merge reads (default: the base the
            checkpoint names).
        best: export the best checkpoint that ``checkpoint`` names (:func:`best_checkpoint`).
        merge: for a LoRA run, write the merged model (``W + scale * B @ A`` per adapted weight) instead of the
            adapter folder that ``peft.PeftModel.from_pretrained(base, out)`` loads.
    """
    if best:
        checkpoint = best_checkpoint(checkpoint).path
    target = resolve_dtype(dtype)
    meta = _checkpoint_meta(checkpoint, where=f"export_checkpoint({checkpoint!r})")
    if Path(checkpoint).is_dir():
        state = _load_sharded(Path(checkpoint), ACTOR_PREFIX, target)
    else:
        state = _select(meta.get("state_dict", {}), ACTOR_PREFIX, target)
    if not state:
        raise KeyError(
            f"export_checkpoint({checkpoint!r}): no weights under '{ACTOR_PREFIX}' in the checkpoint. "
            "HINT: it must come from an RLHFModule trained with RLHFStrategy."
        )
    files = meta.get(CHECKPOINT_KEY) or {}
    lora = any(LORA_MARK in key for key in state)
    if lora:
        if ADAPTER_CONFIG not in files:
            raise ValueError(
                f"export_checkpoint({checkpoint!r}): the checkpoint holds LoRA adapters but not their settings "
                f"({ADAPTER_CONFIG}: saved by an earlier version without the ExportActor callback). HINT: "
                "resume it for one step with this version and save again, or train with ExportActor."
            )
        adapter = json.loads(files[ADAPTER_CONFIG])
        if not merge:
            return _save_adapter(state, adapter, files, base, out)
        layers = adapter_layers(list(state))
        if not any(base_layer_weight(layer) in state for layer in layers):  # a sharded checkpoint holds no base
            origin = base or adapter.get("base_model_name_or_path")
            if not origin:
                raise ValueError(
                    f"export_checkpoint({checkpoint!r}, merge=True): the checkpoint holds the adapters but not the "
                    "base model they adapt. HINT: pass base=<the model folder or hub id the run started from> "
                    "(`--base` on the command line)."
                )
            state = _base_weights(origin, set(layers)) | state
        scale = config_scale(adapter)
        state = dict(merge_stream(iter(state.items()), dict.fromkeys(layers, scale), target))
    named = base  # the config and tokenizer: base=, the checkpoint's files, or the base its adapters name
    if named is None and "config.json" not in files and lora:
        named = adapter.get("base_model_name_or_path")
    _write_model_folder(state, files, named, checkpoint, out)
    return out


def _write_model_folder(
    state: dict[str, torch.Tensor], files: dict[str, bytes], named: str | None, checkpoint: str, out: str
) -> None:
    """Save ``state`` as a transformers model folder ``out``, with the config, generation config and tokenizer of
    the model ``named`` (a folder or hub id), or (None) those the checkpoint stored (``files``)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with tempfile.TemporaryDirectory() as tmp:
        source = named if named is None else resolve_model_path(named, setting="export_checkpoint(base=...)")
        if source is None:
            if not files:
                raise ValueError(
                    f"export_checkpoint({checkpoint!r}): the checkpoint has no model config or tokenizer (it was "
                    "saved without the ExportActor callback). HINT: pass base=<the model folder or hub id the run "
                    "started from> (`--base` on the command line)."
                )
            for name, data in files.items():
                Path(tmp, name).write_bytes(data)
            source = tmp
        config = AutoConfig.from_pretrained(source)
        try:
            generation: Any = GenerationConfig.from_pretrained(source)
        except OSError:
            generation = None
        tokenizer = AutoTokenizer.from_pretrained(source)
        _save_pretrained(state, config, generation, tokenizer, out)


# --------------------------------------------------------------------------------------------- helpers
def _checkpoint_meta(checkpoint: str, where: str | None = None) -> dict[str, Any]:
    """The non-tensor part of a checkpoint (a sharded folder's ``meta.pt``; a file, memory-mapped: its tensors are
    read only when used). ``where`` starts the error messages (default: the path)."""
    path, where = Path(checkpoint), where or repr(checkpoint)
    if path.is_dir():
        if not (path / _METADATA).is_file():
            raise FileNotFoundError(
                f"{where}: the folder has no {_METADATA}, so it is not a sharded Lightning checkpoint. HINT: pass the "
                "folder that trainer.save_checkpoint(path) wrote, or a .ckpt file."
            )
        return dict(torch.load(path / _METADATA, map_location="cpu", weights_only=True))
    if path.is_file():
        return dict(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    raise FileNotFoundError(f"{where}: no such checkpoint file or folder.")


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _select(state: Mapping[str, Any], prefix: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: _cast(v, dtype) for k, v in state.items() if k.startswith(prefix)}


def _load_sharded(path: Path, prefix: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The tensors under ``state_dict.<prefix>`` of a ``torch.distributed.checkpoint`` folder, in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    full_prefix = f"state_dict.{prefix}"
    templates = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(full_prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if templates:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)
            dcp.load(templates, storage_reader=reader, no_dist=True)
    return _select(templates, full_prefix, dtype)


def _base_weights(origin: str, adapted: set[str]) -> dict[str, torch.Tensor]:
    """The base model's weights in float32 under a LoRA model's names (``base_model.model.<name>``, an adapted
    layer's under ``<layer>.base_layer``), for merging adapters from a checkpoint that left the base out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_rlhf.engines.train.vision import causal_lm_class

    source = resolve_model_path(origin, setting="export_checkpoint(base=...)")
    auto: Any = causal_lm_class(AutoModelForCausalLM, AutoConfig.from_pretrained(source))
    model = auto.from_pretrained(source, dtype=torch.float32)
    return {wrapped_name(key, adapted): tensor for key, tensor in model.state_dict().items()}


def _save_adapter(
    state: dict[str, torch.Tensor], adapter: dict[str, Any], files: Mapping[str, bytes], base: str | None, out: str
) -> str:
    """Write a LoRA run's adapters as ``peft`` saves them (``adapter_config.json``, ``adapter_model.safetensors``),
    with the run's tokenizer files. Runs on: one process."""
    if base is not None:
        adapter["base_model_name_or_path"] = base
    write_adapter(out, adapter, state)
    for name, data in files.items():
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            Path(out, name).write_bytes(data)
    return out


def _save_pretrained(state: dict[str, torch.Tensor], config: Any, generation: Any, tokenizer: Any, out: Any) -> None:
    """Build the architecture on the meta device, put ``state`` in it (every weight must be used, none left
    over), and write it with ``save_pretrained`` beside the tokenizer. Runs on: one process (rank 0)."""
    from transformers import AutoModelForCausalLM

    from lightning_rlhf.engines.train.vision import causal_lm_class

    with torch.device("meta"):
        model = causal_lm_class(AutoModelForCausalLM, config).from_config(config)  # type: ignore[attr-defined]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left or unexpected:
        raise RuntimeError(
            f"export: the weights do not match the {type(model).__name__} architecture: missing {left or missing}, "
            f"unexpected {unexpected}. HINT: the config (base=...) must be the one the run trained."
        )
    if generation is not None:
        model.generation_config = generation
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _save_processor(tokenizer.name_or_path, config, out)


def _save_processor(source: str, config: Any, out: str) -> None:
    """A vision-language model's processor (image processor, chat template) beside its tokenizer, so that the exported
    folder loads with ``AutoProcessor`` and in vLLM; nothing for a text model. Runs on: one process (rank 0)."""
    from lightning_rlhf.engines.train.vision import is_vision_language

    if not is_vision_language(config) or not os.path.isdir(source):
        return
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(source).save_pretrained(out)
