"""Exporting the actor from a single-file checkpoint (the sharded folder is covered in tests/distributed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf.checkpoint.export import ACTOR_PREFIX, CHECKPOINT_KEY, export_checkpoint, resolve_dtype


def _files(model_dir: str) -> dict[str, bytes]:
    """What ExportActor stores in a checkpoint: the model folder's files other than the weights."""
    return {p.name: p.read_bytes() for p in Path(model_dir).iterdir() if not p.name.endswith(".safetensors")}


def _checkpoint(tmp_path: Path, model_dir: str, *, files: bool = True, extra: dict | None = None) -> tuple[Path, dict]:
    """A checkpoint as RLHFStrategy(save_distributed_checkpoint=False) writes it: the module's state under
    ``state_dict`` (actor, and here a critic to ignore), weights perturbed so they differ from ``model_dir``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for param in model.parameters():  # tied embeddings stay one tensor, as in a real run
            param.add_(0.01 * torch.randn_like(param))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    module_state = {ACTOR_PREFIX + k: v for k, v in state.items()} | {"critic.model.score.weight": torch.ones(1, 4)}
    module_state |= extra or {}
    ckpt = {"state_dict": module_state, "global_step": 2} | ({CHECKPOINT_KEY: _files(model_dir)} if files else {})
    path = tmp_path / "last.ckpt"
    torch.save(ckpt, path)
    return path, state


def test_single_file_checkpoint_round_trip(tiny_model: str, tmp_path: Path) -> None:
    path, state = _checkpoint(tmp_path, tiny_model)
    out = export_checkpoint(str(path), str(tmp_path / "hf"))
    assert {p.name for p in Path(out).iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_dtype_and_base(tiny_model: str, tmp_path: Path) -> None:
    path, state = _checkpoint(tmp_path, tiny_model, files=False)
    with pytest.raises(ValueError, match=r"saved without the ExportActor callback\). HINT: pass base="):
        export_checkpoint(str(path), str(tmp_path / "hf"))
    out = export_checkpoint(str(path), str(tmp_path / "hf"), base=tiny_model, dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    weight = model.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(weight, state["model.embed_tokens.weight"].to(torch.bfloat16))


def test_weights_that_do_not_fit_the_config_fail(tiny_model: str, tmp_path: Path) -> None:
    path, _ = _checkpoint(
        tmp_path, tiny_model, extra={ACTOR_PREFIX + "model.layers.9.mlp.up_proj.weight": torch.ones(2)}
    )
    with pytest.raises(RuntimeError, match=r"unexpected \['model.layers.9.mlp.up_proj.weight'\]"):
        export_checkpoint(str(path), str(tmp_path / "hf"))


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such checkpoint file or folder"):
        export_checkpoint(str(tmp_path / "missing.ckpt"), str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match=r"has no meta\.pt"):
        export_checkpoint(str(tmp_path), str(tmp_path / "hf"))
    torch.save({"state_dict": {"model.weight": torch.ones(1)}}, tmp_path / "other.ckpt")
    with pytest.raises(KeyError, match=r"no weights under 'actor\.model\.'"):
        export_checkpoint(str(tmp_path / "other.ckpt"), str(tmp_path / "hf"))
    assert resolve_dtype("torch.float16") == torch.float16 and resolve_dtype(None) is None
    with pytest.raises(ValueError, match="export dtype='int8' is not supported"):
        resolve_dtype("int8")
