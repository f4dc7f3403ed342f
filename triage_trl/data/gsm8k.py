"""GSM8K (Cobbe et al., 2021) as ``prompt`` + ``answer``: a Hub id (``openai/gsm8k``) or a local jsonl.

Rows hold ``question`` and ``answer`` (a worked solution ending in ``#### <number>``); the reference kept is the
number after ``####`` (``triage_trl.answers.gsm8k_reference``), checked with ``kind="gsm8k"``.
"""

from __future__ import annotations

import os

from ..answers import gsm8k_reference
from .prompts import WORD_PROBLEM_EXAMPLE, boxed_chat_prompt
from .jsonl import read_jsonl, take

GSM8K_HUB_ID = "openai/gsm8k"


def gsm8k_dataset(source: str = GSM8K_HUB_ID, *, split: str = "train", size: int | None = None, seed: int = 0):
    """``datasets.Dataset`` with ``prompt`` (chat messages), ``answer`` (the reference number, str) and
    ``answer_kind`` (``"gsm8k"``).

    Args:
        source: a local ``.jsonl`` file, a folder holding ``<split>.jsonl``, or a Hub id (``openai/gsm8k``,
            config ``main``; needs network access or the Hub cache).
        split: ``train`` or ``test`` (Hub split, or file name in a folder).
        size: keep this many rows (a seeded shuffle first); ``None`` keeps all.
        seed: seed of that shuffle.

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: a row without ``question``/``answer`` or an answer without ``####``.
    """
    from datasets import Dataset, load_dataset

    rows = _local_rows(source, split)
    if rows is None:
        rows = list(load_dataset(source, "main", split=split))
    rows = take(rows, size, seed)
    prompts, answers = [], []
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"GSM8K row {i} of {source} lacks 'question' or 'answer': {sorted(row)}.")
        prompts.append(boxed_chat_prompt(row["question"], WORD_PROBLEM_EXAMPLE))
        answers.append(gsm8k_reference(row["answer"]))
    return Dataset.from_dict({"prompt": prompts, "answer": answers, "answer_kind": ["gsm8k"] * len(answers)})


def _local_rows(source: str, split: str) -> list[dict] | None:
    """Rows of a local jsonl (file, or ``<folder>/<split>.jsonl``); ``None`` when ``source`` looks like a Hub id."""
    if source.endswith(".jsonl"):
        return read_jsonl(source)
    if os.path.isdir(source):
        return read_jsonl(os.path.join(source, f"{split}.jsonl"))
    if source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{source} is neither a .jsonl file nor a folder with {split}.jsonl.")
    return None
