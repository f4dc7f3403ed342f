"""LaTeX rewrites applied to answers and references before ``math-verify`` parses them.

Three notations that are common in benchmark data and model output, and that math-verify 0.9 (with the
normalisation ``triage_trl.answers`` uses) parses wrongly or not at all:

* brace-less macro arguments, TeX shorthand: ``\\frac43``, ``\\frac 59``, ``\\frac9{19}``, ``11\\sqrt2``,
  ``\\binom52``. TeX reads an argument without braces as one token (one character or one control
  sequence), so ``\\frac123`` is ``\\frac{1}{2}3``. math-verify's own ``malformed_operators`` option
  rewrites ``\\frac123`` to ``\\frac{1}{23}`` and ``\\frac{1}{2}3`` to ``\\frac{1}{2}{3}``, so it stays off
  and :func:`brace_macro_arguments` follows TeX's rule instead;
* scientific e-notation, ``4.5e33`` and ``1e-5`` (Minerva math references): latex2sympy reads Euler's
  ``e`` there (``4.5 e 33``, ``e - 5``); :func:`expand_e_notation` writes ``4.5 \\times 10^{33}``;
* digit grouping with a LaTeX space or ``{,}``: ``10\\,000``, ``10\\ 000``, ``10~000``, ``10{,}000``;
  :func:`join_digit_groups` removes the separators of a ``d{1,3}(sep ddd)+`` number. Plain commas are
  left to math-verify (it reads ``58,500`` as one number and ``1,2`` as a list).

and, before any of these and for the whole completion (boxed or not), two Unicode spellings that
math-verify reads as text: the minus sign U+2212 (``−7``) and the fullwidth forms U+FF01-U+FF5E
(``７``, ``－``, ``＋``); :func:`normalize_unicode` writes their ASCII characters.
"""

from __future__ import annotations

import re

_ARG_MACRO_RE = re.compile(r"\\(?:(?P<two>[dtc]?frac|[dt]?binom)|(?P<sqrt>sqrt))(?![A-Za-z])")
_CONTROL_WORD_RE = re.compile(r"\\(?:[A-Za-z]+|.)", re.DOTALL)
_NOT_AN_ARGUMENT = set("}^_&$#%")

_E_NOTATION_RE = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE](?:\+|(-))?0*(\d+)(?![\w.])")

_GROUP_SEPARATOR = r"(?:\\[,;:! ]|\\thinspace\s*|~|\{,\}|\s)"
_GROUPED_NUMBER_RE = re.compile(rf"(?<![\d.,])\d{{1,3}}(?:{_GROUP_SEPARATOR}\d{{3}})+(?![\d])")
_SEPARATOR_RE = re.compile(_GROUP_SEPARATOR)


def _braced_group_end(text: str, start: int) -> int | None:
    """Index just past the ``}`` closing the group opened at ``text[start] == "{"`` (``None``: never closed)."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _argument(text: str, pos: int) -> tuple[str, int] | None:
    """The macro argument at ``pos`` (after spaces) braced, and the index after it; ``None`` if there is none."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos >= len(text) or text[pos] in _NOT_AN_ARGUMENT:
        return None
    if text[pos] == "{":
        end = _braced_group_end(text, pos)
        if end is None:
            return None
        return "{" + brace_macro_arguments(text[pos + 1 : end - 1]) + "}", end
    if text[pos] == "\\":
        token = _CONTROL_WORD_RE.match(text, pos)
        if token is None:
            return None
        return "{" + token.group(0) + "}", token.end()
    return "{" + text[pos] + "}", pos + 1


def brace_macro_arguments(latex: str) -> str:
    """Brace every argument of ``\\frac``/``\\dfrac``/``\\tfrac``/``\\cfrac``, ``\\binom`` and ``\\sqrt``.

    An argument without braces is one token, as TeX reads it: ``\\frac43`` -> ``\\frac{4}{3}``,
    ``\\frac 59`` -> ``\\frac{5}{9}``, ``\\frac9{19}`` -> ``\\frac{9}{19}``, ``11\\sqrt2`` -> ``11\\sqrt{2}``,
    ``\\sqrt[3]x`` -> ``\\sqrt[3]{x}``, ``\\frac\\pi2`` -> ``\\frac{\\pi}{2}``, ``\\frac123`` ->
    ``\\frac{1}{2}3``. Braced arguments are kept (their content is rewritten the same way); a macro
    whose argument is missing or unbalanced is left as written.
    """
    out: list[str] = []
    pos = 0
    while (match := _ARG_MACRO_RE.search(latex, pos)) is not None:
        out.append(latex[pos : match.end()])
        pos = match.end()
        if match.group("sqrt"):
            option = re.match(r"\s*\[[^\[\]]*\]", latex[pos:])
            if option:
                out.append(option.group(0))
                pos += option.end()
        for _ in range(2 if match.group("two") else 1):
            argument = _argument(latex, pos)
            if argument is None:
                break
            out.append(argument[0])
            pos = argument[1]
    out.append(latex[pos:])
    return "".join(out)


_UNICODE_ASCII = {0x2212: "-", 0xFE63: "-", 0x3000: " "} | {c: c - 0xFEE0 for c in range(0xFF01, 0xFF5F)}


def normalize_unicode(text: str) -> str:
    """Write the Unicode minus (U+2212, U+FE63), the ideographic space and the fullwidth ASCII forms (U+FF01-U+FF5E:
    ``７``, ``－``, ``＋``, ``．``) as ASCII: ``"The answer is −７."`` -> ``"The answer is -7."``.

    One character for one character, so offsets into ``text`` stay valid. Other compatibility forms are kept
    (NFKC would also turn ``x²`` into ``x2``).
    """
    return text.translate(_UNICODE_ASCII)


def expand_e_notation(text: str) -> str:
    """Write scientific e-notation as LaTeX: ``4.5e33`` -> ``4.5 \\times 10^{33}``, ``1e-5`` -> ``1 \\times 10^{-5}``.

    Only a number, ``e`` or ``E`` and an integer exponent with nothing alphanumeric around them are
    rewritten: ``3e^{-2t}``, ``2e-5t`` and ``e-5`` stay as written.
    """
    return _E_NOTATION_RE.sub(lambda m: f"{m.group(1)} \\times 10^{{{m.group(2) or ''}{m.group(3)}}}", text)


def join_digit_groups(text: str) -> str:
    """Remove LaTeX digit-grouping separators: ``10\\,000`` / ``10\\ 000`` / ``10~000`` / ``10{,}000`` -> ``10000``.

    A number is rewritten only when it is 1-3 digits followed by groups of exactly three digits, so
    ``3{,}5`` (a decimal comma), ``1\\,2`` and plain-comma lists such as ``1,2`` stay as written.
    """
    return _GROUPED_NUMBER_RE.sub(lambda m: _SEPARATOR_RE.sub("", m.group(0)), text)


__all__ = ["brace_macro_arguments", "expand_e_notation", "join_digit_groups", "normalize_unicode"]
