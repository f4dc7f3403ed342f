"""Final-answer extraction and verification for math benchmarks, on top of ``math-verify``.

One layer shared by the evaluator (``triage_trl.eval``) and the training rewards, with no model. The answer a model gives is what it writes in the last ``\\boxed{...}`` of its completion (the
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

The answer is the content of the LAST box only (math-verify alone joins nearby boxes into a set, so
"\\boxed{5}. Wait, no: \\boxed{7}" would read {5, 7}). Numbers kinds accept a bare number when the
completion has no ``\\boxed{}`` (the last number written, as lighteval scores GSM8K); LaTeX kinds only
take a boxed answer or an explicit "final answer is ..." statement, so stray formulae in the reasoning
are never scored.

Before math-verify parses them, the box content and the reference are rewritten by
``triage_trl.answers.latex``: brace-less TeX arguments (``\\frac43``, ``11\\sqrt2``) get braces, LaTeX
digit grouping (``10\\,000``, ``10{,}000``) and a closing full stop are removed, and for the numeric
kinds (``gsm8k``, ``aime``, ``amc``, ``minerva``) e-notation (``4.5e33``, ``1e-5``) becomes
``a \\times 10^{b}``; in ``math`` and ``olympiad`` answers ``2e-1`` keeps meaning 2e - 1 (Euler's number). An answer made only of numbers
(``2.88 \\times 10^{-19}``) is evaluated to one number before comparison, and floats are compared to six
significant digits for small references (math-verify rounds to six decimals, which makes
``1.1 \\times 10^{-7}`` equal ``10^{-7}``). The Unicode minus (``−7``) and fullwidth digits (``７``) are
written as ASCII in every completion and reference, boxed or not (``answers.latex.normalize_unicode``).

Relations. A boxed answer that is an equation or a chain of equations (``3 + 4 = 7``, ``x = 5``,
``x = 3 + 4 = 7``), scored against a reference that is not one, is correct only when every ``=`` in it
holds (both sides equal symbolically; a lone variable on the far left, ``x = ...``, names the answer
and is not compared) and its last side matches the reference: ``\\boxed{3 + 4 = 8}`` is wrong for 8,
``\\boxed{8 = 7}`` wrong for 7, ``\\boxed{1 = 2 = 8}`` wrong for 8. math-verify alone scores the
right-hand side, which a policy could learn to exploit. A reference that is itself a relation
(``y = 2x + 1``) is compared by math-verify as a relation.

Percentages follow math-verify's one rule, for predictions and references alike: ``p\\%`` equals both
``p/100`` and ``p`` (``\\boxed{0.5}``, ``\\boxed{50}`` and ``\\boxed{50\\%}`` are all correct for the
reference ``50\\%``, and ``\\boxed{50\\%}`` for ``0.5`` or ``50``), since data sets write a percentage
answer either way.

:func:`check_answer` and :func:`verify` end within ``timeout_seconds`` in any thread: the check runs
in a helper process that is killed when it overruns (``triage_trl.answers.worker``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from functools import lru_cache

from .latex import brace_macro_arguments, expand_e_notation, join_digit_groups, normalize_unicode

KINDS = ("gsm8k", "math", "minerva", "olympiad", "aime", "amc")
"""The reference kinds ``verify`` understands."""

_NUMBER_KINDS = frozenset({"gsm8k", "aime", "amc"})
_E_NOTATION_KINDS = _NUMBER_KINDS | {"minerva"}

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
    span = boxed_span(text)
    return None if span is None else normalize_unicode(text[span[0]:span[1]]).strip()


def boxed_span(text: str) -> tuple[int, int] | None:
    """``(start, end)`` of the content of the last complete ``\\boxed{...}`` in ``text`` (``text[end]`` is its
    closing brace), or ``None``; the rules of :func:`extract_boxed`."""
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
                    return start, i
    return None


def gsm8k_reference(answer_field: str) -> str:
    """The reference number of a GSM8K ``answer`` field: the text after the last ``####``, commas removed.

    ``"... so he made 70,000.\\n#### 70,000"`` gives ``"70000"`` (format of openai/grade-school-math).

    Raises:
        ValueError: the field has no ``####`` or nothing after it.
    """
    answer_field = normalize_unicode(answer_field)
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


_FULL_STOP_RE = re.compile(r"(?<![\\.])\.\s*$")

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


def normalize_answer_latex(latex: str, *, kind: str) -> str:
    """The LaTeX math-verify is given for a box content or reference of ``kind`` (see ``triage_trl.answers.latex``).

    ``\\frac43`` -> ``\\frac{4}{3}``, ``10\\,000`` -> ``10000`` and a closing full stop dropped
    (``\\boxed{104.}``) for every kind; ``4.5e33`` -> ``4.5 \\times 10^{33}`` for ``gsm8k``, ``aime``,
    ``amc`` and ``minerva`` only.

    Raises:
        ValueError: unknown ``kind``.
    """
    _check_kind(kind)
    latex = join_digit_groups(brace_macro_arguments(_FULL_STOP_RE.sub("", latex)))
    return expand_e_notation(latex) if kind in _E_NOTATION_KINDS else latex


def parse_reference(reference: str, *, kind: str, timeout_seconds: int | None = 5) -> list:
    """Parse a reference answer with math-verify; returns ``math_verify.parse``'s list (empty if unparsable).

    The reference is rewritten by :func:`normalize_answer_latex`, wrapped in ``\\boxed{}`` and goes through
    the same LaTeX normalisation as predictions. Numbers kinds drop thousands separators. LaTeX kinds
    score the right-hand side of a single-symbol assignment (``N=n`` -> ``n``): latex2sympy folds symbol
    case, so ``Eq(N, n)`` would become ``Eq(n, n)`` and match any ``N=...`` prediction (OlympiadBench
    row 122). ``timeout_seconds`` uses ``signal.alarm`` (main thread only; ``None`` elsewhere).

    Raises:
        ValueError: unknown ``kind``.
    """
    _check_kind(kind)
    _, gold_cfg = _configs(kind)
    from math_verify import parse

    reference = normalize_answer_latex(normalize_unicode(str(reference)).strip(), kind=kind)
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

    The list is ``[sympy_object, extracted_string]`` or ``[]`` when no answer was found. When the
    completion has a box, only the content of the last one is parsed, after ``unit`` (a unit the data
    set keeps apart from the answer, OlympiadBench) is removed from its end and
    :func:`normalize_answer_latex`; without a box the whole text goes to math-verify's extraction.
    ``timeout_seconds`` uses ``signal.alarm`` (main thread only; ``None`` elsewhere).

    Raises:
        ValueError: unknown ``kind``.
    """
    _check_kind(kind)
    pred_cfg, _ = _configs(kind)
    from math_verify import parse

    prediction_text = normalize_unicode(prediction_text)
    boxed = extract_boxed(prediction_text)
    if boxed is not None:
        prediction_text = "\\boxed{" + normalize_answer_latex(_strip_unit(boxed, unit), kind=kind) + "}"
    return parse(prediction_text, extraction_config=pred_cfg, parsing_timeout=timeout_seconds)


