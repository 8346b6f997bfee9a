"""The tiny models' byte-level BPE tokenizer reads any text, reads it the same once saved and reloaded, and renders
chats with its template."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, Qwen2Tokenizer

from lightning_rlhf.demo import addition_dataset, build_tiny_tokenizer, save_tiny
from tests.conftest import ROOT

TEXT = "Which is larger, 41 or 19? Answer: ü 日本 🙂"
MORE = [TEXT, "3+4=", "12+34=46", " 7\n", "Hello  world\n\n\ttab", "naïve café (NFC: é)", "a" * 40, "x = [1, 2];"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny model folder: config.json (model_type qwen2) and the tokenizer, as the trainer loads it."""
    return save_tiny(tmp_path_factory.mktemp("tok") / "model")


def test_round_trip_through_save_and_reload(saved: str) -> None:
    tok = build_tiny_tokenizer()
    reloaded = AutoTokenizer.from_pretrained(saved)
    assert type(reloaded) is Qwen2Tokenizer  # what transformers uses for any model_type=qwen2 folder
    assert len(reloaded) == len(tok)
    for text in MORE:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert reloaded(text, add_special_tokens=True)["input_ids"] == ids, text
        assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids and tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert reloaded.decode(ids, skip_special_tokens=True) == text
    # Nothing is dropped: every character of the text is in the tokens (the char tokenizer kept only "4119").
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > len("Which is larger, 41 or 19? Answer:") // 4
    assert "".join(tok.convert_ids_to_tokens(ids)).startswith("Which")


def test_special_tokens_padding_and_digits(saved: str) -> None:
    tok = build_tiny_tokenizer()
    reloaded = AutoTokenizer.from_pretrained(saved)
    for t in (tok, reloaded):
        assert (t.pad_token_id, t.bos_token_id, t.eos_token_id, t.unk_token_id) == (0, 1, 2, 3)
        assert (t.pad_token, t.bos_token, t.eos_token) == ("<pad>", "<s>", "</s>")
        assert t.padding_side == "left"
        enc = t(["1+2=", "Which is larger, 41 or 19?"], padding=True)
        assert enc["input_ids"][0][0] == t.pad_token_id and enc["attention_mask"][0][0] == 0
        # Every digit is a token of its own (Qwen2's regex splits numbers digit by digit): the addition task
        # reads and writes sums one digit at a time.
        assert t.convert_ids_to_tokens(t("1234567890", add_special_tokens=False)["input_ids"]) == list("1234567890")
    assert {len(tok(p)["input_ids"]) for p in addition_dataset()["prompt"]} == {5}  # <s> a + b =
    assert 256 < len(tok) <= 512


def test_training_is_deterministic_across_processes(saved: str) -> None:
    code = (
        "import hashlib, json; from lightning_rlhf.demo import build_tiny_tokenizer; "
        "vocab = json.dumps(build_tiny_tokenizer().get_vocab(), sort_keys=True); "
        "print(hashlib.sha256(vocab.encode()).hexdigest())"
    )
    run = [sys.executable, "-c", code]
    digests = {subprocess.run(run, capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip() for _ in "ab"}
    mine = hashlib.sha256(json.dumps(build_tiny_tokenizer().get_vocab(), sort_keys=True).encode()).hexdigest()
    assert digests == {mine}
    on_disk = json.loads((Path(saved) / "tokenizer.json").read_text())["model"]
    assert on_disk["vocab"].items() <= build_tiny_tokenizer().get_vocab().items()  # the saved file is that BPE


def test_vllm_reads_the_same_ids(saved: str) -> None:
    pytest.importorskip("vllm")
    from vllm.tokenizers import get_tokenizer  # what a vLLM engine built on the folder tokenizes with

    vllm_tok = get_tokenizer(saved)
    tok = build_tiny_tokenizer()
    for text in MORE:
        assert vllm_tok.encode(text) == tok(text)["input_ids"], text
        assert vllm_tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert vllm_tok.chat_template == tok.chat_template  # and the same chat template


# ------------------------------------------------------------------------------------- chat template
CHAT = [
    {"role": "system", "content": "You are a careful calculator. Answer inside <answer></answer>."},
    {"role": "user", "content": "Which is larger, 41 or 19? Think, then answer: ü 日本 🙂"},
]


@pytest.fixture(scope="module")
def embedded(demo_model: str) -> dict[str, str]:
    """The folders ``lightning-rlhf/tiny-addition`` and ``lightning-rlhf/tiny-random`` resolve to (in the cache
    the session's demo model was built in, so tiny-addition is that model and tiny-random is built beside it)."""
    from lightning_rlhf.config.models import CACHE_ENV, resolve_model_path

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(Path(demo_model).parent))
        names = ("lightning-rlhf/tiny-addition", "lightning-rlhf/tiny-random")
        folders = {name: resolve_model_path(name, setting="test") for name in names}
    assert folders["lightning-rlhf/tiny-addition"] == demo_model
    return folders


@pytest.mark.parametrize("name", ["lightning-rlhf/tiny-addition", "lightning-rlhf/tiny-random"])
def test_embedded_models_take_a_chat_as_shipped(embedded: dict[str, str], name: str) -> None:
    """The user's chat task (a system and a user turn) on the embedded model as it is, with no copy and no
    template of their own: the tokenizer folder has a chat template, the rendering round-trips through
    encode/decode, and the model has room for it (at least 256 positions)."""
    from transformers import AutoConfig

    folder = embedded[name]
    tok = AutoTokenizer.from_pretrained(folder)
    assert isinstance(tok.chat_template, str) and tok.chat_template  # saved with the folder, read by AutoTokenizer
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<s><|system|>\n{CHAT[0]['content']}</s>\n<|user|>\n{CHAT[1]['content']}</s>\n<|assistant|>\n"
    )  # the layout docs/your-own-task.md shows
    ids = tok(text, add_special_tokens=False)["input_ids"]  # as PromptDataModule tokenizes a rendered chat
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"] == ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # one <s>, from the template
    assert ids.count(tok.eos_token_id) == 2 and tok.unk_token_id not in ids  # each turn ends with </s>
    assert tok.decode(ids) == text  # nothing dropped or added
    plain = tok.decode(ids, skip_special_tokens=True)
    assert CHAT[0]["content"] in plain and CHAT[1]["content"] in plain
    # An answer continues the generation prompt: rendering the chat with it extends the prompt's text.
    answered = tok.apply_chat_template([*CHAT, {"role": "assistant", "content": "41"}], tokenize=False)
    assert answered == text + "41</s>\n"
    assert AutoConfig.from_pretrained(folder).max_position_embeddings >= 256
    assert tok.model_max_length >= 256
    assert len(ids) + 64 <= AutoConfig.from_pretrained(folder).max_position_embeddings  # room to answer
