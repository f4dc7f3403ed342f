"""triage_trl.answers: boxed extraction, GSM8K/OlympiadBench references and math-verify scoring per kind.

Whole-benchmark checks (every reference of ../shared/data scored as a completion) live in
tests/test_eval_benchmarks.py and tests/test_reference_rendering.py; the LaTeX rewrites in
tests/test_answer_latex.py; time limits in tests/test_answer_worker.py.
"""

import pytest

from triage_trl.answers import (
    KINDS,
    AnswerCheck,
    check_answer,
    extract_answer,
    extract_boxed,
    gsm8k_reference,
    olympiad_reference,
    verify,
)

WAIT = "I first got \\boxed{5}. Wait, that's wrong; the answer is \\boxed{7}."


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
        # e-notation is a decimal number in the numeric kinds, in answers as in references
        ("\\boxed{4.5e33}", "4.5 \\times 10^{33}", "minerva", True),
        ("\\boxed{-18, 2, -1}", "2,-1,-18", "olympiad", True),
        ("\\boxed{2, -1}", "2,-1,-18", "olympiad", False),
        # single-symbol assignment in the reference: latex2sympy folds N to n, so compare right-hand sides
        ("\\boxed{N=n}", "N=n", "olympiad", True),
        ("\\boxed{n}", "N=n", "olympiad", True),
        ("\\boxed{N=n+1}", "N=n", "olympiad", False),
        # several boxes: the last one is the answer (math-verify alone reads {5, 7})
        ("\\boxed{5}, \\boxed{7}", "7", "math", True),
        ("\\boxed{5}, \\boxed{7}", "5", "math", False),
        ("\\boxed{5}, \\boxed{7}", "5, 7", "math", False),
        (WAIT, "7", "math", True),
        (WAIT, "7", "gsm8k", True),
        (WAIT, "5", "gsm8k", False),
        ("\\boxed{2}, \\boxed{-1}", "2,-1", "olympiad", False),
        ("\\boxed{2, -1}", "2,-1", "olympiad", True),
        ("\\boxed{7} and then an empty \\boxed{}", "7", "math", False),
        ("so $CE = \\boxed{104.}$", "104", "aime", True),  # AIME24 row 70's worked solution
        ("\\boxed{104.5}", "104", "aime", False),
        # brace-less TeX arguments, in references and in answers (8 MATH-500 references)
        ("\\boxed{\\frac{4}{3}}", "\\frac43", "math", True),
        ("\\boxed{\\frac{5}{3}}", "\\frac43", "math", False),
        ("\\boxed{11\\sqrt{2}}", "11\\sqrt2", "math", True),
        ("\\boxed{11\\sqrt{3}}", "11\\sqrt2", "math", False),
        ("\\boxed{\\frac{5}{9}}", "\\frac 59", "math", True),
        ("\\boxed{\\frac{9}{19}}", "\\frac9{19}", "math", True),
        ("\\boxed{\\frac{270}{7}}", "\\frac{270}7\\text{ degrees}", "math", True),
        ("\\boxed{\\sqrt2}", "\\sqrt{2}", "math", True),
        ("\\boxed{\\frac43}", "\\frac{4}{3}", "math", True),
        ("\\boxed{\\frac{\\sqrt3}2}", "\\frac{\\sqrt{3}}{2}", "math", True),
        ("\\boxed{\\dfrac12}", "0.5", "math", True),
        ("\\boxed{\\binom52}", "10", "math", True),
        ("\\boxed{\\frac123}", "\\frac{3}{2}", "math", True),  # TeX: \frac{1}{2}3
        ("\\boxed{\\frac123}", "\\frac{1}{23}", "math", False),
        # scientific e-notation (58 Minerva references) is a times-ten power, not Euler's e
        ("\\boxed{4.5 \\times 10^{33}}", "4.5e33", "minerva", True),
        ("\\boxed{4.5 \\cdot 10^{33}}", "4.5e33", "minerva", True),
        ("\\boxed{45 \\times 10^{32}}", "4.5e33", "minerva", True),
        ("\\boxed{4.6 \\times 10^{33}}", "4.5e33", "minerva", False),
        ("\\boxed{4.5 \\times 10^{34}}", "4.5e33", "minerva", False),
        ("\\boxed{e - 5}", "1e-5", "minerva", False),
        ("\\boxed{10^{-5}}", "1e-5", "minerva", True),
        ("\\boxed{1.0 \\times 10^{-5}}", "1e-5", "minerva", True),
        ("\\boxed{1.1 \\times 10^{-5}}", "1e-5", "minerva", False),
        ("\\boxed{2.88 \\times 10^{-19}}", "2.88e-19", "minerva", True),
        ("\\boxed{3.88 \\times 10^{-19}}", "2.88e-19", "minerva", False),
        ("\\boxed{2 \\times 10^{-19}}", "10^{-19}", "math", False),
        ("\\boxed{0.0000673}", ".0000672", "math", False),
        ("\\boxed{0.0000672}", ".0000672", "math", True),
        ("\\boxed{0.333333}", "\\frac{1}{3}", "math", True),
        ("\\boxed{1e3}", "1000", "gsm8k", True),
        # in math/olympiad answers e stays Euler's number
        ("\\boxed{2e - 1}", "2e-1", "math", True),
        ("\\boxed{0.2}", "2e-1", "math", False),
        # LaTeX digit grouping; plain-comma lists stay lists
        ("\\boxed{10\\,000}", "10000", "gsm8k", True),
        ("\\boxed{10\\ 000}", "10000", "gsm8k", True),
        ("\\boxed{10~000}", "10000", "gsm8k", True),
        ("\\boxed{10{,}000}", "10000", "gsm8k", True),
        ("\\boxed{10\\,001}", "10000", "gsm8k", False),
        ("\\boxed{1\\,234\\,567}", "1234567", "aime", True),
        ("\\boxed{26\\,000}", "26000", "math", True),
        ("\\boxed{58{,}500}", "58,500", "math", True),
        ("\\boxed{1,2}", "1,2", "math", True),
        ("\\boxed{1,2}", "12", "math", False),
        ("\\boxed{1, 2, 3}", "1,2,3", "olympiad", True),
        # percentages keep math-verify's reading
        ("\\boxed{9\\%}", "9", "gsm8k", True),
        ("\\boxed{9}", "9\\%", "math", True),
    ],
)
def test_verify(completion, reference, kind, expected):
    assert verify(completion, reference, kind=kind) is expected  # in a helper process
    assert verify(completion, reference, kind=kind, timeout_seconds=None) is expected  # in this process


