"""triage_trl.data: prompt + reference adapters on real rows of ../shared/data and on reasoning-gym.

Whole-benchmark math-verify checks of the references (every MATH-500 answer against itself, perturbed answers
failing) live in tests/test_eval_benchmarks.py; here the adapters' own output is checked.
"""

from __future__ import annotations

import json
import os

import pytest

from triage_trl.data import (
    DATASET_CHOICES,
    DEFAULT_TASK,
    HELD_OUT_SEED,
    INSTRUCTION,
    boxed_chat_prompt,
    gsm8k_dataset,
    load_task,
    math_dataset,
    reasoning_gym_dataset,
)
from triage_trl.data.jsonl import read_jsonl
from triage_trl.data.reasoning_gym import RG_ARITHMETIC_EXAMPLE

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
needs_data = pytest.mark.skipif(not os.path.isdir(DATA), reason="../shared/data is absent (CI has it)")


def _check_prompt(prompt, question_part):
    assert [m["role"] for m in prompt] == ["user", "assistant", "user"]
    assert "\\boxed{" in prompt[1]["content"]
    assert prompt[0]["content"].endswith(INSTRUCTION) and prompt[2]["content"].endswith(INSTRUCTION)
    assert question_part in prompt[2]["content"]


@needs_data
def test_every_gsm8k_test_answer_parses_to_a_number():
    path = os.path.join(DATA, "gsm8k", "test.jsonl")
    rows = read_jsonl(path)
    ds = gsm8k_dataset(os.path.join(DATA, "gsm8k"), split="test")
    assert len(ds) == len(rows) == 1319
    for row, answer in zip(rows, ds["answer"], strict=True):
        value = float(answer)  # raises on anything but a number
        assert value == float(row["answer"].split("####")[-1].strip().replace(",", ""))
    assert ds["answer"][:3] == ["18", "3", "70000"]
    assert set(ds["answer_kind"]) == {"gsm8k"}
    _check_prompt(ds[0]["prompt"], rows[0]["question"])


@needs_data
def test_gsm8k_local_file_subset_is_seeded():
    path = os.path.join(DATA, "gsm8k", "train.jsonl")
    a = gsm8k_dataset(path, size=5, seed=3)
    assert len(a) == 5 and a["answer"] == gsm8k_dataset(path, size=5, seed=3)["answer"]
    assert a["prompt"] != gsm8k_dataset(path, size=5, seed=4)["prompt"]


@needs_data
def test_math500_adapter_keeps_the_latex_reference():
    path = os.path.join(DATA, "math500", "test.jsonl")
    rows = read_jsonl(path)
    ds = math_dataset(path)
    assert len(ds) == 500 and ds["answer"] == [r["answer"] for r in rows]
    assert ds[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)" and set(ds["answer_kind"]) == {"math"}
    _check_prompt(ds[0]["prompt"], rows[0]["problem"])


def test_math_adapter_names_missing_fields(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"question": "1+1", "final": "2"}) + "\n")
    with pytest.raises(ValueError, match="problem_key"):
        math_dataset(str(path))
    assert math_dataset(str(path), problem_key="question", answer_key="final")["answer"] == ["2"]
    with pytest.raises(FileNotFoundError):
        math_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError):
        gsm8k_dataset(str(tmp_path / "nope"))


def test_reasoning_gym_default_task_offline():
    ds = reasoning_gym_dataset(size=50)
    assert set(ds.column_names) == {"prompt", "answer", "answer_kind", "rg_entry"}
    for row in ds:
        entry = json.loads(row["rg_entry"])
        assert entry["metadata"]["source_dataset"] == DEFAULT_TASK["name"] == "chain_sum"
        expression = entry["metadata"]["expression"]
        assert str(eval(expression)) == row["answer"] == entry["answer"]  # noqa: S307 - digits and +/- only
        assert len(expression.split()) == 3 and all(len(t) == 1 for t in expression.split()[::2])
        _check_prompt(row["prompt"], expression)
    held_out = reasoning_gym_dataset(size=50, seed=HELD_OUT_SEED)
    assert held_out["rg_entry"] != ds["rg_entry"]
    assert reasoning_gym_dataset(size=50)["rg_entry"] == ds["rg_entry"]


def test_reasoning_gym_example_shows_a_negative_answer():
    # With a positive example SmolLM2 never writes a minus sign (benchmarks/bench_task_headroom.py): the example
    # must be a two-term difference whose boxed answer is negative and correct.
    question, answer = RG_ARITHMETIC_EXAMPLE
    expression = question.rsplit(":", 1)[1].strip().removesuffix("=").strip()
    assert len(expression.split()) == 3 and expression.split()[1] == "-"
    value = eval(expression)  # noqa: S307 - digits and - only
    assert value < 0 and answer.endswith(f"\\boxed{{{value}}}.")
    prompt = reasoning_gym_dataset(size=1)[0]["prompt"]
    assert prompt[0]["content"].startswith(question) and prompt[1]["content"] == answer


def test_reasoning_gym_other_task_and_errors():
    ds = reasoning_gym_dataset({"name": "basic_arithmetic", "min_terms": 2, "max_terms": 3, "min_digits": 1,
                                "max_digits": 1}, size=4)
    assert json.loads(ds[0]["rg_entry"])["metadata"]["source_dataset"] == "basic_arithmetic"
    with pytest.raises(ValueError, match="name"):
        reasoning_gym_dataset({"min_terms": 2})
    with pytest.raises(ValueError, match="refused"):
        reasoning_gym_dataset({"name": "chain_sum", "min_terms": 3, "max_terms": 2})
    with pytest.raises(ValueError, match="size"):
        reasoning_gym_dataset(size=0)


def test_load_task_and_prompt_errors():
    assert len(load_task("reasoning_gym", size=3)) == 3
    with pytest.raises(ValueError, match="path"):
        load_task("math")
    with pytest.raises(ValueError, match=", ".join(DATASET_CHOICES)):
        load_task("nope")
    with pytest.raises(ValueError, match="empty"):
        boxed_chat_prompt("  ")
    with pytest.raises(ValueError, match="boxed"):
        boxed_chat_prompt("q", ("q", "no box"))
    assert boxed_chat_prompt("What is 1 + 1?", None) == [
        {"role": "user", "content": f"What is 1 + 1? {INSTRUCTION}"}
    ]
