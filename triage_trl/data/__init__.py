"""Prompt + reference-answer adapters: GSM8K, MATH-style jsonl and the embedded default (reasoning-gym).

Every adapter returns a ``datasets.Dataset`` with TRL's conversational ``prompt`` column (a one-shot chat asking
for the final answer in ``\\boxed{}``), ``answer`` (the reference, str) and ``answer_kind`` (how
``triage_trl.rewards`` checks it). Use :func:`load_task` to pick one by name.
"""

from __future__ import annotations

from .gsm8k import GSM8K_HUB_ID, gsm8k_dataset
from .math_jsonl import math_dataset
from .prompts import INSTRUCTION, boxed_chat_prompt
from .reasoning_gym import CALIBRATION_SEED, DEFAULT_TASK, HELD_OUT_SEED, TRAIN_SEED, reasoning_gym_dataset

DATASET_CHOICES = ("reasoning_gym", "gsm8k", "math")


def load_task(name: str, *, path: str | None = None, split: str = "train", size: int | None = None, seed: int = 0,
              task: dict | None = None):
    """The adapter ``name`` (one of :data:`DATASET_CHOICES`) as a ``datasets.Dataset``.

    Args:
        name: ``reasoning_gym`` (embedded default, no network), ``gsm8k`` (``path``: jsonl file/folder, or Hub id;
            default ``openai/gsm8k``) or ``math`` (``path``: a MATH-style jsonl, required).
        size: rows to keep (reasoning_gym: rows to generate, default 64).
        seed: shuffle seed (reasoning_gym: generator seed).
        task: reasoning_gym only: ``{"name": ..., **difficulty}``.

    Raises:
        ValueError: unknown ``name``, or ``math`` without ``path``.
    """
    if name == "reasoning_gym":
        return reasoning_gym_dataset(task, size=size or 64, seed=seed)
    if name == "gsm8k":
        return gsm8k_dataset(path or GSM8K_HUB_ID, split=split, size=size, seed=seed)
    if name == "math":
        if not path:
            raise ValueError("dataset 'math' needs a path to a jsonl with 'problem' and 'answer' fields.")
        return math_dataset(path, size=size, seed=seed)
    raise ValueError(f"Unknown dataset {name!r}: use one of {', '.join(DATASET_CHOICES)}.")


__all__ = [
    "CALIBRATION_SEED",
    "DATASET_CHOICES",
    "DEFAULT_TASK",
    "GSM8K_HUB_ID",
    "HELD_OUT_SEED",
    "INSTRUCTION",
    "TRAIN_SEED",
    "boxed_chat_prompt",
    "gsm8k_dataset",
    "load_task",
    "math_dataset",
    "reasoning_gym_dataset",
]
