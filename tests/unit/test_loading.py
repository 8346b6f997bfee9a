"""Deferred (meta-device) loading + ``materialize``: bit-identical to ``from_pretrained``, sharded over 2 ranks,
and clear errors for incomplete checkpoints."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PreTrainedModel,
)

from lightning_rlhf.demo.tiny import INIT_STD
from lightning_rlhf.engines.train.loading import (
    deferred_loading,
    load_pretrained,
    loading_deferred,
    materialize,
    needs_materialize,
    safetensors_index,
)
from tests.conftest import ROOT, SCRIPTS, failure_text

IDS = torch.tensor([[1, 5, 9, 14, 30, 2, 0], [1, 7, 7, 40, 41, 42, 2]])


def _deferred(auto: type, path: str, **kwargs: object) -> tuple[nn.Module, object]:
    model = load_pretrained(auto, path, setting="test(model=...)", deferred=True, **kwargs)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # rotary inv_freq is built for real
    assert needs_materialize(model)
    report = materialize(model, device="cpu")
    assert not needs_materialize(model)
    return model, report


def _assert_same_tensors(got: nn.Module, want: nn.Module, *, skip: tuple[str, ...] = ()) -> None:
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert got_sd.keys() == want_sd.keys()
    for name, tensor in want_sd.items():
        if name.startswith(skip):
            continue
        assert got_sd[name].dtype == tensor.dtype, name
        assert torch.equal(got_sd[name], tensor), name


def _save_untied(tiny_model: str, out: Path) -> str:
    """The tiny causal LM's config with untied embeddings, a fresh random model, saved with its tokenizer."""
    config = AutoConfig.from_pretrained(tiny_model, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model) / name, out / name)
    return str(out)


def test_causal_lm_tied_is_bit_identical(tiny_model: str) -> None:
    want = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    got, report = _deferred(AutoModelForCausalLM, tiny_model)
    assert got.lm_head.weight is got.model.embed_tokens.weight  # still one tied parameter
    _assert_same_tensors(got, want)
    assert report.fresh == [] and report.tensors == len(list(want.parameters()))
    assert report.bytes_read == report.checkpoint_bytes == sum(p.numel() * 4 for p in want.parameters())
    assert report.local_bytes == report.bytes_read
    assert not got.training and got.generation_config.pad_token_id == want.generation_config.pad_token_id
    with torch.no_grad():
        assert torch.equal(got(input_ids=IDS).logits, want(input_ids=IDS).logits)


def test_causal_lm_untied_is_bit_identical(tiny_model: str, tmp_path: Path) -> None:
    path = _save_untied(tiny_model, tmp_path / "untied")
    want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    got, report = _deferred(AutoModelForCausalLM, path)
    assert got.lm_head.weight is not got.model.embed_tokens.weight
    assert not torch.equal(got.lm_head.weight, got.model.embed_tokens.weight)
    _assert_same_tensors(got, want)
    assert report.tensors == len(list(want.parameters())) == 27
    with torch.no_grad():
        assert torch.equal(got(input_ids=IDS).logits, want(input_ids=IDS).logits)


def test_bf16_storage_matches_from_pretrained(tiny_model: str) -> None:
    want = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    got, report = _deferred(AutoModelForCausalLM, tiny_model, dtype=torch.bfloat16)
    assert {p.dtype for p in got.parameters()} == {torch.bfloat16}
    _assert_same_tensors(got, want)
    assert report.local_bytes * 2 == report.bytes_read  # read float32, stored bfloat16
    with torch.no_grad():
        assert torch.equal(got(input_ids=IDS).logits, want(input_ids=IDS).logits)


def test_sequence_classifier_is_bit_identical(tiny_classifier: str) -> None:
    want = AutoModelForSequenceClassification.from_pretrained(tiny_classifier, num_labels=1, dtype=torch.float32)
    got, report = _deferred(AutoModelForSequenceClassification, tiny_classifier, num_labels=1)
    assert report.fresh == []  # the checkpoint is a classifier: its score head is read, not made up
    _assert_same_tensors(got, want)
    with torch.no_grad():
        assert torch.equal(got(input_ids=IDS).logits, want(input_ids=IDS).logits)


def test_token_classifier_from_causal_lm_gets_a_fresh_deterministic_head(tiny_model: str) -> None:
    want = AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.float32)
    got, report = _deferred(AutoModelForTokenClassification, tiny_model, num_labels=1)
    again, _ = _deferred(AutoModelForTokenClassification, tiny_model, num_labels=1)
    assert sorted(report.fresh) == ["score.bias", "score.weight"]
    _assert_same_tensors(got, want, skip=("score.",))  # the backbone is the checkpoint's
    assert torch.equal(got.score.weight, again.score.weight)  # same head every time (and on every rank)
    assert torch.equal(got.score.bias, torch.zeros(1))
    std = float(got.score.weight.detach().std())
    assert got.score.weight.shape == (1, 128) and 0.5 * INIT_STD < std < 1.5 * INIT_STD
    assert report.tensors == len(list(want.parameters())) - 2
    with torch.no_grad():
        assert torch.equal(got.model(input_ids=IDS).last_hidden_state, want.model(input_ids=IDS).last_hidden_state)


def test_sharded_checkpoint_and_base_model_prefix(tiny_model: str, tmp_path: Path) -> None:
    from transformers import AutoModel

    want = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    want.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got, _ = _deferred(AutoModelForCausalLM, str(tmp_path / "sharded"))
    _assert_same_tensors(got, want)
    # a bare Qwen2Model from the causal LM's checkpoint: its `layers.*` are the checkpoint's `model.layers.*`
    base, report = _deferred(AutoModel, tiny_model)
    _assert_same_tensors(base, want.model)
    assert report.fresh == []


