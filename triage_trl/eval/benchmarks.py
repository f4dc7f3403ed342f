"""The six math benchmarks of the TRIAGE paper as lists of :class:`Problem`, from local jsonl or the Hub.

Local layout (``data_dir``, as ``../shared/data`` of this project): ``<data_dir>/<folder>/test.jsonl``
with each source's own fields:

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

Without ``data_dir`` the rows come from the Hugging Face Hub (:data:`HUB_SOURCES`; needs network or
the datasets cache) and are read with the same field rules. Source of the local files:
``../shared/data/README.md`` (GSM8K: openai/grade-school-math; MATH-500: Lightman et al. 2023;
AIME24, AMC23, Minerva math, OlympiadBench: QwenLM/Qwen2.5-Math evaluation data).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..answers import extract_boxed, gsm8k_reference, olympiad_reference
from ..data.jsonl import read_jsonl

__all__ = ["BENCHMARKS", "HUB_SOURCES", "Problem", "load_benchmark"]


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


BENCHMARKS = {
    "gsm8k": "gsm8k",
    "math500": "math",
    "aime24": "aime",
    "amc23": "amc",
    "minerva_math": "minerva",
    "olympiadbench": "olympiad",
}
"""Benchmark name -> answer kind. The local folder has the benchmark's name."""

HUB_SOURCES = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "amc23": ("math-ai/amc23", None, "test"),
    "minerva_math": ("math-ai/minervamath", None, "test"),
    "olympiadbench": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
}
"""Benchmark name -> (Hub dataset id, config, split) used when no ``data_dir`` is given."""


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


def _problem(name: str, row: dict, index: int, where: str) -> Problem:
    kind = BENCHMARKS[name]
    unit = None
    meta = {}
    if name == "gsm8k":
        text = _first(row, ("question",), "question", where)
        reference = gsm8k_reference(_first(row, ("answer",), "answer", where))
        source_id = index
    elif name == "minerva_math":
        text = _first(row, ("problem", "question"), "problem", where)
        if row.get("answer") not in (None, ""):
            reference = str(row["answer"])
        else:
            reference = extract_boxed(_first(row, ("solution",), "solution", where))
            if reference is None:
                raise ValueError(f"{where}: Minerva solution has no \\boxed{{}} answer.")
        source_id = row.get("idx", index)
    elif name == "olympiadbench":
        question = _first(row, ("question", "problem"), "question", where)
        unit = row.get("unit") or None
        reference = olympiad_reference(_first(row, ("final_answer", "answer"), "final_answer", where), unit)
        parts = [row["context"].strip()] if row.get("context") else []
        parts.append(question.strip())
        if row.get("is_multiple_answer"):
            parts.append("The problem has several answers: give all of them, separated by commas.")
        if unit:
            parts.append(f"The unit of the answer is {unit.strip()}; do not write it in the box.")
        text = "\n".join(parts)
        source_id = row.get("id", index)
        meta = {"answer_type": row.get("answer_type"), "is_multiple_answer": bool(row.get("is_multiple_answer"))}
    else:
        text = _first(row, ("problem", "question"), "problem", where)
        answer = _first(row, ("answer",), "answer", where)
        reference = _number(answer) if kind in ("aime", "amc") else str(answer)
        source_id = row.get("unique_id", row.get("id", index))
        if name == "math500":
            meta = {"subject": row.get("subject"), "level": row.get("level")}
    return Problem(
        id=f"{name}/{source_id}", benchmark=name, problem=str(text), reference=reference, kind=kind, unit=unit, meta=meta
    )


def load_benchmark(name: str, data_dir: str | os.PathLike | None = None, limit: int | None = None) -> list[Problem]:
    """The problems of benchmark ``name``, in file order (``limit``: the first ``limit`` of them).

    Args:
        name: a key of :data:`BENCHMARKS`.
        data_dir: folder holding ``<name>/test.jsonl`` (layout of ``../shared/data``). ``None`` loads
            :data:`HUB_SOURCES` ``[name]`` with ``datasets.load_dataset`` (network or cache needed).
        limit: keep the first ``limit`` problems (``None``: all).

    Returns:
        ``list[Problem]`` with unique ids.

    Raises:
        ValueError: unknown ``name``, ``limit < 1``, a row without the fields above, duplicate ids.
        FileNotFoundError: ``data_dir`` given but ``<data_dir>/<name>/test.jsonl`` missing.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    if data_dir is not None:
        path = Path(data_dir).expanduser() / name / "test.jsonl"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist: --data-dir must hold <benchmark>/test.jsonl folders (like ../shared/data), "
                "or leave it out to load from the Hub."
            )
        rows, where = read_jsonl(str(path)), str(path)
    else:
        from datasets import load_dataset

        repo, config, split = HUB_SOURCES[name]
        rows, where = list(load_dataset(repo, config, split=split)), f"{repo}[{split}]"
    if limit is not None:
        rows = rows[:limit]
    problems = [_problem(name, row, i, f"{where} row {i}") for i, row in enumerate(rows)]
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: problem ids are not unique; the resume key needs them to be.")
    return problems
