"""triage_trl.rewards on real completion text (SmolLM2-135M-Instruct's greedy answers, GSM8K/MATH-500 solutions)."""

from __future__ import annotations

import json
import os

import pytest

from triage_trl.data import reasoning_gym_dataset
from triage_trl.data.jsonl import read_jsonl
from triage_trl.answers import boxed_span
from triage_trl.rewards import (REWARD_FUNCS, answer_then_stop_reward, format_reward, reasoning_gym_reward,
                                verified_answer_reward)

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
needs_data = pytest.mark.skipif(not os.path.isdir(DATA), reason="../shared/data is absent (CI has it)")

# Completions SmolLM2-135M-Instruct wrote (greedy, NVFP4 vLLM sampler) for reasoning-gym chain_sum items.
SMOLLM2_COMPLETIONS = [
    "60 - 29 = 10, and 10 - 29 = 2.\nThe final answer is \\boxed{2}.",
    "43 - 76 = 12, and 12 - 76 = 1.\nThe final answer is \\boxed{1}.",
]


def test_reasoning_gym_counts_only_full_score():
    entry = json.dumps({"answer": "10", "metadata": {"source_dataset": "chain_sum"}})
    completions = ["so \\boxed{10}", "so \\boxed{1}", "\\boxed{+10.0}", "10", [{"role": "assistant", "content": "\\boxed{10}"}]]
    # "1" against "10" gets partial credit (0.5) from reasoning-gym's scorer: counted as wrong.
    assert reasoning_gym_reward(completions, [entry] * 5) == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_accuracy_on_reasoning_gym_rows_and_real_completions():
    ds = reasoning_gym_dataset({"name": "chain_sum", "min_terms": 2, "max_terms": 2, "min_digits": 2,
                                "max_digits": 2}, size=2)
    right = [f"It is {a}.\nThe final answer is \\boxed{{{a}}}." for a in ds["answer"]]
    assert verified_answer_reward(right, ds["answer"], ds["answer_kind"], rg_entry=ds["rg_entry"]) == [1.0, 1.0]
    assert verified_answer_reward(SMOLLM2_COMPLETIONS, ["31", "-33"], ["reasoning_gym"] * 2,
                           rg_entry=[json.dumps({"answer": a, "metadata": {"source_dataset": "chain_sum"}})
                                     for a in ("31", "-33")]) == [0.0, 0.0]
    assert format_reward(SMOLLM2_COMPLETIONS + ["The answer is 31.", "\\boxed{}"]) == [1.0, 1.0, 0.0, 0.0]


@needs_data
def test_accuracy_on_gsm8k_solutions():
    rows = read_jsonl(os.path.join(DATA, "gsm8k", "test.jsonl"))[:20]
    refs = [r["answer"].split("####")[-1].strip() for r in rows]
    # The dataset's own worked solutions, ending "The final answer is \boxed{n}.": all correct.
    solutions = [r["answer"].split("####")[0] + f"The final answer is \\boxed{{{ref}}}." for r, ref in zip(rows, refs)]
    assert verified_answer_reward(solutions, refs, ["gsm8k"] * 20) == [1.0] * 20
    # Shifted by one row: all wrong (no two consecutive references in these 20 rows are equal).
    assert all(a != b for a, b in zip(refs, refs[1:] + refs[:1]))
    assert verified_answer_reward(solutions, refs[1:] + refs[:1], ["gsm8k"] * 20) == [0.0] * 20


@needs_data
def test_accuracy_on_math500_solutions():
    rows = read_jsonl(os.path.join(DATA, "math500", "test.jsonl"))[:20]
    solutions = [r["solution"] for r in rows]  # real LaTeX text with the answer in \boxed{}
    refs = [r["answer"] for r in rows]
    assert verified_answer_reward(solutions, refs, ["math"] * 20) == [1.0] * 20
    assert verified_answer_reward(solutions[:5], refs[1:6], ["math"] * 5) == [0.0] * 5
    assert format_reward(solutions) == [1.0] * 20


def test_wait_completion_scores_its_last_box():
    wait = "I first got \\boxed{5}. Wait, that's wrong; the answer is \\boxed{7}."
    assert verified_answer_reward([wait, wait], ["7", "5"], ["math", "gsm8k"]) == [1.0, 0.0]
    assert verified_answer_reward(["\\boxed{4.5 \\times 10^{33}}", "\\boxed{e - 5}"], ["4.5e33", "1e-5"],
                                  ["minerva"] * 2) == [1.0, 0.0]


def test_answer_then_stop_rewards_only_completions_that_end_with_their_answer():
    """SmolLM2's real completions before GRPO (ends with the answer) and after 8 steps with only an accuracy reward
    (trailing text): the format reward cannot tell them apart, this one can."""
    stops = ["4 + 3 = 7.\nThe final answer is \\boxed{7}.", "$\\boxed{\\frac{1}{2}}$ \n", "\\boxed{-4}"]
    rambles = ["4 + 3 = 7.\nThe final answer is \\boxed{7}.\n\nThis is a classic example of how a math problem can",
               "\\boxed{7}. Wait, \\boxed{8} is it", "\\boxed{}", "no answer", "cut \\boxed{7"]
    assert answer_then_stop_reward(stops + rambles) == [1.0] * 3 + [0.0] * 5
    assert format_reward(stops + rambles[:2]) == [1.0] * 5
    text = "so \\boxed{\\frac{1}{2}} and \\boxed{3}."
    start, end = boxed_span(text)
    assert text[start:end] == "3" and text[end] == "}" and boxed_span("\\boxed{3") is None


def test_registry_names_ours_apart_from_trl():
    import trl.rewards

    assert set(REWARD_FUNCS) == {"verified_answer_reward", "format_reward", "answer_then_stop_reward",
                                 "reasoning_gym_reward",
                                 "boxed_answer_reward", "digit_share_reward",
                                 "accuracy_reward", "reasoning_accuracy_reward", "think_format_reward"}
    # TRL's names mean TRL's rewards (column `solution`), as in `trl grpo`
    assert REWARD_FUNCS["accuracy_reward"] is trl.rewards.accuracy_reward
    assert REWARD_FUNCS["think_format_reward"] is trl.rewards.think_format_reward
    assert REWARD_FUNCS["verified_answer_reward"] is verified_answer_reward
    assert all(name == f.__name__ for name, f in REWARD_FUNCS.items())
    with pytest.warns(FutureWarning, match="renamed verified_answer_reward"):
        from triage_trl.rewards import accuracy_reward
    assert accuracy_reward is verified_answer_reward


def test_reward_errors():
    with pytest.raises(ValueError, match="answer_kind"):
        verified_answer_reward(["\\boxed{1}"], ["1"], ["latex"])
    with pytest.raises(ValueError, match="rg_entry"):
        verified_answer_reward(["\\boxed{1}"], ["1"], ["reasoning_gym"])
    with pytest.raises(TypeError, match="completion"):
        format_reward([3])
