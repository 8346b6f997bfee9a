"""Reward role: function rewards are validated; reward models score decoded text."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from lightning_rlhf import GRPOModule
from lightning_rlhf.batch import Batch
from lightning_rlhf.demo import addition_reward
from lightning_rlhf.roles import RewardFunctionError, RewardRole


def rollout(tok, completions: list[str]) -> Batch:
    ids = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions]
    width = max(len(i) for i in ids)
    responses = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros_like(responses)
    for k, row in enumerate(ids):
        responses[k, : len(row)] = torch.tensor(row)
        mask[k, : len(row)] = 1
    return Batch(
        {"responses": responses, "response_mask": mask},
        {"prompt": ["3+4="] * len(ids), "answer": ["7"] * len(ids)},
    )


def test_function_reward_gets_text_and_dataset_columns(tiny_model: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    seen = {}

    def fn(prompts, completions, answer, **kw):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    out = RewardRole(fn, tokenizer=tok, micro_batch_size=4).score(rollout(tok, ["7", "8"]))
    assert out["scores"].tolist() == [1.0, 0.0]
    assert out["completion"] == ["7", "8"]  # decoded without the EOS
    assert seen["prompts"] == ["3+4=", "3+4="] and seen["answer"] == ["7", "7"]


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda p, c, **kw: 1 / 0, r"reward function `<lambda>` raised ZeroDivisionError"),
        (lambda p, c, **kw: [1.0], r"returned 1 values for 2 completions"),
        (lambda p, c, **kw: [1.0, math.nan], r"returned nan for completion 1"),
        (lambda p, c, **kw: [math.inf, 0.0], r"returned inf for completion 0"),
        (lambda p, c, **kw: 1.0, r"returned float; expected a list of 2 floats"),
        (lambda p, c, **kw: ["x", 1.0], r"returned 'x' for completion 0"),
    ],
)
def test_bad_reward_functions_fail_clearly(tiny_model: str, fn, match: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with pytest.raises(RewardFunctionError, match=match):
        RewardRole(fn, tokenizer=tok, micro_batch_size=4).score(rollout(tok, ["7", "8"]))


def test_reward_model_scores_each_text_batched(tiny_model: str, tiny_classifier: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    role = RewardRole(tiny_classifier, tokenizer=tok, micro_batch_size=2)
    role.load()
    batch = rollout(tok, ["7", "12", "7", "3"])
    scores = role.score(batch)["scores"]
    assert scores.shape == (4,) and torch.isfinite(scores).all()
    assert scores[0] == pytest.approx(scores[2].item(), abs=1e-5)  # same text, same score, any batch position
    assert scores[0] != pytest.approx(scores[1].item(), abs=1e-6)


def test_reward_model_scores_prompt_plus_completion_as_documented(tiny_model: str, tiny_classifier: str) -> None:
    """docs/rewards.md, "What a reward model scores": the text is ``prompt + completion`` (the completion decoded
    without special tokens, so without its EOS), tokenized by the reward model's own tokenizer with its special
    tokens (this one prepends ``<s>``) and no chat template, padded on the right, not truncated; the score is the
    one logit at the last non-pad token."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rm_tok = AutoTokenizer.from_pretrained(tiny_classifier)
    role = RewardRole(tiny_classifier, tokenizer=tok, micro_batch_size=4)
    role.load()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = role.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append((kw["input_ids"].clone(), kw["attention_mask"].clone())), with_kwargs=True
    )
    completions = ["7", " twelve, or 7?"]  # two lengths: the shorter one is padded
    batch = rollout(tok, completions)
    assert all(
        row[m.bool()][-1] == tok.eos_token_id for row, m in zip(batch["responses"], batch["response_mask"], strict=True)
    )
    scores = role.score(batch)["scores"]
    hook.remove()
    ((ids, mask),) = seen  # one forward: both texts in one micro-batch
    for i, completion in enumerate(completions):
        documented = [rm_tok.bos_token_id, *rm_tok("3+4=" + completion, add_special_tokens=False)["input_ids"]]
        n = len(documented)
        assert ids[i, :n].tolist() == documented, completion
        assert (ids[i, n:] == rm_tok.pad_token_id).all() and mask[i].tolist() == [1] * n + [0] * (ids.shape[1] - n)
        with torch.no_grad():
            alone = role.model(torch.tensor([documented])).logits[0, 0]
            last = role.model.score(role.model.model(torch.tensor([documented])).last_hidden_state[0, -1])[0]
        assert scores[i].item() == pytest.approx(alone.item(), abs=1e-5)  # padding changes nothing
        assert scores[i].item() == pytest.approx(last.item(), abs=1e-5)  # the last token's logit
    assert not (ids == rm_tok.eos_token_id).any()  # no EOS: the response's was dropped, none appended


