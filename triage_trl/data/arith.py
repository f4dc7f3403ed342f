"""A synthetic arithmetic task built in code (no hub): prompts, answers and reward functions for the recipes.

Prompts are chat messages asking for ``a op b`` with the answer in ``\\boxed{}``; the ``answer`` column holds the
exact result. Its rewards are in ``triage_trl.rewards``: ``boxed_answer_reward`` (exact match of the last box) and
``digit_share_reward`` (a dense shaping reward that differs between samples even for a random model, so the tiny CPU
recipe gets mixed-reward groups).
"""

from __future__ import annotations

import random

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
