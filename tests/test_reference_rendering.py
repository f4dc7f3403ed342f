"""Every reference of ../shared/data, written the way a model (or a textbook) renders it, verifies; perturbed, it does not.

tests/test_eval_benchmarks.py boxes each reference string as it is stored, which cannot show that the
reference itself is misread (``4.5e33`` as 4.5 * e * 33, ``\\frac43`` as a string). Here the completion
boxes the usual LaTeX rendering of the reference instead: e-notation as ``a \\times 10^{b}``, brace-less
``\\frac``/``\\sqrt`` with braces, whole numbers of five or more digits with LaTeX digit grouping. Two
perturbations (the first and the last digit run of the rendering plus one) must not verify.

Counts on the full files (``python tests/test_reference_rendering.py`` prints them). With the scoring of
commit 4287e50: GSM8K 1289/1319 (30 grouped numbers missed), MATH-500 488/500 (8 brace-less
references, 3 grouped numbers, ``.0000672`` accepting ``.0000673``), AIME24 30/30, AMC23 40/40, Minerva
211/272 (58 e-notation references, 3 grouped numbers), OlympiadBench 664/675 (11 grouped numbers). With
this scoring: all of them. Skipped when ../shared/data is absent (CI has it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from triage_trl.answers import verify
from triage_trl.eval import BENCHMARKS, load_benchmark

DATA = Path(__file__).parents[2] / "shared" / "data"

GROUPINGS = ("\\,", "{,}", "\\ ", "~")
_E_NOTATION = re.compile(r"^(-?)(\d+(?:\.\d+)?)[eE]([+-]?\d+)$")
_SHORTHAND = [
    (re.compile(r"\\frac\s*(\d)\s*(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac\s*(\d)\s*\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\{([^{}]*)\}\s*(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\sqrt\s*(\d)"), r"\\sqrt{\1}"),
]


def render(reference: str, index: int) -> str:
    """How a completion usually writes ``reference`` in LaTeX (``index`` picks the digit-grouping style)."""
    e_notation = _E_NOTATION.match(reference)
    if e_notation:
        sign, mantissa, exponent = e_notation.groups()
        power = f"10^{{{int(exponent)}}}"
        return sign + (power if float(mantissa) == 1 else f"{mantissa} \\times {power}")
    if re.fullmatch(r"\d{5,}", reference):
        groups = f"{int(reference):,}".split(",")
        return GROUPINGS[index % len(GROUPINGS)].join(groups)
    for pattern, braced in _SHORTHAND:
        reference = pattern.sub(braced, reference)
    return reference


def perturb(latex: str, which: int) -> str:
    """``latex`` with its first (``which=0``) or last (``which=-1``) run of digits plus one; ``+1`` appended if none.

    Digits of a subscript (the base in ``52_8``) or of a power of a braced group (``\\mbox{ cm}^2``) are
    not the answer's value and are left alone.
    """
    runs = list(re.finditer(r"(?<![\d_])(?<!_\{)(?<!\}\^)(?<!\}\^\{)\d+", latex))
    if not runs:
        return latex + "+1"
    run = runs[which]
    bumped = str(int(run.group(0)) + 1).zfill(len(run.group(0)))
    return latex[: run.start()] + bumped + latex[run.end() :]


def rendering_misses(name: str) -> tuple[int, list[str]]:
    """(number of references, ids whose rendering does not verify or whose perturbation does)."""
    problems = load_benchmark(name, DATA)
    misses = []
    for i, p in enumerate(problems):
        rendered = render(p.reference, i)
        ok = verify(f"The final answer is $\\boxed{{{rendered}}}$.", p.reference, kind=p.kind, unit=p.unit)
        perturbed = dict.fromkeys(perturb(rendered, w) for w in (0, -1))  # one when both are the same (one run)
        wrong = [verify(f"So $\\boxed{{{text}}}$.", p.reference, kind=p.kind, unit=p.unit) for text in perturbed]
        if not ok or any(wrong):
            misses.append(p.id)
    return len(problems), misses


def test_render_and_perturb():
    assert render("4.5e33", 0) == "4.5 \\times 10^{33}"
    assert render("1e-5", 0) == "10^{-5}"
    assert render("-3.3e12", 0) == "-3.3 \\times 10^{12}"
    assert render("70000", 1) == "70{,}000"
    assert render("1234", 0) == "1234"
    assert render("\\frac43", 0) == "\\frac{4}{3}"
    assert render("\\frac9{19}", 0) == "\\frac{9}{19}"
    assert render("\\frac{270}7\\text{ degrees}", 0) == "\\frac{270}{7}\\text{ degrees}"
    assert render("11\\sqrt2", 0) == "11\\sqrt{2}"
    assert perturb("4.5 \\times 10^{33}", 0) == "5.5 \\times 10^{33}"
    assert perturb("4.5 \\times 10^{33}", -1) == "4.5 \\times 10^{34}"
    assert perturb("0.006", -1) == "0.007"
    assert perturb("\\pi", 0) == "\\pi+1"
    assert perturb("52_8", -1) == "53_8"
    assert perturb("x_{12}+3", 0) == "x_{12}+4"
    assert perturb("4210_{5}", -1) == "4211_{5}"
    assert perturb("15\\mbox{ cm}^2", -1) == "16\\mbox{ cm}^2"


@pytest.mark.skipif(not DATA.is_dir(), reason=f"benchmark data not found at {DATA}")
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_rendered_reference_verifies_and_perturbed_fails(name):
    _, misses = rendering_misses(name)
    assert misses == []


if __name__ == "__main__":
    for bench in BENCHMARKS:
        total, missed = rendering_misses(bench)
        print(f"{bench}: {total - len(missed)}/{total} pass; misses: {missed[:20]}", flush=True)
