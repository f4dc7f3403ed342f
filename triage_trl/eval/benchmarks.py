"""The six math benchmarks of the TRIAGE paper as lists of :class:`Problem`, from local jsonl or the Hub.

Local layout (``data_dir``, ``docs/evaluation.md``): ``<data_dir>/<folder>/test.jsonl`` with each source's own
fields:

============== ============= ==================================================== ==========
name           folder        fields used (problem / reference / id)                kind
============== ============= ==================================================== ==========
gsm8k          gsm8k         question / answer after ``####`` / line number        gsm8k
math500        math500       problem / answer / unique_id                          math
aime24         aime24        problem / answer / id                                 aime
amc23          amc23         problem (or question) / answer (27.0 -> "27") / id    amc
minerva_math   minerva_math  problem / last ``\\boxed{}`` of solution / idx         minerva
olympiadbench  olympiadbench question (+ context) / final_answer list, unit / id   olympiad
============== ============= ==================================================== ==========

Without ``data_dir`` the rows come from the Hugging Face Hub (each :class:`Benchmark`'s ``hub``; needs network or
the datasets cache) and are read with the same field rules. :data:`BENCHMARK_RECORDS` holds one record per
benchmark: name, answer kind, Hub source and row function together. Sources of the rows: GSM8K:
openai/grade-school-math; MATH-500: Lightman et al. 2023; AIME24, AMC23, Minerva math, OlympiadBench:
QwenLM/Qwen2.5-Math evaluation data.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..answers import extract_boxed, gsm8k_reference, olympiad_reference
from ..data.jsonl import read_jsonl

__all__ = ["BENCHMARKS", "BENCHMARK_RECORDS", "HUB_SOURCES", "Benchmark", "Problem", "load_benchmark"]


@dataclass(frozen=True)
class Problem:
    """One benchmark problem.

    Attributes:
        id: ``"<benchmark>/<source id>"``, stable across runs (the resume key).
        benchmark: benchmark name (a key of :data:`BENCHMARKS`).
        problem: the question text shown to the model (OlympiadBench: context, question, unit note).
        reference: the reference answer string ``triage_trl.answers.verify`` takes.
        kind: the answer kind for ``verify`` (``triage_trl.answers.KINDS``).
        unit: OlympiadBench's separate unit (stripped from predictions), else ``None``.
    """

    id: str
    benchmark: str
    problem: str
    reference: str
    kind: str
    unit: str | None = None
    meta: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        return asdict(self)


def _number(value) -> str:
    """``27.0`` -> ``"27"``; ``"073"`` stays a string for math-verify (which reads it as 73)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _first(row: dict, keys: tuple[str, ...], what: str, where: str):
    for key in keys:
        if row.get(key) not in (None, ""):
            return row[key]
    raise ValueError(f"{where}: no {what} field (looked for {', '.join(keys)}; row has {sorted(row)}).")


# Row -> problem fields, one function per benchmark: (row, index in the file, where for errors) ->
# {"text", "reference", "source_id", "unit"?, "meta"?}.


def gsm8k_row(row: dict, index: int, where: str) -> dict:
    """GSM8K: ``question``; the reference is the number after ``####`` of ``answer``; the line number is the id."""
    return {"text": _first(row, ("question",), "question", where),
            "reference": gsm8k_reference(_first(row, ("answer",), "answer", where)), "source_id": index}


def math500_row(row: dict, index: int, where: str) -> dict:
    """MATH-500: ``problem`` / ``answer`` (LaTeX) / ``unique_id``; subject and level kept as meta."""
    return {"text": _first(row, ("problem", "question"), "problem", where),
            "reference": str(_first(row, ("answer",), "answer", where)),
            "source_id": row.get("unique_id", row.get("id", index)),
            "meta": {"subject": row.get("subject"), "level": row.get("level")}}


def number_answer_row(row: dict, index: int, where: str) -> dict:
    """AIME 2024, AMC 2023: ``problem`` (or ``question``) / a number ``answer`` (``27.0`` -> ``"27"``) / ``id``."""
    return {"text": _first(row, ("problem", "question"), "problem", where),
            "reference": _number(_first(row, ("answer",), "answer", where)),
            "source_id": row.get("unique_id", row.get("id", index))}


def minerva_row(row: dict, index: int, where: str) -> dict:
    """Minerva math: ``problem`` / ``answer``, else the last ``\\boxed{}`` of ``solution`` / ``idx``."""
    text = _first(row, ("problem", "question"), "problem", where)
    if row.get("answer") not in (None, ""):
        reference = str(row["answer"])
    else:
        reference = extract_boxed(_first(row, ("solution",), "solution", where))
        if reference is None:
            raise ValueError(f"{where}: Minerva solution has no \\boxed{{}} answer.")
    return {"text": text, "reference": reference, "source_id": row.get("idx", index)}


