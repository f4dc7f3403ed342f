"""Progress bars for the long loops outside the Trainer's own (calibration, export, conversion): ``tqdm.auto``,
shown on each node's main process only (``LOCAL_RANK`` 0 or unset) and off with ``TRIAGE_TRL_NO_PROGRESS=1``."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["progress"]


def progress(iterable: Iterable[T], desc: str, unit: str, total: int | None = None) -> Iterable[T]:
    """``iterable`` wrapped in a ``tqdm`` bar named ``desc`` that disappears when done (``leave=False``)."""
    from tqdm.auto import tqdm

    hidden = os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("TRIAGE_TRL_NO_PROGRESS", "0") == "1"
    return tqdm(iterable, desc=desc, unit=unit, total=total, leave=False, disable=hidden)
