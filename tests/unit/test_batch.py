"""The Batch container: the unit of transfer between controller and workers."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_rlhf.batch import Batch


def make(n: int = 4, width: int = 3) -> Batch:
    return Batch(
        {"ids": torch.arange(n * width).view(n, width), "score": torch.arange(n).float()},
        {"prompt": [f"p{i}" for i in range(n)]},
        {"step": 7},
    )


def test_chunk_then_cat_round_trips() -> None:
    b = make(6)
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert parts[1]["prompt"] == ["p2", "p3"]
    back = Batch.cat(parts)
    assert torch.equal(back["ids"], b["ids"]) and back["prompt"] == b["prompt"] and back.meta == {"step": 7}


def test_chunk_refuses_uneven_split() -> None:
    with pytest.raises(ValueError, match="5 rows into 2 equal parts"):
        make(5).chunk(2)


def test_cat_right_pads_ragged_widths() -> None:
    a = Batch({"r": torch.ones(2, 3, dtype=torch.long)})
    b = Batch({"r": torch.full((1, 5), 2, dtype=torch.long)})
    out = Batch.cat([a, b])["r"]
    assert out.shape == (3, 5)
    assert out[0].tolist() == [1, 1, 1, 0, 0] and out[2].tolist() == [2] * 5


def test_select_repeat_and_setitem_checks_length() -> None:
    b = make(2)
    rep = b.select(torch.arange(2).repeat_interleave(3))
    assert rep["prompt"] == ["p0"] * 3 + ["p1"] * 3
    rep["extra"] = torch.zeros(6)
    with pytest.raises(ValueError, match="has 5 rows, the batch has 6"):
        rep["bad"] = torch.zeros(5)


def test_mismatched_columns_and_missing_key_errors() -> None:
    with pytest.raises(ValueError, match="disagree"):
        Batch({"a": torch.zeros(2)}, {"b": [1, 2, 3]})
    with pytest.raises(KeyError, match="no column 'nope'"):
        make()["nope"]


def test_split_and_pickle() -> None:
    b = make(5)
    assert [len(p) for p in b.split(2)] == [2, 2, 1]
    c = pickle.loads(pickle.dumps(b))
    assert torch.equal(c["ids"], b["ids"]) and c["prompt"] == b["prompt"]
