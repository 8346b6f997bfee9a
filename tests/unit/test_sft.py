"""SFT data: what the loss sees (answer + EOS only; assistant turns only), collation, the data module's checks,
and the actor's token-mean loss on a real tiny model."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from lightning_rlhf import OptimConfig, SFTDataModule, SFTModule
from lightning_rlhf.data.sft import collate_sft, encode_chat, encode_prompt_answer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}</s>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture()
def tok(tiny_model: str):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture()
def chat_tok(tiny_model: str):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def trained_text(tok, ids: list[int], mask: list[int]) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m])


def test_prompt_answer_loss_is_on_answer_and_eos_only(tok) -> None:
    ids, mask = encode_prompt_answer(tok, "3+4=", "7")
    prompt = tok("3+4=", add_special_tokens=True)["input_ids"]
    assert ids[: len(prompt)] == prompt  # the prompt tokenized exactly as RL prompts are
    assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    assert ids[-1] == tok.eos_token_id and mask[-1] == 1
    assert trained_text(tok, ids, mask) == "7" + tok.eos_token


def test_chat_loss_is_on_assistant_turns_only(chat_tok) -> None:
    messages = [
        {"role": "user", "content": "Which is larger, 41 or 19?"},
        {"role": "assistant", "content": "41"},
        {"role": "user", "content": "And 3 or 8?"},
        {"role": "assistant", "content": "8"},
    ]
    ids, mask = encode_chat(chat_tok, messages)
    full = chat_tok.apply_chat_template(messages, tokenize=False)
    assert chat_tok.decode(ids) == full  # the whole rendered chat, nothing added or dropped
    assert trained_text(chat_tok, ids, mask) == "41</s>8</s>"  # each answer and its EOS; not the "\n" after it
    eos_positions = [i for i, t in enumerate(ids) if t == chat_tok.eos_token_id]
    assert [mask[i] for i in eos_positions] == [1, 1]


def test_chat_answer_without_eos_gets_one(tok) -> None:
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    ids, mask = encode_chat(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert ids[-1] == tok.eos_token_id and mask[-1] == 1
    assert trained_text(tok, ids, mask) == "yo\n</s>"  # what the template writes for the turn, then EOS


def test_chat_needs_a_template_with_a_hint(tok) -> None:
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"no chat template.*HINT"):
        encode_chat(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])


def test_chat_needs_an_assistant_turn(chat_tok) -> None:
    with pytest.raises(ValueError, match="assistant turn"):
        encode_chat(chat_tok, [{"role": "user", "content": "hi"}])


def test_collate_right_pads(tok) -> None:
    rows = [dict(zip(("input_ids", "loss_mask"), encode_prompt_answer(tok, p, a), strict=True)) for p, a in
            [("1+1=", "2"), ("9+9=", "18")]]  # fmt: skip
    for r, text in zip(rows, ["x", "y"], strict=True):
        r["prompt"] = text
    batch = collate_sft(rows, pad_token_id=tok.pad_token_id)
    lengths = [len(r["input_ids"]) for r in rows]
    assert batch["input_ids"].shape == (2, max(lengths))
    assert batch["attention_mask"].sum(-1).tolist() == lengths
    assert batch["loss_mask"].sum(-1).tolist() == [sum(r["loss_mask"]) for r in rows]
    assert batch["prompt"] == ["x", "y"]


def test_datamodule_prompt_answer_and_chat_columns(tiny_model: str, tmp_path: Path) -> None:
    data = datasets.Dataset.from_dict({"question": ["1+2=", "3+4=", "5+1=", "2+2="], "solution": ["3", "7", "6", "4"]})
    dm = SFTDataModule(data, batch_size=2, val_size=2, prompt_column="question", answer_column="solution",
                       tokenizer=tiny_model)  # fmt: skip
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch.tensors) == {"input_ids", "attention_mask", "loss_mask"} and len(batch) == 2
    assert len(dm.val_dataloader()) == 1

    with pytest.raises(KeyError, match=r"answer_column='answer'.*HINT"):
        SFTDataModule(data, batch_size=2, prompt_column="question", tokenizer=tiny_model).setup("fit")
    chats = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "yo"}]] * 2})  # fmt: skip
    SFTDataModule(chats, batch_size=2, messages_column="messages", tokenizer=tiny_model).setup("fit")  # templated
    plain = AutoTokenizer.from_pretrained(tiny_model)
    plain.chat_template = None  # a base model's tokenizer
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"no chat template.*HINT"):
        SFTDataModule(chats, batch_size=2, messages_column="messages", tokenizer=str(tmp_path / "plain")).setup("fit")


def test_sft_step_is_a_token_mean_and_learns(tiny_model: str, tok) -> None:
    """The actor's SFT step (one process, unsharded): its loss equals the mean over answer tokens of the
    cross-entropy computed by hand, whatever the micro-batching, and repeated steps lower it."""
    rows = [dict(zip(("input_ids", "loss_mask"), encode_prompt_answer(tok, f"{a}+{b}=", str(a + b)), strict=True))
            for a in range(4) for b in range(2)]  # fmt: skip
    batch = collate_sft(rows, pad_token_id=tok.pad_token_id)
    losses = []
    for micro in (8, 3):
        module = SFTModule(tiny_model, optim=OptimConfig(lr=1e-3), micro_batch_size=micro)
        module.configure_model()
        module.actor.configure_optimizer(10)
        model = module.actor.model
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
            mask = batch["loss_mask"][:, 1:].float()
            expected = float((ce * mask).sum() / mask.sum())
        out = module.actor.sft_step(batch)
        assert out["sft/loss"] == pytest.approx(expected, rel=1e-5)
        assert out["sft/tokens"] == float(mask.sum())
        losses.append([out["sft/loss"]] + [module.actor.sft_step(batch)["sft/loss"] for _ in range(5)])
        assert module.actor.sft_loss(batch)["tokens"] == float(mask.sum())
    assert losses[0][-1] < losses[0][0] - 0.5
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)  # micro-batching does not change the math


def test_sft_command_builds_the_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_rlhf import ExportActor
    from lightning_rlhf.cli import SFTCLI
    from tests.conftest import ROOT

    monkeypatch.setenv("LIGHTNING_RLHF_CACHE", str(tmp_path / "cache"))  # tiny-random is built there
    monkeypatch.chdir(ROOT)
    cli = SFTCLI(["--config", "recipes/sft_demo.yaml", "--trainer.logger.init_args.save_dir", str(tmp_path)], run=False)
    assert isinstance(cli.model, SFTModule) and isinstance(cli.datamodule, SFTDataModule)
    assert cli.model.actor.needs_rollout_engine is False and cli.model.algorithm.batching.micro_batch_size == 64
    assert cli.model.validation_config.before_train
    assert any(isinstance(c, ExportActor) for c in cli.trainer.callbacks)
    assert cli.config.get("ckpt_path") is None


def test_run_summary_reports_validation_before_and_after() -> None:
    from lightning_rlhf import RunSummary

    summary = RunSummary()
    assert summary.validation_line() is None
    summary.validations = {"val/score/mean": [(0, 0.25), (250, 0.55)]}
    line = summary.validation_line()
    assert line == "  validation (val/score/mean): 0.250 before training (step 0) -> 0.550 at step 250"
    restored = RunSummary()
    restored.load_state_dict(summary.state_dict())  # a resumed run keeps the first validation
    assert restored.validation_line() == line


# ------------------------------------------------------------------ max_length against the model's positions
def model_with_positions(folder: Path, positions: int) -> str:
    """The tiny model with ``positions`` positions (``max_position_embeddings`` in its config)."""
    from transformers import AutoConfig

    from lightning_rlhf.demo import save_tiny

    path = save_tiny(str(folder), seed=0)
    config = AutoConfig.from_pretrained(path)
    config.max_position_embeddings = positions
    config.save_pretrained(path)
    return path


def rows_of(tok, count: int, tokens: int) -> list[dict[str, str]]:
    """``count`` prompt/answer rows of exactly ``tokens`` tokens each (prompt + answer + EOS)."""
    rows = []
    for i in range(count):
        prompt = f"{i}="
        while len(encode_prompt_answer(tok, prompt, "7")[0]) < tokens:  # one character (at most a token) at a time
            prompt = ("+" if len(prompt) % 2 else str(i)) + prompt  # "i+i+...+i="
        assert len(encode_prompt_answer(tok, prompt, "7")[0]) == tokens
        rows.append({"prompt": prompt, "answer": "7"})
    return rows


def test_sft_refuses_max_length_past_the_model_positions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok) -> None:
    """The user's run: `lightning-rlhf sft` with `max_length: 80` on a 64-position model and 66-token rows trained
    without a word. Now `fit` stops in setup, before the data is read or any weights load, naming the setting,
    its value, the model's positions and the fix; `max_length: null` takes the positions and drops the long rows."""
    import json

    from lightning_rlhf.cli import SFTCLI
    from tests.conftest import ROOT

    model = model_with_positions(tmp_path / "model64", 64)
    data = tmp_path / "train.jsonl"
    short = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)][:8]
    data.write_text("\n".join(json.dumps(r) for r in rows_of(tok, 4, 66) + short))
    monkeypatch.chdir(ROOT)  # the recipe's validation file is relative
    args = ["--config", "recipes/sft_demo.yaml", "--model.actor", model, "--data.train", str(data),
            "--data.batch_size", "8", "--model.micro_batch_size", "8", "--trainer.max_steps", "1",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]  # fmt: skip

    cli = SFTCLI([*args, "--data.max_length", "80"], run=False)
    with pytest.raises(ValueError) as caught:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    message = str(caught.value)
    assert "SFTDataModule(max_length=80)" in message and "max_position_embeddings=64" in message, message
    assert "HINT: set SFTDataModule(max_length=) to at most 64 (`--data.max_length 64`)" in message, message
    assert cli.model.actor.model is None and cli.datamodule._rows is None  # before any weights or data loaded

    cli = SFTCLI([*args, "--data.max_length", "null"], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.datamodule._length_limit == 64
    assert [len(r["input_ids"]) for r in cli.datamodule._rows] == [len(encode_prompt_answer(tok, r["prompt"],
            r["answer"])[0]) for r in short]  # fmt: skip  # the 66-token rows were dropped, the rest trained
    assert cli.trainer.global_step == 1


def test_max_length_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"SFTDataModule\(max_length=0\) must be >= 1"):
        SFTDataModule("train.jsonl", max_length=0)


