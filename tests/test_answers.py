"""triage_trl.answers: boxed extraction, GSM8K/OlympiadBench references and math-verify scoring per kind.

Whole-benchmark checks (every reference of ../shared/data scored as a completion) live in
tests/test_eval_benchmarks.py.
"""

import pytest

from triage_trl.answers import (
    KINDS,
    extract_answer,
    extract_boxed,
    gsm8k_reference,
    olympiad_reference,
    verify,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}} then \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\boxed{ \\{1, 2\\} }", "\\{1, 2\\}"),
        ("$\\fbox{7}$", "7"),
        ("\\framebox{204} minutes", "204"),
        ("\\boxed{5} and a cut one \\boxed{\\frac{1}{", "5"),
        ("no box at all: 12", None),
        ("\\boxed{", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_boxed_rejects_non_str():
    with pytest.raises(TypeError, match="expects a str"):
        extract_boxed(None)


def test_gsm8k_reference():
    assert gsm8k_reference("He pays 70,000 - 1 = <<70000-1=69999>>69,999\n#### 69,999") == "69999"
    assert gsm8k_reference("#### -3.5 ") == "-3.5"
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_reference("the answer is 3")
    with pytest.raises(ValueError, match="nothing after"):
        gsm8k_reference("text ####  ")


def test_olympiad_reference():
    assert olympiad_reference(["$2,-1,-18$"]) == "2,-1,-18"
    assert olympiad_reference(["$\\frac{41}{12}$"], "km") == "\\frac{41}{12}"
    assert olympiad_reference("$3$") == "3"
    with pytest.raises(ValueError, match="empty final_answer"):
        olympiad_reference(["  "])


@pytest.mark.parametrize(
    "completion, reference, kind, expected",
    [
        # numbers: boxed, thousands separators, bare last number as fallback, decimals
        ("... so she earns \\boxed{18} dollars.", "18", "gsm8k", True),
        ("The total is \\boxed{1,234}.", "1234", "gsm8k", True),
        ("9 - 3 = 6, so 6 * 3 = 18", "18", "gsm8k", True),
        ("The total is \\boxed{19}.", "18", "gsm8k", False),
        ("\\boxed{18.0}", "18", "gsm8k", True),
        ("\\boxed{073}", "73", "aime", True),
        ("\\boxed{27}", "27", "amc", True),
        ("\\boxed{\\frac{27}{1}}", "27", "amc", True),
        ("", "27", "amc", False),
        # LaTeX: equivalent forms, tuples, sets, intervals; stray formulae without a box are not scored
        ("Hence $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.", "\\left( 3, \\frac{\\pi}{2} \\right)", "math", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", "math", True),
        ("\\boxed{\\dfrac{\\sqrt{3}}{3}}", "\\frac{1}{\\sqrt{3}}", "math", True),
        ("\\boxed{(3, \\pi)}", "\\left( 3, \\frac{\\pi}{2} \\right)", "math", False),
        ("We get $x = \\frac{1}{2}$ somewhere in the reasoning.", "\\frac{1}{2}", "math", False),
        ("\\boxed{(-\\infty, 2]}", "(-\\infty,2]", "math", True),
        ("\\boxed{1.6 \\mathrm{~cm}}", "1.6", "minerva", True),
        ("\\boxed{4.5 \\cdot 10^{33}}", "4.5 \\times 10^{33}", "minerva", True),
        # known verifier limit: e-notation is not LaTeX and does not parse inside a box
        ("\\boxed{4.5e33}", "4.5 \\times 10^{33}", "minerva", False),
        ("\\boxed{-18, 2, -1}", "2,-1,-18", "olympiad", True),
        ("\\boxed{2, -1}", "2,-1,-18", "olympiad", False),
        # single-symbol assignment in the reference: latex2sympy folds N to n, so compare right-hand sides
        ("\\boxed{N=n}", "N=n", "olympiad", True),
        ("\\boxed{n}", "N=n", "olympiad", True),
        ("\\boxed{N=n+1}", "N=n", "olympiad", False),
    ],
)
def test_verify(completion, reference, kind, expected):
    assert verify(completion, reference, kind=kind) is expected


@pytest.mark.parametrize("boxed", ["\\boxed{166 cm^2}", "\\boxed{166 \\text{ cm}^2}", "\\boxed{166\\,\\mathrm{cm^2}}", "\\boxed{166 $cm^2$}"])
def test_verify_strips_olympiad_unit(boxed):
    assert verify(boxed, "166", kind="olympiad", unit="$cm^2$")
    assert not verify(boxed.replace("166", "167"), "166", kind="olympiad", unit="$cm^2$")


def test_extract_answer():
    assert extract_answer("so \\boxed{\\frac{1}{2}}.", kind="math") == "\\frac{1}{2}"
    assert extract_answer("no answer here", kind="math") is None
    assert extract_answer("3 + 4 = 7 apples", kind="gsm8k") == "7"


def test_unknown_kind_names_the_kinds():
    with pytest.raises(ValueError, match="gsm8k, math, minerva, olympiad, aime, amc"):
        verify("\\boxed{1}", "1", kind="mmlu")
    assert KINDS == ("gsm8k", "math", "minerva", "olympiad", "aime", "amc")
