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