def test_not_deferred_is_from_pretrained_and_the_context_switches_it(tiny_model: str) -> None:
    assert not loading_deferred()
    plain = load_pretrained(AutoModelForCausalLM, tiny_model, setting="x")
    assert not any(p.is_meta for p in plain.parameters())
    _assert_same_tensors(plain, AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    with deferred_loading():
        assert loading_deferred()
        with deferred_loading(False):
            assert not loading_deferred()
        lazy = load_pretrained(AutoModelForCausalLM, tiny_model, setting="x")
    assert not loading_deferred()
    assert all(p.is_meta for p in lazy.parameters())
    with pytest.raises(ValueError, match=r"not built by load_pretrained\(\.\.\., deferred=True\)"):
        materialize(plain, device="cpu")


def _copy_without(src: str, dst: Path, drop: str) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    assert drop in tensors
    del tensors[drop]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_missing_tensor_is_a_clear_error_at_load_time(tiny_model: str, tiny_classifier: str, tmp_path: Path) -> None:
    broken = _copy_without(tiny_model, tmp_path / "broken", "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError) as err:
        load_pretrained(AutoModelForCausalLM, broken, setting="CriticRole(path=...)", deferred=True)
    text = str(err.value)
    assert "CriticRole(path=...)" in text and broken in text and "model.layers.1.mlp.up_proj.weight" in text
    assert "HINT" in text
    # a classifier checkpoint without its head is broken too (the head is not new for this class)
    headless = _copy_without(tiny_classifier, tmp_path / "headless", "score.weight")
    with pytest.raises(ValueError, match=r"missing from the checkpoint: score\.weight"):
        load_pretrained(AutoModelForSequenceClassification, headless, setting="reward", deferred=True, num_labels=1)


def test_missing_files_and_wrong_shapes(tiny_model: str, tmp_path: Path) -> None:
    empty = tmp_path / "nofiles"
    shutil.copytree(tiny_model, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"actor=.*no model.safetensors.*HINT"):
        load_pretrained(AutoModelForCausalLM, str(empty), setting="actor", deferred=True)
    with pytest.raises(
        ValueError,
        match=r"shapes differ: model\.layers\.0\.mlp\.gate_proj\.weight \(checkpoint \[256, 128\], model \[320, 128\]",
    ):
        load_pretrained(AutoModelForCausalLM, tiny_model, setting="actor", deferred=True, intermediate_size=320)
    entries = safetensors_index(tiny_model)
    assert entries["model.embed_tokens.weight"].shape == (384, 128)


def test_corrupt_files_and_unreadable_dtypes_are_clear_errors(tiny_model: str, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_model, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"critic=.*not a readable safetensors file.*HINT"):
        load_pretrained(AutoModelForCausalLM, str(truncated), setting="critic", deferred=True)
    # a tensor in a dtype deferred loading does not read (U16) is named, with the way out
    odd = tmp_path / "odd"
    shutil.copytree(tiny_model, odd)
    tensors = load_file(str(odd / "model.safetensors"))
    tensors["model.norm.weight"] = torch.zeros(tensors["model.norm.weight"].shape, dtype=torch.uint16)
    save_file(tensors, str(odd / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*dtype U16.*HINT: use RLHFStrategy\(sharded_loading"):
        load_pretrained(AutoModelForCausalLM, str(odd), setting="actor", deferred=True)
    # a sharded checkpoint with a file of its index missing
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "sharded" / lost).unlink()
    with pytest.raises(
        FileNotFoundError, match=re.escape(lost) + r" \(listed in model\.safetensors\.index\.json\) is missing.*HINT"
    ):
        load_pretrained(AutoModelForCausalLM, str(tmp_path / "sharded"), setting="actor", deferred=True)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_no_checkpoint_file_stays_mapped(tiny_model: str, tmp_path: Path) -> None:
    """The files are read through memory maps, whose pages count in the resident size: each is dropped after its
    tensor, so none is left once materialize returns (and at most one tensor's rows are mapped at a time)."""
    copy = tmp_path / "mapped"
    shutil.copytree(tiny_model, copy)
    model = load_pretrained(AutoModelForCausalLM, str(copy), setting="actor", deferred=True)
    report = materialize(model, device="cpu")
    assert report.bytes_read == report.checkpoint_bytes > 0
    maps = Path("/proc/self/maps").read_text()
    assert str(copy / "model.safetensors") not in maps


def test_two_ranks_each_read_their_rows(tiny_model: str, tiny_classifier: str) -> None:
    cases = [f"causal:float32:{tiny_model}", f"token:bfloat16:{tiny_model}", f"seq:float32:{tiny_classifier}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*cmd, str(SCRIPTS / "sharded_load.py"), *cases], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, failure_text(proc)
    lines = {(p[1], p[2]): p[3:] for p in (line.split() for line in proc.stdout.splitlines()) if p[:1] == ["OK"]}
    assert len(lines) == 6, proc.stdout
    for kind in ("causal", "token", "seq"):
        read = [int(lines[(kind, r)][0]) for r in ("0", "1")]
        total = int(lines[(kind, "0")][1])
        assert sum(read) == total  # together the ranks read the checkpoint once, no byte twice
        assert all(0.45 * total <= r <= 0.55 * total for r in read), (kind, read, total)
    assert lines[("token", "0")][3] == "score.weight,score.bias"
    # bfloat16 shards hold half the bytes they read (the checkpoint is float32)
    assert int(lines[("token", "1")][2]) * 2 == int(lines[("token", "1")][0])


def test_loaded_model_is_a_pretrained_model(tiny_model: str) -> None:
    got, _ = _deferred(AutoModelForCausalLM, tiny_model)
    assert isinstance(got, PreTrainedModel) and got.name_or_path == tiny_model
