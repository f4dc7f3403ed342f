"""triage_trl.answers.latex: the LaTeX rewrites applied before math-verify parses an answer or a reference."""

import pytest

from triage_trl.answers.latex import brace_macro_arguments, expand_e_notation, join_digit_groups
from triage_trl.answers import normalize_answer_latex


@pytest.mark.parametrize(
    "latex, braced",
    [
        ("\\frac43", "\\frac{4}{3}"),
        ("\\frac 59", "\\frac{5}{9}"),
        ("\\frac9{19}", "\\frac{9}{19}"),
        ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}\\text{ degrees}"),
        ("11\\sqrt2", "11\\sqrt{2}"),
        ("\\sqrt[3]x", "\\sqrt[3]{x}"),
        ("\\frac\\pi2", "\\frac{\\pi}{2}"),
        ("\\frac123", "\\frac{1}{2}3"),  # TeX takes one token per argument
        ("\\dfrac{\\frac12}{3}", "\\dfrac{\\frac{1}{2}}{3}"),
        ("\\sqrt{\\frac14}", "\\sqrt{\\frac{1}{4}}"),
        ("\\binom52", "\\binom{5}{2}"),
        ("\\tfrac{1}{2}3", "\\tfrac{1}{2}3"),
        ("\\left(\\frac{1}{2}, \\sqrt{3}\\right)", "\\left(\\frac{1}{2}, \\sqrt{3}\\right)"),
        ("\\sqrt", "\\sqrt"),  # no argument: left as written
        ("\\frac{1}{2", "\\frac{1}{2"),  # unbalanced: left as written
        ("\\fracture", "\\fracture"),
    ],
)
def test_brace_macro_arguments(latex, braced):
    assert brace_macro_arguments(latex) == braced


@pytest.mark.parametrize(
    "text, expanded",
    [
        ("4.5e33", "4.5 \\times 10^{33}"),
        ("1e-5", "1 \\times 10^{-5}"),
        ("1E+05", "1 \\times 10^{5}"),
        ("-2.7778e-6", "-2.7778 \\times 10^{-6}"),
        ("e-5", "e-5"),
        ("3e^{-2t}", "3e^{-2t}"),
        ("(1 - 3e^{-2t} + 2e^{-5t}) u(t)", "(1 - 3e^{-2t} + 2e^{-5t}) u(t)"),
        ("2e-5t", "2e-5t"),
        ("x2e5", "x2e5"),
    ],
)
def test_expand_e_notation(text, expanded):
    assert expand_e_notation(text) == expanded


@pytest.mark.parametrize(
    "text, joined",
    [
        ("10\\,000", "10000"),
        ("10\\ 000", "10000"),
        ("10~000", "10000"),
        ("10{,}000", "10000"),
        ("1{,}234{,}567", "1234567"),
        ("1\\,000\\,000.5", "1000000.5"),
        ("3{,}5", "3{,}5"),  # a decimal comma, not a group
        ("1\\,2", "1\\,2"),
        ("1,2", "1,2"),
        ("58,500", "58,500"),  # plain commas are math-verify's to read
        ("12345\\,678", "12345\\,678"),
    ],
)
def test_join_digit_groups(text, joined):
    assert join_digit_groups(text) == joined


def test_normalize_answer_latex_by_kind():
    assert normalize_answer_latex("4.5e33", kind="minerva") == "4.5 \\times 10^{33}"
    assert normalize_answer_latex("1e3", kind="gsm8k") == "1 \\times 10^{3}"
    assert normalize_answer_latex("2e-1", kind="math") == "2e-1"  # Euler's e in LaTeX kinds
    assert normalize_answer_latex("\\frac43 + 10\\,000", kind="olympiad") == "\\frac{4}{3} + 10000"
    assert normalize_answer_latex("104. ", kind="aime") == "104"  # a sentence's full stop inside the box
    assert normalize_answer_latex("1, 2, \\ldots", kind="math") == "1, 2, \\ldots"
    assert normalize_answer_latex("a\\.", kind="math") == "a\\."
    with pytest.raises(ValueError, match="unknown answer kind"):
        normalize_answer_latex("1", kind="mmlu")


def test_normalize_unicode():
    from triage_trl.answers.latex import normalize_unicode

    assert normalize_unicode("The answer is \u22127.") == "The answer is -7."
    assert normalize_unicode("\uff11\uff12\uff0e\uff15\uff0b\uff58") == "12.5+x"
    assert normalize_unicode("x\u00b2") == "x\u00b2"  # not NFKC: a superscript keeps its meaning
    text = "a \u2212\uff13 b"
    assert len(normalize_unicode(text)) == len(text)
