"""A LoRA run's checkpoint written by ``trainer.save_checkpoint`` (the documented path, no ExportActor callback)
exports as peft's adapter folder and as the merged model: the checkpoint carries the adapter settings and the base
model's name (RLHFStrategy.save_checkpoint)."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf import OptimConfig, SFTDataModule, SFTModule
from lightning_rlhf.cli import main


@pytest.fixture
def lora_checkpoint(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two supervised LoRA steps in one process, then ``trainer.save_checkpoint`` (sharded, the default). Function
    scope: conftest's autouse fixture then ends the run's process group and restores ``MASTER_PORT`` after the test
    (a module-scoped fit ran before it and left its port to every later script of this pytest worker)."""
    import lightning as L

    from lightning_rlhf import RLHFStrategy

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    module = SFTModule(tiny_model, optim=OptimConfig(lr=5e-2), micro_batch_size=8, lora={"r": 4, "lora_alpha": 8})
    data = SFTDataModule(datasets.Dataset.from_list(rows), batch_size=8, max_length=32)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=RLHFStrategy("hf"), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    path = tmp_path_factory.mktemp("lora_ckpt") / "step2"
    trainer.save_checkpoint(path)
    return path


def test_a_saved_lora_checkpoint_exports_without_the_export_callback(
    lora_checkpoint: Path, tiny_model: str, tmp_path: Path
) -> None:
    from peft import PeftModel

    main(["export", str(lora_checkpoint), str(tmp_path / "adapter")])
    main(["export", str(lora_checkpoint), str(tmp_path / "merged"), "--merge"])  # a flag, as flags are
    main(["export", str(lora_checkpoint), str(tmp_path / "merged_base"), "--merge", "true", "--base", tiny_model])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "adapter")
    assert adapted.peft_config["default"].lora_alpha == 8
    ids = torch.tensor([[5, 17, 9, 30, 6], [7, 8, 9, 10, 11]])
    with torch.no_grad():
        want = adapted(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model)(ids).logits
        for name in ("merged", "merged_base"):
            served = AutoModelForCausalLM.from_pretrained(tmp_path / name)(ids).logits
            torch.testing.assert_close(served, want, rtol=1e-5, atol=1e-5)
    assert (want - base).abs().max() > 1e-4  # two steps moved the adapters


def test_export_flags_take_the_flag_and_the_old_true_false_form() -> None:
    from lightning_rlhf.cli import export_flags, export_parser

    parser = export_parser()
    for given, merge in ((["--merge"], True), (["--merge", "true"], True), (["--merge", "false"], False), ([], False)):
        parsed = parser.parse_args(export_flags(["CKPT", "OUT", *given]))
        assert (parsed.merge, parsed.best, parsed.checkpoint) == (merge, False, "CKPT"), given
    parsed = parser.parse_args(export_flags(["--best", "CKPT", "OUT", "--merge"]))
    assert (parsed.best, parsed.merge, parsed.checkpoint, parsed.out) == (True, True, "CKPT", "OUT")


def test_export_help_says_what_it_does_in_a_whole_sentence() -> None:
    from lightning_rlhf.cli import export_parser

    description = export_parser().description or ""
    assert description.endswith(".") and "merged model" in description, description