# ------------------------------------------------------------------ exporting the best validation, not the last
def actor_weights(module: SFTModule) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    state = module.actor.model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def folder_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def test_export_takes_the_best_validation_not_the_last(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The user's run: `val/loss` best at an early validation, worse at the last step. ExportActor(monitor=
    "val/loss", mode="min") writes the weights of that validation's step, says so, and `lightning-rlhf export
    --best true` takes ModelCheckpoint's best checkpoint to the same weights.

    The data makes the early step best: the first 2 batches teach the validation answers, the next 4 teach other
    answers to the same prompts (no shuffling)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_rlhf import ExportActor, RLHFStrategy
    from lightning_rlhf.cli import main

    pairs = [(a, b) for a in range(3) for b in range(3)][:8]
    right = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    wrong = [{"prompt": f"{a}+{b}=", "answer": str((a + b + 5) % 10)} for a, b in pairs]
    train = datasets.Dataset.from_list(right * 2 + wrong * 4)
    val = datasets.Dataset.from_list(right)

    class Record(Callback):  # the actor's weights at each validation, by step
        def __init__(self) -> None:
            self.weights: dict[int, dict[str, torch.Tensor]] = {}

        def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.weights[trainer.global_step] = actor_weights(pl_module)

    record = Record()
    export = ExportActor(str(tmp_path / "best"), monitor="val/loss", mode="min")
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", monitor="val/loss", mode="min", save_top_k=1, save_last=True)
    module = SFTModule(tiny_model, optim=OptimConfig(lr=1e-2), micro_batch_size=8, validate_before_train=True)
    data = SFTDataModule(train, val=val, batch_size=8, shuffle=False, max_length=32)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=RLHFStrategy("hf"), max_steps=6, val_check_interval=2,
        check_val_every_n_epoch=None, logger=CSVLogger(tmp_path, name="", version=""), log_every_n_steps=1,
        callbacks=[record, export, checkpoints], enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)

    import csv

    with open(tmp_path / "metrics.csv") as f:
        val_loss = {int(float(r["step"])): float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")}
    assert sorted(val_loss) == [0, 2, 4, 6] == sorted(record.weights)
    best = min(val_loss, key=val_loss.__getitem__)
    assert best == 2 and val_loss[6] > val_loss[2] + 0.1, val_loss  # the premise: the last step is worse

    exported = folder_weights(tmp_path / "best")
    assert exported.keys() <= record.weights[best].keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, record.weights[best][name]), name  # that step's weights, bit for bit
    assert any(not torch.equal(t, record.weights[6][n]) for n, t in exported.items())  # not the last step's
    assert export.best_step == best and export.best_score == pytest.approx(val_loss[best], rel=1e-5)
    assert export.export_reason is not None and export.export_reason.startswith(
        f"step 2, the best val/loss (min) of 4 validations: {val_loss[best]:.4f}; training ended at step 6"
    )

    main(["export", str(tmp_path / "ckpt" / "last.ckpt"), str(tmp_path / "from_ckpt"), "--best", "true"])
    printed = capsys.readouterr().out
    assert "best checkpoint: " in printed and "(step 2: the best val/loss=" in printed and "mode min)" in printed
    for name, tensor in folder_weights(tmp_path / "from_ckpt").items():
        assert torch.equal(tensor, record.weights[best][name]), name


def test_export_monitor_settings_are_checked() -> None:
    from lightning_rlhf import ExportActor

    with pytest.raises(ValueError, match=r"ExportActor\(mode='lowest'\)"):
        ExportActor(monitor="val/loss", mode="lowest")
    with pytest.raises(ValueError, match=r"export_on_fit_end=False.*HINT"):
        ExportActor(monitor="val/loss", export_on_fit_end=False)

    # A resumed run keeps the best value, its step and folder: a worse validation after resuming exports nothing.
    before = ExportActor(monitor="val/loss")
    before.best_score, before.best_step, before.last_export = 0.39, 50, "/runs/sft/actor"
    after = ExportActor(monitor="val/loss")
    after.load_state_dict(before.state_dict())
    assert (after.best_score, after.best_step, after.last_export) == (0.39, 50, "/runs/sft/actor")
    other = ExportActor(monitor="val/score/mean", mode="max")  # another metric's state is not taken
    other.load_state_dict(before.state_dict())
    assert other.best_score is None and other.state_key != before.state_key
    assert ExportActor().state_dict() == {}  # nothing to keep without a monitor
