"""Prompt data: validation errors before any model loads, filtering, and the resumable position."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from lightning_rlhf.data import PromptDataModule


def dm(train, tok_path: str, **kw) -> PromptDataModule:
    m = PromptDataModule(train, tokenizer=tok_path, **kw)
    m.setup("fit")
    return m


def test_missing_prompt_column(tiny_model: str) -> None:
    ds = datasets.Dataset.from_dict({"question": ["1+1="] * 4})
    with pytest.raises(KeyError, match=r"prompt_column='prompt'.*Columns: \['question'\]"):
        dm(ds, tiny_model, batch_size=2)
    assert len(dm(ds, tiny_model, batch_size=2, prompt_column="question")._rows) == 4


def test_dataset_column_clashing_with_rollout_columns(tiny_model: str) -> None:
    ds = datasets.Dataset.from_dict({"prompt": ["1+1="] * 2, "scores": [1, 2]})
    with pytest.raises(ValueError, match=r"dataset columns \['scores'\] clash"):
        dm(ds, tiny_model, batch_size=1)


def test_empty_prompt_names_the_row(tiny_model: str) -> None:
    ds = datasets.Dataset.from_dict({"prompt": ["1+1=", "  ", "2+2="]})
    with pytest.raises(ValueError, match=r"row 1 has an empty or non-text prompt"):
        dm(ds, tiny_model, batch_size=1)


def test_overlong_prompts_filtered_with_count_or_rejected(tiny_model: str, capsys) -> None:
    ds = datasets.Dataset.from_dict({"prompt": ["1+1=", "12345678+1=", "2+2="]})
    m = dm(ds, tiny_model, batch_size=1, max_prompt_length=6)
    assert [r["prompt"] for r in m._rows] == ["1+1=", "2+2="]
    with pytest.raises(ValueError, match=r"row 1 has 12 prompt tokens > max_prompt_length=6"):
        dm(ds, tiny_model, batch_size=1, max_prompt_length=6, overlong="error")
    with pytest.raises(ValueError, match=r"0 prompts left after filtering"):
        dm(ds, tiny_model, batch_size=1, max_prompt_length=2)


def test_files_and_missing_file(tiny_model: str, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(6)))
    m = dm(str(path), tiny_model, batch_size=3)
    batch = next(iter(m.train_dataloader()))
    assert batch["prompts"].shape[0] == 3 and set(batch.columns) == {"prompt", "answer"}
    assert batch["uid"].tolist() == [0, 1, 2]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    # Left padding: every row ends with its last prompt token.
    assert batch["prompt_mask"][:, -1].tolist() == [1, 1, 1] and tok.pad_token_id is not None
    with pytest.raises(FileNotFoundError, match="no such file"):
        dm(str(tmp_path / "missing.jsonl"), tiny_model)


def test_loader_resumes_after_the_last_consumed_batch(tiny_model: str) -> None:
    ds = datasets.Dataset.from_dict({"prompt": [f"{i}+0=" for i in range(10)]})

    def loader():
        return dm(ds, tiny_model, batch_size=2, seed=5).train_dataloader()

    first = loader()
    straight = [b["prompt"] for b in first] + [b["prompt"] for b in first]  # two epochs, reshuffled
    assert straight[:5] != straight[5:]
    interrupted = loader()
    it = iter(interrupted)
    fetched = [next(it) for _ in range(3)]  # a prefetching trainer fetched 3 batches ...
    interrupted.mark_consumed(fetched[1])  # ... but trained on 2 when the checkpoint was saved
    state = interrupted.state_dict()
    assert state == {"epoch": 0, "consumed": 2}
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b["prompt"] for b in resumed] + [b["prompt"] for b in resumed]
    assert rest == straight[2:]


def test_end_of_epoch_position_moves_to_next_epoch(tiny_model: str) -> None:
    ds = datasets.Dataset.from_dict({"prompt": [f"{i}+0=" for i in range(4)]})
    loader = dm(ds, tiny_model, batch_size=2).train_dataloader()
    last = list(loader)[-1]
    loader.mark_consumed(last)
    assert loader.state_dict() == {"epoch": 1, "consumed": 0}


# ------------------------------------------------------------------------------------------ chat prompts
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}*{% endif %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}-{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)
"""A tiny template of single-character markers: ``*`` opens a system message, ``-`` closes an assistant turn,
and the generation prompt is ``=``."""


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model's tokenizer with a chat template, saved like an instruct model's."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("chat_tok")
    tok.save_pretrained(path)
    return str(path)


def test_chat_column_rendered_with_the_template_and_last_user_message_as_prompt(chat_tokenizer: str) -> None:
    chats = [
        [{"role": "system", "content": "1"}, {"role": "user", "content": "2+3"}],
        [{"role": "user", "content": "4+4"}, {"role": "assistant", "content": "8"}, {"role": "user", "content": "9"}],
    ]
    ds = datasets.Dataset.from_dict({"messages": chats, "answer": ["5", "9"]})
    m = dm(ds, chat_tokenizer, batch_size=2, messages_column="messages", shuffle=False)
    batch = next(iter(m.train_dataloader()))
    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    for row, mask, rendered in zip(batch["prompts"], batch["prompt_mask"], ["*12+3=", "4+48-9="], strict=True):
        assert row[mask.bool()].tolist() == tok(rendered, add_special_tokens=False)["input_ids"]  # no <s> added
    assert batch["prompt"] == ["2+3", "9"]  # reward functions get the last user message's text
    assert batch["messages"] == chats and batch["answer"] == ["5", "9"]  # and the chat itself, by its name
    assert batch.meta["chat_prompt"] and batch.meta["messages_column"] == "messages"  # a reward model renders it
    # The same rendering as a text prompt with chat_template=True (one user message).
    text = dm(datasets.Dataset.from_dict({"prompt": ["2+3"] * 2}), chat_tokenizer, batch_size=2, chat_template=True)
    assert text._rows[0]["prompt_ids"] == tok("2+3=", add_special_tokens=False)["input_ids"]
    meta = next(iter(text.train_dataloader())).meta
    assert meta["chat_prompt"] and meta["messages_column"] is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ('[{"role": "user", "content": "1+1"}]', "it is a string"),
        ([], "it is list"),
        ([{"role": "user"}], r"message 0 \('user'\) has content None, not text"),
        ([{"content": "1+1"}], "message 0 is .*without a text 'role'"),
        ([{"role": "system", "content": "1"}], r"no message has role 'user' \(roles: \['system'\]\)"),
        ([{"role": "user", "content": "  "}], "the last 'user' message is empty"),
    ],
)
def test_chat_column_in_the_wrong_shape_names_the_row(chat_tokenizer: str, value, problem: str) -> None:
    rows = [value] if isinstance(value, str) else [[{"role": "user", "content": "2+2"}], value]  # JSON text: all str
    ds = datasets.Dataset.from_dict({"messages": rows})
    row = len(rows) - 1
    with pytest.raises(
        ValueError, match=rf"messages_column='messages'\): row {row} of the training data is not a chat: {problem}"
    ):
        dm(ds, chat_tokenizer, batch_size=1, messages_column="messages")


def test_chat_without_a_template_or_that_the_template_rejects(tiny_model: str, tmp_path: Path) -> None:
    ds = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "1+1"}]]})
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = None  # a base model's tokenizer (the tiny one has a template)
    tok.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        dm(ds, str(tmp_path / "plain"), batch_size=1, messages_column="messages")
    tok.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"chat template failed on row 0 .*roles must alternate"):
        dm(ds, str(tmp_path), batch_size=1, messages_column="messages")
    with pytest.raises(KeyError, match=r"messages_column='chat'\): the training data has no such column"):
        dm(ds, str(tmp_path), batch_size=1, messages_column="chat")


# ------------------------------------------------------------------------------------------- validation
def addition(n: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {"prompt": [f"{i}+1=" for i in range(n)], "answer": [str(i + 1) for i in range(n)]}
    )


def test_val_size_splits_the_same_rows_off_for_a_seed(tiny_model: str) -> None:
    ds = addition(20)
    for size in (5, 0.25):
        m = dm(ds, tiny_model, batch_size=2, val_size=size, seed=3)
        train, val = [r["prompt"] for r in m._rows], [r["prompt"] for r in m._val_rows]
        assert (len(train), len(val)) == (15, 5)
        assert sorted(train + val) == sorted(ds["prompt"])  # disjoint, nothing lost
    again = dm(ds, tiny_model, batch_size=2, val_size=5, seed=3)
    assert [r["prompt"] for r in again._val_rows] == val  # the same rows every run (and on every rank)
    other = dm(ds, tiny_model, batch_size=2, val_size=5, seed=4)
    assert [r["prompt"] for r in other._val_rows] != val
    assert len(dm(ds, tiny_model, batch_size=2, val_size=0.01)._val_rows) == 1  # rounded up, never empty
    with pytest.raises(ValueError, match=r"val_size=20\): splits 20 of the 20 training rows off"):
        dm(ds, tiny_model, batch_size=2, val_size=20)
    for bad in (0, 1.0, -0.5, True):
        with pytest.raises(ValueError, match="expected a row count"):
            PromptDataModule(ds, val_size=bad)
    with pytest.raises(ValueError, match="not both"):
        PromptDataModule(ds, val=ds, val_size=2)
    with pytest.raises(TypeError, match="HINT: to split validation prompts off the training data, use val_size"):
        PromptDataModule(ds, val_split=0.1)  # type: ignore[arg-type]


def test_val_loader_reads_every_prompt_in_order(tiny_model: str) -> None:
    m = dm(addition(8), tiny_model, batch_size=2, val=addition(5), val_batch_size=2)
    batches = list(m.val_dataloader())
    assert [b["prompt"] for b in batches] == [["0+1=", "1+1="], ["2+1=", "3+1="], ["4+1="]]
    assert [b["prompt"] for b in m.val_dataloader()] == [b["prompt"] for b in batches]  # every time, no shuffle
    assert dm(addition(8), tiny_model, batch_size=2).val_dataloader() == []  # no validation data: Lightning skips


def test_validation_data_gets_the_same_checks(tiny_model: str) -> None:
    train = addition(4)
    with pytest.raises(ValueError, match=r"row 1 has an empty or non-text prompt in column 'prompt' of the validation"):
        dm(
            train,
            tiny_model,
            batch_size=2,
            val=datasets.Dataset.from_dict({"prompt": ["1+1=", ""], "answer": ["2", ""]}),
        )
    with pytest.raises(KeyError, match=r"the validation data lacks the training columns \['answer'\]"):
        dm(train, tiny_model, batch_size=2, val=datasets.Dataset.from_dict({"prompt": ["1+1="]}))
    with pytest.raises(ValueError, match=r"validation dataset columns \['scores'\] clash"):
        dm(train, tiny_model, batch_size=2, val=train.add_column("scores", [0] * 4))
    long_val = datasets.Dataset.from_dict({"prompt": ["12345678+1="], "answer": ["12345679"]})
    with pytest.raises(ValueError, match="0 prompts left after filtering the validation data, fewer than 1"):
        dm(train, tiny_model, batch_size=2, val=long_val, max_prompt_length=6)


# ------------------------------------------------------------------------------- folders and hub datasets
def test_local_folder_and_dataset_dict_load_by_split(tiny_model: str, tmp_path: Path) -> None:
    folder = tmp_path / "addition"
    folder.mkdir()
    for split, n in (("train", 6), ("test", 3)):
        lines = [json.dumps({"prompt": f"{i}+2=", "answer": str(i + 2)}) for i in range(n)]
        (folder / f"{split}.jsonl").write_text("\n".join(lines))
    # The path through datasets.load_dataset(name, config, split=...) that a hub name takes.
    m = dm(str(folder), tiny_model, batch_size=2, val=str(folder), val_split="test[:2]")
    assert (len(m._rows), len(m._val_rows)) == (6, 2)
    with pytest.raises(ValueError, match=r"could not load the local folder .*split='validation'.*Unknown split"):
        dm(str(folder), tiny_model, batch_size=2, train_split="validation")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": addition(4), "eval": addition(2)}).save_to_disk(str(saved))
    m = dm(str(saved), tiny_model, batch_size=2, val=str(saved), val_split="eval")
    assert (len(m._rows), len(m._val_rows)) == (4, 2)
    with pytest.raises(ValueError, match=r"no split 'test'; it has \['eval', 'train'\]"):
        dm(datasets.load_from_disk(str(saved)), tiny_model, batch_size=2, val=datasets.load_from_disk(str(saved)))


def test_hub_name_that_cannot_be_loaded_offline(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 does; never downloads
    with pytest.raises(FileNotFoundError) as err:
        dm("no-such-org/no-such-dataset", tiny_model, dataset_config="main")
    message = str(err.value)
    assert "PromptDataModule(train='no-such-org/no-such-dataset'): could not load a hub dataset" in message
    assert "config='main', split='train'" in message and "HF_HUB_OFFLINE=1" in message
    with pytest.raises(FileNotFoundError, match=r"PromptDataModule\(val='missing.parquet'\): no such file"):
        dm(addition(4), tiny_model, batch_size=2, val="missing.parquet")
