"""Every benchmark of ../shared/data: references scored as completions verify, perturbed answers do not.

Rates measured on the full files (math-verify 0.9.0): a model-style completion ending in
``\\boxed{<reference>}`` verifies on 100% of every benchmark; the data's own worked solutions verify on
100% of MATH-500 and Minerva, and on all but the known misses listed below for GSM8K and AIME24;
``\\boxed{<reference> + 1}`` (``2 \\cdot <reference>`` for e-notation, where + 1 is below the
precision of ``4.5e33``) verifies on 0%. References as a model renders them (``4.5 \\times 10^{33}``,
``\\frac{4}{3}``): tests/test_reference_rendering.py. Skipped when ../shared/data is absent (CI has it).
"""

import re
from pathlib import Path

import pytest

from triage_trl.answers import verify
from triage_trl.eval import BENCHMARKS, load_benchmark

DATA = Path(__file__).parents[2] / "shared" / "data"
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"benchmark data not found at {DATA}")

ROWS = {"gsm8k": 1319, "math500": 500, "aime24": 30, "amc23": 40, "minerva_math": 272, "olympiadbench": 675}

# The data's worked solutions, scored as completions; ids that math-verify does not score correct.
SOLUTION_MISSES = {
    # GSM8K solutions have no \boxed{}: the numbers fallback takes math-verify's highest-priority match, and a
    # number after the word "answer" (e.g. "the answer from the previous step ... $4.00 + $2.00") outranks the
    # last number; "####" is no math-verify anchor. Model completions with \boxed{} are not affected.
    "gsm8k": {"gsm8k/226", "gsm8k/258", "gsm8k/876", "gsm8k/1303"},
    "math500": set(),
    # The AoPS solution boxes "\text{(073)}", which math-verify does not read as a number.
    "aime24": {"aime24/75"},
    "minerva_math": set(),
}


def _solution_text(name, row):
    return row["answer"] if name == "gsm8k" else row["solution"]


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_boxed_reference_verifies_and_perturbed_fails(name):
    problems = load_benchmark(name, DATA)
    assert len(problems) == ROWS[name]
    wrong_ok, right_missed = [], []
    for p in problems:
        unit = f" {p.unit}" if p.unit else ""
        good = f"Let me work it out.\nThe final answer is $\\boxed{{{p.reference}{unit}}}$."
        wrong = f"2 \\cdot {p.reference}" if re.fullmatch(r"[\d.]+e-?\d+", p.reference) else f"{p.reference}+1"
        bad = f"Let me work it out.\nThe final answer is $\\boxed{{{wrong}}}$."
        if not verify(good, p.reference, kind=p.kind, unit=p.unit):
            right_missed.append(p.id)
        if verify(bad, p.reference, kind=p.kind, unit=p.unit):
            wrong_ok.append(p.id)
    assert right_missed == []
    assert wrong_ok == []


@pytest.mark.parametrize("name", list(SOLUTION_MISSES))
def test_worked_solutions_verify(name):
    import json

    rows = [json.loads(line) for line in (DATA / name / "test.jsonl").read_text().splitlines() if line.strip()]
    problems = load_benchmark(name, DATA)
    missed = {p.id for p, row in zip(problems, rows) if not verify(_solution_text(name, row), p.reference, kind=p.kind)}
    assert missed == SOLUTION_MISSES[name]


def test_loader_fields_and_limit():
    p = load_benchmark("olympiadbench", DATA, limit=2)
    assert [x.id for x in p] == ["olympiadbench/1606", "olympiadbench/1610"]
    units = [x for x in load_benchmark("olympiadbench", DATA) if x.unit]
    assert len(units) == 8 and all("The unit of the answer is" in x.problem for x in units)
    amc = load_benchmark("amc23", DATA, limit=1)[0]
    assert (amc.reference, amc.kind) == ("27", "amc")
    gsm = load_benchmark("gsm8k", DATA, limit=3)
    assert [g.reference for g in gsm] == ["18", "3", "70000"] and gsm[2].id == "gsm8k/2"
    minerva = load_benchmark("minerva_math", DATA, limit=1)[0]
    assert minerva.reference == "1.6"


def test_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark 'mmlu'"):
        load_benchmark("mmlu", DATA)
    with pytest.raises(FileNotFoundError, match="<benchmark>/test.jsonl"):
        load_benchmark("gsm8k", tmp_path)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(ValueError, match="no '####'"):
        load_benchmark("gsm8k", tmp_path)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        load_benchmark("gsm8k", DATA, limit=0)


def test_a_benchmark_is_one_record(tmp_path, monkeypatch):
    """Name, answer kind, Hub source and row function travel together; a new record is all a benchmark needs."""
    from triage_trl.eval import BENCHMARK_RECORDS, HUB_SOURCES, Benchmark
    from triage_trl.eval.benchmarks import number_answer_row

    assert BENCHMARKS == {name: b.kind for name, b in BENCHMARK_RECORDS.items()}
    assert HUB_SOURCES["gsm8k"] == BENCHMARK_RECORDS["gsm8k"].hub == ("openai/gsm8k", "main", "test")
    monkeypatch.setitem(BENCHMARK_RECORDS, "aime25", Benchmark("aime25", "aime", ("math-ai/aime25", None, "test"),
                                                               number_answer_row))
    (tmp_path / "aime25").mkdir()
    (tmp_path / "aime25" / "test.jsonl").write_text('{"problem": "p", "answer": 70.0, "id": 3}\n')
    [problem] = load_benchmark("aime25", tmp_path)
    assert (problem.id, problem.reference, problem.kind, problem.unit) == ("aime25/3", "70", "aime", None)
