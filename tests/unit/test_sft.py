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
    with pytest.raises(ValueError, match=r"no chat template.*HINT"):
        SFTDataModule(chats, batch_size=2, messages_column="messages", tokenizer=tiny_model).setup("fit")


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
    assert cli.model.needs_rollout_engine is False and cli.model.algorithm.micro_batch_size == 64
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