def test_check_answer_records_the_last_box():
    assert check_answer(WAIT, "7", kind="math") == AnswerCheck(correct=True, extracted="7")
    assert check_answer("\\boxed{5}, \\boxed{7}", "7", kind="math").extracted == "7"
    assert check_answer("so \\boxed{\\frac43}", None, kind="math") == AnswerCheck(False, "\\frac{4}{3}")
    assert extract_answer("\\boxed{4.5e33}", kind="minerva") == "4.5 \\times 10^{33}"
    with pytest.raises(TypeError, match="prediction_text must be a str"):
        check_answer(None, "1", kind="math")
    with pytest.raises(ValueError, match="timeout_seconds must be > 0"):
        check_answer("\\boxed{1}", "1", kind="math", timeout_seconds=0)


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


@pytest.mark.parametrize(
    "completion, reference, kind, expected",
    [
        (r"\boxed{3 + 4 = 8}", "8", "math", False),  # false relation, right side matches
        (r"\boxed{3 + 4 = 8}", "8", "gsm8k", False),
        (r"\boxed{8 = 7}", "7", "math", False),
        (r"\boxed{1 = 2 = 8}", "8", "math", False),
        (r"\boxed{x = 3 + 4 = 8}", "8", "math", False),
        (r"\boxed{3 + 4 = 7}", "7", "math", True),  # true relation, right side matches
        (r"\boxed{3+4=7}", "7", "gsm8k", True),
        (r"\boxed{x = 3 + 4 = 7}", "7", "math", True),
        (r"\boxed{x = 5}", "5", "math", True),  # an assignment names the answer
        (r"\boxed{3 + 4 = 7}", "8", "math", False),  # true relation, wrong answer
        (r"\boxed{y = 2x + 1}", "y = 2x + 1", "math", True),  # the reference is a relation
    ],
)
def test_relation_in_box(completion, reference, kind, expected):
    assert verify(completion, reference, kind=kind, timeout_seconds=None) is expected


@pytest.mark.parametrize(
    "completion, reference",
    [(r"\boxed{0.5}", r"50\%"), (r"\boxed{50}", r"50\%"), (r"\boxed{50\%}", r"50\%"), (r"\boxed{50\%}", "0.5"),
     (r"\boxed{50\%}", "50"), (r"\boxed{\frac{1}{2}}", r"50\%")],
)
def test_percent_equals_fraction_and_number(completion, reference):
    for kind in ("math", "gsm8k"):
        assert verify(completion, reference, kind=kind, timeout_seconds=None)
    assert not verify(r"\boxed{0.6}", r"50\%", kind="math", timeout_seconds=None)


@pytest.mark.parametrize(
    "completion, reference, kind",
    [("The answer is \u22127.", "-7", "gsm8k"), ("\\boxed{\u22127}", "-7", "math"),
     ("\\boxed{\uff17}", "7", "math"), ("The answer is \uff17\uff12.", "72", "gsm8k"),
     ("\\boxed{-7}", "\u22127", "math"), ("\\boxed{\uff0d3}", "-3", "aime")],
)
def test_unicode_minus_and_fullwidth_digits(completion, reference, kind):
    assert verify(completion, reference, kind=kind, timeout_seconds=None)


def test_unicode_minus_keeps_its_sign():
    assert not verify("The answer is \u22127.", "7", kind="gsm8k", timeout_seconds=None)
    assert not verify("\\boxed{\uff18}", "7", kind="math", timeout_seconds=None)


def test_unicode_normalised_in_extraction_and_references():
    assert extract_boxed("\\boxed{\u2212\uff14\uff12}") == "-42"
    assert gsm8k_reference("so \u221212\n#### \u221212") == "-12"
