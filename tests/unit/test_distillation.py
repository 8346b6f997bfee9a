"""On-policy distillation's parts: the reverse-KL advantages on a hand-computed case, the teacher's vocabulary check,
and the module's refusals, all before any model loads."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from lightning_rlhf import OnPolicyDistillationModule
from lightning_rlhf.algorithms import reverse_kl_advantages
from lightning_rlhf.demo import addition_reward
from lightning_rlhf.roles.reference import check_same_vocabulary


def test_each_sampled_token_is_pushed_toward_the_teacher_by_its_own_log_ratio() -> None:
    student = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]]))
    teacher = torch.log(torch.tensor([[0.25, 0.5, 0.9], [0.4, 0.2, 0.3]]))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    advantages, figures = reverse_kl_advantages(student, teacher, mask)
    expected = [[math.log(0.5), math.log(2.0), 0.0], [math.log(4.0), 0.0, 0.0]]
    torch.testing.assert_close(advantages, torch.tensor(expected))
    # the mean over the four sampled tokens of log(student / teacher): (ln 2 - ln 2 + 0 - ln 4) / 4
    assert float(figures["reverse_kl"]) == pytest.approx(-math.log(4.0) / 4, abs=1e-6)


def test_a_teacher_with_another_vocabulary_is_refused_by_name(tiny_model: str, tmp_path: Path) -> None:
    student = AutoTokenizer.from_pretrained(tiny_model)
    check_same_vocabulary(student, tiny_model, setting="X(teacher=...)")  # the same tokenizer passes
    other = AutoTokenizer.from_pretrained(tiny_model)
    other.add_tokens(["<extra_teacher_token>"])
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as info:
        check_same_vocabulary(student, str(tmp_path), setting="X(teacher=...)")
    message = str(info.value)
    assert message.startswith(f"X(teacher=...)={str(tmp_path)!r}: its tokenizer has {len(student) + 1} tokens")
    assert "'<extra_teacher_token>' is id None for the student" in message and "HINT:" in message


def test_the_module_refuses_a_signal_of_zero_and_a_foreign_teacher_before_loading_models(
    tiny_model: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"distill_coef=0, reward_weight=0\) gives every token advantage 0"):
        OnPolicyDistillationModule(tiny_model, teacher=tiny_model, reward=addition_reward, distill_coef=0)
    with pytest.raises(ValueError, match=r"OnPolicyDistillationModule\(reward_weight=-1\) is invalid"):
        OnPolicyDistillationModule(tiny_model, teacher=tiny_model, reward=addition_reward, reward_weight=-1)
    other = AutoTokenizer.from_pretrained(tiny_model)
    other.add_tokens(["<extra>"])
    teacher = tmp_path / "teacher"
    other.save_pretrained(teacher)
    (teacher / "config.json").write_text((Path(tiny_model) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"OnPolicyDistillationModule\(teacher=\.\.\.\)=.*not the same ids"):
        OnPolicyDistillationModule(tiny_model, teacher=str(teacher), reward=addition_reward)
    module = OnPolicyDistillationModule(tiny_model, teacher=tiny_model, reward=addition_reward)
    assert set(module.roles()) == {"actor", "reward", "teacher"}  # no reference: the teacher anchors the student
    assert module.teacher.model is None  # models load at set-up, on the ranks
