"""Field checks shared by the settings dataclasses (``TriageConfig``, ``NVFP4Config``, hence ``TriageGRPOConfig``).

Each raises ``ValueError`` naming the field, the value given and what is allowed. ``bool`` is never a valid choice,
integer or number here (``True == 1`` in Python, so ``True`` would otherwise pass for ``1``): a flag set to a bool
where a name or a count is expected is a mistake, refused rather than read as 1.
"""

from __future__ import annotations

import math
from collections.abc import Collection

__all__ = ["check_choice", "check_in_range", "check_integer_at_least"]


def check_choice(name: str, value, allowed: Collection) -> None:
    """``value`` is one of ``allowed`` (never a ``bool``).

    Raises:
        ValueError: otherwise, listing ``allowed``.
    """
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: it must be one of {', '.join(map(repr, allowed))}.")


def check_integer_at_least(name: str, value, lo: int) -> None:
    """``value`` is an ``int`` (not a ``bool``) ``>= lo``.

    Raises:
        ValueError: otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}={value!r} is out of range: it must be an integer >= {lo}.")


def check_in_range(name: str, value, lo: float, hi: float, allowed: str, lo_open: bool = False,
                   hi_open: bool = False) -> None:
    """``value`` is a finite ``int`` or ``float`` (not a ``bool``) in ``[lo, hi]`` (``lo_open``/``hi_open``: the
    bound excluded); ``allowed`` says so in words for the message (e.g. ``"in (0, 1]"``).

    Raises:
        ValueError: otherwise.
    """
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (
        number
        and (value > lo if lo_open else value >= lo)
        and (value < hi if hi_open else value <= hi)
    ):
        raise ValueError(f"{name}={value!r} is out of range: it must be {allowed}.")
