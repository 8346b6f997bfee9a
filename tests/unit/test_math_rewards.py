"""Rule rewards for math answers on hand-written cases (real math-verify)."""

from __future__ import annotations

import threading

import pytest

from lightning_rlhf.rewards import call_reward_fn, extract_final_number, gsm8k_reward, math_reward

GSM8K_REF = "Janet pays 1,000 + 234 = <<1000+234=1234>>1,234 dollars.\n#### 1,234"


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("#### 1,234", "1234"),
        ("#### $1,000 in all", "1000"),
        ("first 5, then #### 12 (not 99)", "12"),
        ("The answer is -3.", "-3"),
        ("x = 2.50", "2.50"),
        ("costs $12,000,000.", "12000000"),
        ("\\boxed{72} after 3 tries", "72"),
        ("no number here", None),
    ],
)
def test_final_number(text: str, number: str | None) -> None:
    assert extract_final_number(text) == number


@pytest.mark.parametrize(
    ("completion", "reference", "score"),
    [
        ("so she pays 1234 dollars", GSM8K_REF, 1.0),
        ("She pays 1,234 dollars.\n#### 1,234", GSM8K_REF, 1.0),
        ("1234.0", GSM8K_REF, 1.0),
        ("The answer is \\boxed{1,234}.", GSM8K_REF, 1.0),
        ("\\boxed{\\frac{2468}{2}}", GSM8K_REF, 1.0),  # not a plain number: math-verify decides
        ("1235", GSM8K_REF, 0.0),
        ("#### 1234 ... no wait, 1235", GSM8K_REF, 1.0),  # the #### answer counts, not the last number
        ("I don't know", GSM8K_REF, 0.0),
        ("", GSM8K_REF, 0.0),
        ("the result is -5.", "#### -5", 1.0),
        ("5", "#### -5", 0.0),
        ("2.50", "#### 2.5", 1.0),
        ("\\boxed{\\frac{1}{2}}", "#### 0.5", 1.0),
        ("0.4", "#### 0.5", 0.0),
        ("72", "72", 1.0),  # a bare number as the reference
    ],
)
def test_gsm8k_reward(completion: str, reference: str, score: float) -> None:
    assert gsm8k_reward(["q"], [completion], [reference]) == [score]


def test_gsm8k_reference_without_a_number_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"reference answer 0 \('Paris'\) holds no number"):
        gsm8k_reward(["q"], ["1"], ["Paris"])


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("So $x = \\boxed{\\frac{1}{2}}$.", 1.0),
        ("\\boxed{0.5}", 1.0),
        ("\\boxed{\\frac{2}{4}}", 1.0),
        ("\\boxed{1/2}", 1.0),
        ("\\boxed{\\frac{1}{3}}", 0.0),
        ("\\boxed{-\\frac{1}{2}}", 0.0),
        ("no answer", 0.0),
        ("", 0.0),
    ],
)
def test_math_reward_boxed_answers(completion: str, score: float) -> None:
    solution = "Halving 1 gives $\\boxed{\\frac{1}{2}}$."
    assert math_reward(["q"], [completion], solution=[solution]) == [score]
    assert math_reward(["q"], [completion], answer=["\\frac{1}{2}"]) == [score]  # the answer alone, no $...$


def test_math_reward_compares_expressions_and_handles_bad_references() -> None:
    completions = ["\\boxed{1+x^2}", "\\boxed{x^2}", "\\boxed{2(x+1)}", "\\boxed{3}"]
    answers = ["x^2+1", "x^2+1", "2x+2", "\\frac{}{}"]  # the last cannot be parsed: 0.0, not an error
    assert math_reward([""] * 4, completions, answer=answers) == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="column named `solution` or `answer`"):
        math_reward(["q"], ["\\boxed{1}"], ground_truth=["1"])


def test_math_rewards_work_off_the_main_thread_and_in_the_runner() -> None:
    # math-verify's own timeouts use signal.alarm, which raises ValueError outside the main thread.
    results: dict[str, list[float]] = {}
    thread = threading.Thread(
        target=lambda: results.update(
            math=math_reward(["q"], ["\\boxed{0.5}"], answer=["\\frac12"]),
            gsm8k=gsm8k_reward(["q"], ["\\boxed{\\frac{1}{2}}"], ["#### 0.5"]),
        )
    )
    thread.start()
    thread.join()
    assert results == {"math": [1.0], "gsm8k": [1.0]}
    out = call_reward_fn(
        math_reward, ["q", "q"], ["\\boxed{0.5}", "\\boxed{2}"], {"answer": ["\\frac12"] * 2}, timeout_s=30.0
    )
    assert out.scores.tolist() == [1.0, 0.0] and not out.failed.any()