@dataclass(frozen=True)
class AnswerCheck:
    """The outcome of :func:`check_answer`.

    Attributes:
        correct: math-verify finds the completion's final answer equal to the reference.
        extracted: the answer string that was scored (math-verify's extraction of the last box content
            after :func:`normalize_answer_latex`), ``None`` when no answer was found or the check ran out
            of time.
    """

    correct: bool
    extracted: str | None


def _float_rounding(gold: list) -> int:
    """Decimals math-verify rounds floats to: its default 6, more for |reference| < 0.1 (6 significant digits)."""
    try:
        magnitude = math.floor(math.log10(abs(float(gold[0]))))
    except (TypeError, ValueError, OverflowError, IndexError):
        return 6
    return min(max(6, 5 - magnitude), 100)


def _as_one_number(parsed: list, step_timeout: int | None) -> list:
    """``parsed`` with an expression made only of numbers (``2.88 \\times 10^{-19}``) evaluated to one number.

    math-verify compares two unevaluated numbers through ``evalf(chop=True)`` of their difference, which
    drops differences below about 1e-15 (2.88e-19 would equal 3.88e-19). One Float (decimal input) or
    one Rational instead takes its number comparison. Percentages (``UnevaluatedExpr``) are kept.
    """
    import sympy
    from math_verify.utils import timeout

    expr = parsed[0] if parsed else None
    if (not isinstance(expr, sympy.Expr) or expr.is_Atom or expr.has(sympy.UnevaluatedExpr)
            or not all(isinstance(atom, sympy.Number) for atom in expr.atoms())):
        return parsed
    evaluate = expr.evalf if expr.has(sympy.Float) else expr.doit
    return [timeout(step_timeout)(evaluate)(), *parsed[1:]]