def olympiad_row(row: dict, index: int, where: str) -> dict:
    """OlympiadBench: context + question (+ a note for several answers and for the unit) / ``final_answer`` list
    (``olympiad_reference``) with its separate ``unit`` / ``id``."""
    question = _first(row, ("question", "problem"), "question", where)
    unit = row.get("unit") or None
    reference = olympiad_reference(_first(row, ("final_answer", "answer"), "final_answer", where), unit)
    parts = [row["context"].strip()] if row.get("context") else []
    parts.append(question.strip())
    if row.get("is_multiple_answer"):
        parts.append("The problem has several answers: give all of them, separated by commas.")
    if unit:
        parts.append(f"The unit of the answer is {unit.strip()}; do not write it in the box.")
    return {"text": "\n".join(parts), "reference": reference, "source_id": row.get("id", index), "unit": unit,
            "meta": {"answer_type": row.get("answer_type"), "is_multiple_answer": bool(row.get("is_multiple_answer"))}}


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: everything ``load_benchmark`` and the model card need about it.

    Attributes:
        name: the benchmark's name, also its local folder (``<data_dir>/<name>/test.jsonl``).
        kind: the answer kind of its references (``triage_trl.answers.KINDS``).
        hub: ``(dataset id, config, split)`` on the Hugging Face Hub, loaded when no ``data_dir`` is given and
            recorded in a card's ``model-index``.
        row: the row -> problem fields function (see :func:`gsm8k_row`).
    """

    name: str
    kind: str
    hub: tuple[str, str | None, str]
    row: Callable[[dict, int, str], dict]


BENCHMARK_RECORDS = {b.name: b for b in (
    Benchmark("gsm8k", "gsm8k", ("openai/gsm8k", "main", "test"), gsm8k_row),
    Benchmark("math500", "math", ("HuggingFaceH4/MATH-500", None, "test"), math500_row),
    Benchmark("aime24", "aime", ("HuggingFaceH4/aime_2024", None, "train"), number_answer_row),
    Benchmark("amc23", "amc", ("math-ai/amc23", None, "test"), number_answer_row),
    Benchmark("minerva_math", "minerva", ("math-ai/minervamath", None, "test"), minerva_row),
    Benchmark("olympiadbench", "olympiad", ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"), olympiad_row),
)}
"""Benchmark name -> :class:`Benchmark`. Adding a benchmark is one row function and one entry here."""

BENCHMARKS = {name: b.kind for name, b in BENCHMARK_RECORDS.items()}
"""Benchmark name -> answer kind (derived from :data:`BENCHMARK_RECORDS`)."""

HUB_SOURCES = {name: b.hub for name, b in BENCHMARK_RECORDS.items()}
"""Benchmark name -> (Hub dataset id, config, split) (derived from :data:`BENCHMARK_RECORDS`)."""


def _problem(name: str, row: dict, index: int, where: str) -> Problem:
    record = BENCHMARK_RECORDS[name]
    fields = record.row(row, index, where)
    return Problem(id=f"{name}/{fields['source_id']}", benchmark=name, problem=str(fields["text"]),
                   reference=fields["reference"], kind=record.kind, unit=fields.get("unit"),
                   meta=fields.get("meta", {}))


def load_benchmark(name: str, data_dir: str | os.PathLike | None = None, limit: int | None = None) -> list[Problem]:
    """The problems of benchmark ``name``, in file order (``limit``: the first ``limit`` of them).

    Args:
        name: a key of :data:`BENCHMARK_RECORDS`.
        data_dir: folder holding ``<name>/test.jsonl`` (the layout above). ``None`` loads
            :data:`HUB_SOURCES` ``[name]`` with ``datasets.load_dataset`` (network or cache needed).
        limit: keep the first ``limit`` problems (``None``: all).

    Returns:
        ``list[Problem]`` with unique ids.

    Raises:
        ValueError: unknown ``name``, ``limit < 1``, a row without the fields above, duplicate ids.
        FileNotFoundError: ``data_dir`` given but ``<data_dir>/<name>/test.jsonl`` missing.
    """
    if name not in BENCHMARK_RECORDS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARK_RECORDS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    if data_dir is not None:
        path = Path(data_dir).expanduser() / name / "test.jsonl"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist: --data-dir must hold <benchmark>/test.jsonl folders (see docs/evaluation.md), "
                "or leave it out to load from the Hub."
            )
        rows, where = read_jsonl(str(path)), str(path)
    else:
        from datasets import load_dataset

        repo, config, split = BENCHMARK_RECORDS[name].hub
        rows, where = list(load_dataset(repo, config, split=split)), f"{repo}[{split}]"
    if limit is not None:
        rows = rows[:limit]
    problems = [_problem(name, row, i, f"{where} row {i}") for i, row in enumerate(rows)]
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: problem ids are not unique; the resume key needs them to be.")
    return problems
