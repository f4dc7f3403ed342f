"""A synthetic arithmetic task built in code (no hub): prompts, answers and reward functions for the recipes.

Prompts are chat messages asking for ``a op b`` with the answer in ``\\boxed{}``; the ``answer`` column holds the
exact result. ``boxed_answer_reward`` is the task's verified reward; ``digit_share_reward`` is a dense shaping
reward that differs between samples even for a random model, so the tiny CPU recipe gets mixed-reward groups.
"""

from __future__ import annotations

import random

from ..answers import extract_boxed

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arith_dataset(size: int = 64, *, seed: int = 0, max_operand: int = 20, ops: str = "+-*"):
    """``datasets.Dataset`` with columns ``prompt`` (one user message) and ``answer`` (str).

    Raises:
        ValueError: ``size < 1``, ``max_operand < 1`` or an operator outside ``+-*``.
    """
    from datasets import Dataset

    if size < 1 or max_operand < 1:
        raise ValueError(f"size={size} and max_operand={max_operand} must both be >= 1.")
    if not ops or any(op not in _OPS for op in ops):
        raise ValueError(f"ops={ops!r} must be a non-empty string of '+', '-', '*'.")
    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(size):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        question = f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."
        prompts.append([{"role": "user", "content": question}])
        answers.append(str(_OPS[op](a, b)))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(m.get("content") or "" for m in completion)
    return completion


def boxed_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last ``\\boxed{...}`` of the completion equals the answer exactly, else 0.0."""
    rewards = []
    for completion, truth in zip(completions, answer, strict=True):
        boxed = extract_boxed(_text(completion))
        rewards.append(1.0 if boxed is not None and boxed.strip() == truth else 0.0)
    return rewards


def digit_share_reward(completions, **kwargs) -> list[float]:
    """Share of the completion's characters that are digits (0.0 for an empty completion), in [0, 1]."""
    rewards = []
    for completion in completions:
        text = _text(completion)
        rewards.append(sum(c.isdigit() for c in text) / len(text) if text else 0.0)
    return rewards


REWARD_FUNCS = {"boxed_answer_reward": boxed_answer_reward, "digit_share_reward": digit_share_reward}
