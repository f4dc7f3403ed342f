"""Reading jsonl files and taking seeded subsets (shared by the adapters)."""

from __future__ import annotations

import json
import os
import random


def read_jsonl(path: str) -> list[dict]:
    """The rows of a jsonl file (one JSON object per non-empty line).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not a JSON object (names the line).
    """
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist.")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{n} is not a JSON object.")
                rows.append(row)
    return rows


def take(rows: list, size: int | None, seed: int) -> list:
    """``rows`` unchanged (``size=None``), or ``size`` of them after a ``random.Random(seed)`` shuffle.

    Raises:
        ValueError: ``size < 1`` or larger than ``len(rows)``.
    """
    if size is None:
        return list(rows)
    if not 1 <= size <= len(rows):
        raise ValueError(f"size={size} must be between 1 and the {len(rows)} rows available.")
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[:size]
