"""MATH-style jsonl (``problem``, ``answer``) as ``prompt`` + ``answer``, e.g. MATH-500 (Lightman et al., 2023).

The reference is the LaTeX ``answer`` field, checked with ``math-verify`` (``kind="math"``) by
``triage_trl.rewards.verified_answer_reward``.
"""

from __future__ import annotations

from .jsonl import read_jsonl, take
from .prompts import LATEX_EXAMPLE, boxed_chat_prompt


def math_dataset(path: str, *, size: int | None = None, seed: int = 0, problem_key: str = "problem",
                 answer_key: str = "answer"):
    """``datasets.Dataset`` with ``prompt`` (chat messages), ``answer`` (LaTeX str) and ``answer_kind`` (``"math"``).

    Args:
        path: a jsonl file whose rows hold ``problem_key`` and ``answer_key``.
        size: keep this many rows (seeded shuffle first); ``None`` keeps all.
        seed: seed of that shuffle.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a row lacks either key (names the row and the keys it has).
    """
    from datasets import Dataset

    rows = take(read_jsonl(path), size, seed)
    prompts, answers = [], []
    for i, row in enumerate(rows):
        if problem_key not in row or answer_key not in row:
            raise ValueError(
                f"Row {i} of {path} lacks {problem_key!r} or {answer_key!r} (has {sorted(row)}): pass problem_key= "
                "and answer_key= for other field names."
            )
        prompts.append(boxed_chat_prompt(str(row[problem_key]), LATEX_EXAMPLE))
        answers.append(str(row[answer_key]))
    return Dataset.from_dict({"prompt": prompts, "answer": answers, "answer_kind": ["math"] * len(answers)})