def _classifier(source: str, folder: Path, **kwargs: object) -> str:
    """``source`` loaded as a sequence classifier with ``kwargs`` and saved with its tokenizer into ``folder``."""
    model = AutoModelForSequenceClassification.from_pretrained(source, **kwargs)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return str(folder)


def test_reward_model_with_two_outputs_is_refused_saying_what_a_reward_model_is(
    tiny_model: str, tmp_path: Path
) -> None:
    """The user's reward model with the wrong head (``num_labels=2``) is refused when the module is built,
    before any weight loads; the message says what a reward model must be and how to get one (not "re-save the
    checkpoint"), and following its hint gives a model the role loads and scores with."""
    two = _classifier(tiny_model, tmp_path / "rm2", num_labels=2)
    with pytest.raises(ValueError) as err:
        GRPOModule(tiny_model, reward=two)
    message = str(err.value)
    assert message.startswith(f"RewardRole(reward=...)={two!r} is a sequence classifier with 2 outputs"), message
    assert "must be a sequence classifier (AutoModelForSequenceClassification) with exactly one output " in message
    assert "(num_labels=1)" in message and "re-save" not in message
    assert "HINT: add the one-output head with AutoModelForSequenceClassification.from_pretrained(" in message
    assert "num_labels=1, ignore_mismatched_sizes=True" in message

    fixed = _classifier(two, tmp_path / "rm1", num_labels=1, ignore_mismatched_sizes=True)  # the hint, followed
    module = GRPOModule(tiny_model, reward=fixed)
    module.reward.load()
    tok = module.tokenizer
    assert torch.isfinite(module.reward.score(rollout(tok, ["7", "8"]))["scores"]).all()


def test_causal_lm_as_reward_model_is_refused(tiny_model: str) -> None:
    """A causal LM's checkpoint would get a new, random score head: every reward would be noise."""
    with pytest.raises(ValueError) as err:
        GRPOModule(tiny_model, reward={"rm": tiny_model, "sum": addition_reward})
    message = str(err.value)
    assert "is a Qwen2ForCausalLM checkpoint, not a sequence classifier" in message and "random" in message
    assert "with exactly one output (num_labels=1)" in message and "HINT: make one from this checkpoint" in message


def test_reward_model_scores_chat_prompts_with_its_own_chat_template(
    tiny_model: str, tiny_classifier: str, tmp_path: Path
) -> None:
    """docs/rewards.md: with chat prompts (``messages_column`` or ``chat_template=True``, which the data module marks
    in ``batch.meta``) the reward model scores the whole conversation, the completion as the assistant's turn,
    rendered by its own chat template (as TRL and verl do), with no special tokens added beyond the template's. A
    reward tokenizer without a template scores ``prompt + completion`` and says so once."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rm_tok = AutoTokenizer.from_pretrained(tiny_classifier)
    assert rm_tok.chat_template is not None
    role = RewardRole(tiny_classifier, tokenizer=tok, micro_batch_size=4)
    role.load()
    seen: list[torch.Tensor] = []
    hook = role.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True
    )
    chats = [
        [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}],
        [
            {"role": "user", "content": "1+1="},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "3+4="},
        ],
    ]
    batch = rollout(tok, ["7", "7"])
    batch.columns["messages"] = chats
    batch.meta.update(chat_prompt=True, messages_column="messages")
    scores = role.score(batch)["scores"]
    as_user = rollout(tok, ["7"])  # chat_template=True: the text prompt is the one user message
    as_user.meta.update(chat_prompt=True, messages_column=None)
    user_score = role.score(as_user)["scores"]
    hook.remove()
    rendered = [
        rm_tok.apply_chat_template([*chat, {"role": "assistant", "content": "7"}], tokenize=False) for chat in chats
    ]
    assert rendered[0] == "<s><|system|>\nAdd.</s>\n<|user|>\n3+4=</s>\n<|assistant|>\n7</s>\n"
    for i, text in enumerate(rendered):
        ids = rm_tok(text, add_special_tokens=False)["input_ids"]
        assert seen[0][i, : len(ids)].tolist() == ids  # one <s>: the template's, none added
    assert scores[0] != pytest.approx(scores[1].item(), abs=1e-6)  # the earlier turns are scored too
    user = rm_tok.apply_chat_template([{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}])
    assert seen[1][0].tolist() == list(user if isinstance(user, list) else user["input_ids"])
    assert torch.isfinite(user_score).all()

    plain = tmp_path / "no_template"
    AutoModelForSequenceClassification.from_pretrained(tiny_classifier).save_pretrained(plain)
    rm_tok.chat_template = None
    rm_tok.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    role = RewardRole(str(plain), tokenizer=tok, micro_batch_size=4)
    role.load()
    RewardRole._no_template_warned = False
    with pytest.warns(UserWarning, match=r"has no chat template, so it scores `prompt \+ completion`"):
        fallback = role.score(batch)["scores"]
    assert fallback[0] == pytest.approx(fallback[1].item(), abs=1e-5)  # both are "3+4=" + "7"