def _relation_sides(expr) -> list | None:
    """The sides ``[s0, s1, ..., sn]`` of an equation or chain of equations (``Eq`` or ``And`` of ``Eq`` as
    math-verify parses ``a = b = c``), or ``None`` when ``expr`` is not one."""
    import sympy

    if isinstance(expr, sympy.Equality):
        return [expr.lhs, expr.rhs]
    if isinstance(expr, sympy.And) and expr.args and all(isinstance(a, sympy.Equality) for a in expr.args):
        sides = [expr.args[0].lhs]
        for link in expr.args:
            sides.append(link.rhs)  # math-verify builds Eq(s0, s1) & Eq(s1, s2) ...; the order of And is sorted
        links = {(a.lhs, a.rhs) for a in expr.args}
        chain = _chain_from_links(links)
        return chain if chain is not None else sides
    return None


def _chain_from_links(links: set) -> list | None:
    """Order the links ``{(a, b), (b, c)}`` of a chain into ``[a, b, c]`` (``And`` sorts its arguments)."""
    rights = {b for _, b in links}
    starts = [a for a, _ in links if a not in rights]
    if len(starts) != 1:
        return None
    following = dict(links)
    chain = [starts[0]]
    while chain[-1] in following and len(chain) <= len(links):
        chain.append(following[chain[-1]])
    return chain if len(chain) == len(links) + 1 else None


def _relation_holds(sides: list, step_timeout: int | None) -> bool:
    """Does every ``=`` of ``s0 = s1 = ... = sn`` hold? A lone symbol ``s0`` (``x = ...``) names the answer and is
    not compared; the other neighbours must be equal (``simplify(a - b) == 0``)."""
    import sympy
    from math_verify.utils import timeout

    if isinstance(sides[0], sympy.Symbol):
        sides = sides[1:]

    def equal(a, b) -> bool:
        diff = sympy.simplify(sympy.sympify(a).doit() - sympy.sympify(b).doit())
        if diff == 0:
            return True
        if diff.free_symbols:
            return False
        value = complex(diff.evalf())
        scale = max(1.0, abs(complex(sympy.sympify(b).doit().evalf())))
        return abs(value) <= 1e-9 * scale

    try:
        return all(timeout(step_timeout)(equal)(a, b) for a, b in zip(sides, sides[1:]))
    except Exception:  # unparsable or overrun: the relation is not shown to hold
        return False


def check_in_process(
    prediction_text: str, reference: str | None, kind: str, unit: str | None, step_timeout: int | None
) -> AnswerCheck:
    """:func:`check_answer` in this process, without a wall-clock limit: what the helper process of
    :mod:`.worker` runs. ``step_timeout`` (seconds, or ``None``) bounds each math-verify step (main thread only).
    Arguments are :func:`check_answer`'s, already validated."""
    from math_verify import verify as mv_verify
    from math_verify.errors import TimeoutException

    pred = parse_prediction(prediction_text, kind=kind, unit=unit, timeout_seconds=step_timeout)
    extracted = str(pred[-1]) if pred else None
    gold = parse_reference(reference, kind=kind, timeout_seconds=step_timeout) if reference is not None and pred else []
    if not gold:
        return AnswerCheck(False, extracted)
    sides = _relation_sides(pred[0])
    if sides is not None and _relation_sides(gold[0]) is None and not _relation_holds(sides, step_timeout):
        return AnswerCheck(False, extracted)
    try:
        gold, pred = _as_one_number(gold, step_timeout), _as_one_number(pred, step_timeout)
    except TimeoutException:
        return AnswerCheck(False, extracted)
    correct = mv_verify(gold, pred, float_rounding=_float_rounding(gold), timeout_seconds=step_timeout)
    return AnswerCheck(bool(correct), extracted)


