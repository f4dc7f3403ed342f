"""The embedded default task: procedurally generated ``reasoning-gym`` problems (no network, no files).

``reasoning_gym.create_dataset(name, seed=, size=, **difficulty)`` yields ``{"question", "answer", "metadata"}``
items; the dataset's own ``score_answer(answer, entry)`` scores them (``triage_trl.rewards.reasoning_gym_reward``,
which counts only a score of 1.0 as correct: the scorers give partial credit). Each row keeps its item as JSON
in ``rg_entry`` so the scorer can be rebuilt from ``metadata["source_dataset"]`` inside a reward function.

Default: :data:`DEFAULT_TASK` with the one-shot turn :data:`RG_ARITHMETIC_EXAMPLE`. On the 128 held-out items,
SmolLM2-135M-Instruct in bf16 answers 71.9% greedily, and 8 samples at T=0.7 find a correct answer for 90.6% of
them with mixed rewards in 115 of the 128 groups (``benchmarks/bench_task_headroom.py``; ``docs/stability.md``).
"""

from __future__ import annotations

import json

from .prompts import boxed_chat_prompt

DEFAULT_TASK = {"name": "chain_sum", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
"""The demo's task: sums/differences of two 1-digit numbers (``reasoning_gym.arithmetic.chain_sum``)."""
TRAIN_SEED = 0
HELD_OUT_SEED = 1234
"""Seeds of the training items and of the held-out slice (different seeds: different items)."""
CALIBRATION_SEED = TRAIN_SEED
"""Seed of the NVFP4 calibration prompts of the demo and the stability lab: one fixed set whatever a run's seed (the
first training items of seed 0), so every seed's sampler gets bit-identical activation scales."""

# A one-shot turn in reasoning-gym's own arithmetic question style, with two terms like the default task (with a
# three-term example SmolLM2 copies a second, made-up operation into its answers). Its answer is negative: with a
# positive example ("23 + 9 = 32") SmolLM2-135M never writes a minus sign (0 of the 28 negative answers among the 128
# held-out items, at the start and after any training), so the task left bf16 GRPO 4 reachable items. With this one
# it starts at 71.9% greedy (bf16 vLLM) but puts the sign where it does not belong, and 8 samples at T=0.7 find a
# correct answer for 90.6% of the items (78.9% before): the headroom GRPO learns from (docs/stability.md).
RG_ARITHMETIC_EXAMPLE = (
    "State the final answer to the following arithmetic problem: 4 - 9 =",
    "4 - 9 = -5.\nThe final answer is \\boxed{-5}.",
)


TWO_DIGIT_TASK = {"name": "chain_sum", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
"""The stability lab's ``collapse`` task (E2 in ``docs/stability.md``): sums/differences of two numbers of 1-2
digits with the demo's one-shot turn. Its item space (about 20,000 items) leaves a held-out slice disjoint from every
training set; at temperature 1 SmolLM2-135M-Instruct's samples are right sometimes but not always on 48% of the
items (``benchmarks/bench_task_headroom.py --max-digits 2 --temperature 1.0``)."""
CHAIN_LINES_TASK = {"name": "chain_sum", "min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}
"""A multi-line task: sums/differences of 3 numbers of 1 digit worked one partial sum per line
(:data:`CHAIN_LINES_EXAMPLE`). Too hard for SmolLM2-135M at temperature 1 (pass@8 7.8% of the items, 1.6 lines per
completion: ``docs/stability.md``, "E2"); kept for larger models (``--task chain_lines``)."""
CHAIN_LINES_EXAMPLE = (
    "State the final answer to the following arithmetic problem: 7 - 9 + 4 =",
    "7 - 9 = -2\n-2 + 4 = 2\nThe final answer is \\boxed{2}.",
)
"""The one-shot turn of :data:`CHAIN_LINES_TASK`: one partial sum per line, then the boxed answer."""


def reasoning_gym_dataset(task: dict | None = None, *, size: int = 64, seed: int = TRAIN_SEED,
                          example: tuple[str, str] | None = RG_ARITHMETIC_EXAMPLE):
    """``datasets.Dataset`` with ``prompt`` (chat messages), ``answer`` (str), ``answer_kind``
    (``"reasoning_gym"``) and ``rg_entry`` (the item as JSON, for the task's scorer).

    Args:
        task: ``{"name": <reasoning-gym dataset>, **difficulty}`` (e.g. ``{"name": "basic_arithmetic",
            "min_terms": 2, "max_terms": 3}``); ``None``: :data:`DEFAULT_TASK`.
        size: number of items; >= 1.
        seed: reasoning-gym seed (items ``0..size-1`` of that seed).
        example: the one-shot turn (``None`` for none).

    Raises:
        ImportError: ``reasoning-gym`` is not installed (``make install`` or ``pip install reasoning-gym``).
        ValueError: ``size < 1``, no ``name``, or a name/difficulty reasoning-gym refuses.
    """
    from datasets import Dataset

    rg = _import_reasoning_gym()
    task = dict(DEFAULT_TASK if task is None else task)
    name = task.pop("name", None)
    if not name:
        raise ValueError(f"task={task!r} needs a 'name' (a reasoning-gym dataset, e.g. 'chain_sum').")
    if size < 1:
        raise ValueError(f"size={size} must be >= 1.")
    try:
        items = rg.create_dataset(name, seed=seed, size=size, **task)
    except (AssertionError, TypeError, ValueError) as err:
        raise ValueError(f"reasoning-gym refused task {name!r} with {task}: {err}") from err
    prompts, answers, entries = [], [], []
    for item in items:
        prompts.append(boxed_chat_prompt(item["question"], example))
        answers.append(str(item["answer"]))
        entries.append(json.dumps({"answer": item["answer"], "metadata": item["metadata"]}, default=str))
    return Dataset.from_dict(
        {"prompt": prompts, "answer": answers, "answer_kind": ["reasoning_gym"] * size, "rg_entry": entries}
    )


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(
            "The embedded default task needs reasoning-gym: run `make install` (or `pip install reasoning-gym==0.1.25`)."
        ) from err
    return reasoning_gym
