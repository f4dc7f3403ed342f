"""Final-answer extraction and verification for math benchmarks, on top of ``math-verify``.

One pure layer shared by the evaluator (``triage_trl.eval``) and the training rewards: no model, no
I/O. The answer a model gives is what it writes in the last ``\\boxed{...}`` of its completion (the
prompts ask for it); ``math-verify`` (Hugging Face, https://github.com/huggingface/Math-Verify)
parses that LaTeX into SymPy and compares it with the reference symbolically and numerically.

Kinds of reference (``kind=``):

========== ===================================================== ==============================
kind       reference                                             benchmark
========== ===================================================== ==============================
gsm8k      a number (``gsm8k_reference`` takes it after ``####``) GSM8K
aime       an integer 0-999                                      AIME 2024
amc        a number (the data stores ``27.0``)                   AMC 2023
math       LaTeX (``\\frac{\\pi}{2}``, ``(3, \\frac{\\pi}{2})``)     MATH-500
minerva    LaTeX from the solution's ``\\boxed{}``, maybe a unit    Minerva math
olympiad   LaTeX; several answers joined by commas; a unit kept  OlympiadBench
           separately by the data set (see ``olympiad_reference``)
========== ===================================================== ==============================

Numbers kinds accept a bare number when the completion has no ``\\boxed{}`` (the last number
written, as lighteval scores GSM8K); LaTeX kinds only take a boxed answer or an explicit
"final answer is ..." statement, so stray formulae in the reasoning are never scored.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache

KINDS = ("gsm8k", "math", "minerva", "olympiad", "aime", "amc")
"""The reference kinds ``verify`` understands."""

_NUMBER_KINDS = frozenset({"gsm8k", "aime", "amc"})

_BOX_RE = re.compile(r"\\(?:boxed|fbox|framebox)\s*(?:\[[^\]]*\])?\s*\{")


def extract_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` (or ``\\fbox{}``/``\\framebox{}``) in ``text``.

    Braces nest: ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. A box whose braces never close
    (a completion cut by ``max_new_tokens``) is skipped in favour of an earlier complete one.

    Args:
        text: a model completion or a reference solution.

    Returns:
        The box content with surrounding whitespace stripped, or ``None`` when ``text`` has no
        complete box.

    Raises:
        TypeError: ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_boxed expects a str, got {type(text).__name__}")
    for match in reversed(list(_BOX_RE.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            c = text[i]
            if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
                continue
            if c == "{" and (i == 0 or text[i - 1] != "\\"):
                depth += 1
            elif c == "}" and (i == 0 or text[i - 1] != "\\"):
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def gsm8k_reference(answer_field: str) -> str:
    """The reference number of a GSM8K ``answer`` field: the text after the last ``####``, commas removed.

    ``"... so he made 70,000.\\n#### 70,000"`` gives ``"70000"`` (format of openai/grade-school-math).

    Raises:
        ValueError: the field has no ``####`` or nothing after it.
    """
    if "####" not in answer_field:
        raise ValueError(
            "GSM8K answer field has no '####' marker; pass the dataset's `answer` column "
            f"(got {answer_field[-80:]!r})"
        )
    ref = answer_field.rsplit("####", 1)[1].strip().replace(",", "")
    if not ref:
        raise ValueError(f"GSM8K answer field has nothing after '####': {answer_field[-80:]!r}")
    return ref


def olympiad_reference(final_answer: list[str] | str, unit: str | None = None) -> str:
    """The LaTeX reference of an OlympiadBench row: its ``final_answer`` list as one comma-joined answer.

    OlympiadBench stores the answer as a one-element list of LaTeX strings (``["$2,-1,-18$"]``; rows
    with ``is_multiple_answer`` hold several comma-separated values, which math-verify compares as
    a set). The ``unit`` column (``"km/h"``, ``"^{\\circ}"``) is not part of the answer: the prompt
    states it and ``verify`` strips a trailing unit from the prediction, so ``unit`` is accepted
    here only to check its type.

    Raises:
        ValueError: ``final_answer`` is empty.
    """
    if unit is not None and not isinstance(unit, str):
        raise TypeError(f"unit must be a str or None, got {type(unit).__name__}")
    parts = [final_answer] if isinstance(final_answer, str) else list(final_answer)
    parts = [p.strip().strip("$").strip() for p in parts if p and p.strip()]
    if not parts:
        raise ValueError("OlympiadBench row has an empty final_answer")
    return ", ".join(parts)


@lru_cache(maxsize=None)
def _configs(kind: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig
    from math_verify.parser import NormalizationConfig

    latex_norm = NormalizationConfig(
        basic_latex=True, units=True, malformed_operators=False, nits=True, boxed="all"
    )
    pred_latex = LatexExtractionConfig(
        boxed_match_priority=0, try_extract_without_anchor=False, normalization_config=latex_norm
    )
    gold_latex = LatexExtractionConfig(boxed_match_priority=0, normalization_config=latex_norm)
    if kind in _NUMBER_KINDS:
        pred = (replace(pred_latex, try_extract_without_anchor=True), ExprExtractionConfig())
        gold = (gold_latex, ExprExtractionConfig())
    else:
        pred = (pred_latex, ExprExtractionConfig(try_extract_without_anchor=False))
        gold = (gold_latex,)
    return pred, gold


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown answer kind {kind!r}; use one of {', '.join(KINDS)}")


_ASSIGNMENT_RE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*([^=,;<>]+)$")

_UNIT_RE_CACHE: dict[str, re.Pattern] = {}


def _strip_unit(text: str, unit: str | None) -> str:
    """Drop a trailing ``unit`` (as LaTeX or plain text) from a boxed answer."""
    if not unit:
        return text
    core = unit.strip().strip("$").strip()
    if not core:
        return text
    pat = _UNIT_RE_CACHE.get(core)
    if pat is None:
        pat = re.compile(
            r"\s*\$?\s*(?:\\(?:text|mathrm|mbox)\s*\{\s*)?" + re.escape(core) + r"\s*\}?\s*\$?\s*$"
        )
        _UNIT_RE_CACHE[core] = pat
    return pat.sub("", text)


def parse_reference(reference: str, *, kind: str, timeout_seconds: int | None = 5) -> list:
    """Parse a reference answer with math-verify; returns ``math_verify.parse``'s list (empty if unparsable).

    The reference is wrapped in ``\\boxed{}`` and goes through the same LaTeX normalisation as
    predictions. Numbers kinds drop thousands separators. LaTeX kinds score the right-hand side of
    a single-symbol assignment (``N=n`` -> ``n``): latex2sympy folds symbol case, so ``Eq(N, n)``
    would become ``Eq(n, n)`` and match any ``N=...`` prediction (OlympiadBench row 122).

    Raises:
        ValueError: unknown ``kind``.
    """
    _check_kind(kind)
    _, gold_cfg = _configs(kind)
    from math_verify import parse

    reference = str(reference).strip()
    if kind in _NUMBER_KINDS:
        reference = reference.replace(",", "")
    else:
        # "N=n": latex2sympy folds symbol case, so Eq(N, n) becomes Eq(n, n) == True and would
        # match any "N=..." prediction; score the right-hand side (math-verify takes the
        # right-hand side of a predicted assignment too).
        assignment = _ASSIGNMENT_RE.match(reference)
        if assignment:
            reference = assignment.group(1)
    return parse("\\boxed{" + reference + "}", extraction_config=gold_cfg, parsing_timeout=timeout_seconds)


def parse_prediction(
    prediction_text: str, *, kind: str, unit: str | None = None, timeout_seconds: int | None = 5
) -> list:
    """Extract and parse a completion's final answer; returns ``math_verify.parse``'s list.

    The list is ``[sympy_object, extracted_string]`` or ``[]`` when no answer was found. ``unit`` (a
    unit the data set keeps apart from the answer, OlympiadBench) is removed from the end of the
    boxed content before parsing.

    Raises:
        ValueError: unknown ``kind``.
    """
    _check_kind(kind)
    pred_cfg, _ = _configs(kind)
    from math_verify import parse

    if unit:
        boxed = extract_boxed(prediction_text)
        if boxed is not None:
            prediction_text = "\\boxed{" + _strip_unit(boxed, unit) + "}"
    return parse(prediction_text, extraction_config=pred_cfg, parsing_timeout=timeout_seconds)


def extract_answer(prediction_text: str, *, kind: str, unit: str | None = None) -> str | None:
    """The answer string ``verify`` would score for ``prediction_text`` (``None`` when none is found)."""
    parsed = parse_prediction(prediction_text, kind=kind, unit=unit)
    return str(parsed[-1]) if parsed else None


def verify(
    prediction_text: str,
    reference: str,
    *,
    kind: str,
    unit: str | None = None,
    timeout_seconds: int | None = 5,
) -> bool:
    """Is the final answer of ``prediction_text`` equal to ``reference``? (math-verify, gold first)

    Args:
        prediction_text: the full completion; its last ``\\boxed{}`` is the answer (numbers kinds
            fall back to the last number in the text).
        reference: the reference answer as a string: a number for ``gsm8k``/``aime``/``amc``
            (``gsm8k_reference`` gives it from a GSM8K row), LaTeX for ``math``/``minerva``/
            ``olympiad`` (``olympiad_reference`` for OlympiadBench rows).
        kind: one of ``KINDS``.
        unit: OlympiadBench's separate unit, stripped from the prediction before comparison.
        timeout_seconds: per parse/compare limit. math-verify enforces it with ``signal.alarm``,
            which only works in the main thread: pass ``None`` from worker threads.

    Returns:
        ``True`` when math-verify finds the two equal; ``False`` when they differ, when the
        completion has no answer or when the reference cannot be parsed.

    Raises:
        ValueError: unknown ``kind``.
    """
    from math_verify import verify as mv_verify

    gold = parse_reference(reference, kind=kind, timeout_seconds=timeout_seconds)
    if not gold:
        return False
    pred = parse_prediction(prediction_text, kind=kind, unit=unit, timeout_seconds=timeout_seconds)
    if not pred:
        return False
    return bool(mv_verify(gold, pred, timeout_seconds=timeout_seconds))


__all__ = [
    "KINDS",
    "extract_answer",
    "extract_boxed",
    "gsm8k_reference",
    "olympiad_reference",
    "parse_prediction",
    "parse_reference",
    "verify",
]