def check_answer(
    prediction_text: str,
    reference: str | None,
    *,
    kind: str,
    unit: str | None = None,
    timeout_seconds: float | None = 10,
) -> AnswerCheck:
    """Extract the final answer of ``prediction_text`` and compare it with ``reference`` (math-verify, gold first).

    Args:
        prediction_text: the full completion; its last ``\\boxed{}`` is the answer (numbers kinds
            fall back to the last number in the text).
        reference: the reference answer as a string: a number for ``gsm8k``/``aime``/``amc``
            (``gsm8k_reference`` gives it from a GSM8K row), LaTeX for ``math``/``minerva``/
            ``olympiad`` (``olympiad_reference`` for OlympiadBench rows); ``None`` to only extract.
        kind: one of ``KINDS``.
        unit: OlympiadBench's separate unit, stripped from the prediction before comparison.
        timeout_seconds: wall-clock limit of the whole check (seconds), in any thread: the check
            runs in a helper process that is killed when it overruns (``triage_trl.answers.worker``;
            the helper's start-up is not counted), and math-verify's own limit per parse/compare
            step there is half of it (5 s by default, math-verify's default). ``None`` checks in
            this process without a limit.

    Returns:
        :class:`AnswerCheck`; ``correct`` is ``False`` when the answers differ, when the completion
        has no answer, when the reference cannot be parsed, or when the check ran out of time.

    Raises:
        ValueError: unknown ``kind``, or ``timeout_seconds <= 0``.
        TypeError: ``prediction_text`` is not a string.
    """
    _check_kind(kind)
    if not isinstance(prediction_text, str):
        raise TypeError(f"prediction_text must be a str, got {type(prediction_text).__name__}")
    reference = None if reference is None else str(reference)
    if timeout_seconds is None:
        return check_in_process(prediction_text, reference, kind, unit, None)
    if not timeout_seconds > 0:
        raise ValueError(f"timeout_seconds must be > 0 or None (no limit), got {timeout_seconds}")
    from .worker import run_check

    reply = run_check(
        {"prediction_text": prediction_text, "reference": reference, "kind": kind, "unit": unit},
        timeout_seconds=timeout_seconds,
    )
    if reply is None:
        return AnswerCheck(False, None)
    return AnswerCheck(bool(reply["correct"]), reply["extracted"])


def extract_answer(
    prediction_text: str, *, kind: str, unit: str | None = None, timeout_seconds: float | None = 10
) -> str | None:
    """The answer string :func:`check_answer` scores for ``prediction_text`` (``None`` when none is found)."""
    return check_answer(prediction_text, None, kind=kind, unit=unit, timeout_seconds=timeout_seconds).extracted


def verify(
    prediction_text: str,
    reference: str,
    *,
    kind: str,
    unit: str | None = None,
    timeout_seconds: float | None = 10,
) -> bool:
    """Is the final answer of ``prediction_text`` equal to ``reference``? (:func:`check_answer`'s ``correct``)

    ``verify(r"\\boxed{5}, \\boxed{7}", "7", kind="math")`` is ``True`` (the last box is the answer);
    arguments and errors as for :func:`check_answer`.
    """
    return check_answer(prediction_text, reference, kind=kind, unit=unit, timeout_seconds=timeout_seconds).correct


__all__ = [
    "KINDS",
    "AnswerCheck",
    "boxed_span",
    "check_answer",
    "check_in_process",
    "extract_answer",
    "extract_boxed",
    "gsm8k_reference",
    "normalize_answer_latex",
    "olympiad_reference",
    "parse_prediction",
    "parse_reference",
    "verify",
]
