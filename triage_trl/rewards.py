"""Verified rewards for GRPO on math tasks, with TRL's reward-function signature.

TRL calls ``reward_func(prompts=..., completions=..., completion_ids=..., **dataset_columns)`` and expects one
float (or ``None``) per completion. Our adapters (``triage_trl.data``) give every row ``answer`` (the reference)
and ``answer_kind``; reasoning-gym rows also give ``rg_entry`` (the item as JSON).

- :func:`accuracy_reward`: 1.0 when the completion's final answer is correct, else 0.0. GSM8K and MATH-style
  rows are checked with ``math-verify`` through ``triage_trl.answers.verify`` (kinds ``gsm8k``, ``math``, ...);
  reasoning-gym rows with the task's own scorer (:func:`reasoning_gym_reward`).
- :func:`reasoning_gym_reward`: reasoning-gym's ``score_answer`` on the last ``\\boxed{}``; only a score of 1.0
  counts (its scorers give partial credit, e.g. 0.5 for "1" against "10", which would reward wrong answers).
- :func:`format_reward`: 1.0 when the completion has a ``\\boxed{...}`` answer, else 0.0.
"""

from __future__ import annotations

import functools
import json
import threading

from .answers import KINDS, extract_boxed, verify

REASONING_GYM_KIND = "reasoning_gym"


def completion_text(completion) -> str:
    """The text of one TRL completion: a string (standard format) or ``[{"role", "content"}, ...]`` messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion)
    raise TypeError(f"A completion is a str or a list of messages, got {type(completion).__name__}.")


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 for each completion that holds a ``\\boxed{...}`` answer (non-empty), else 0.0."""
    return [1.0 if extract_boxed(completion_text(c)) else 0.0 for c in completions]


@functools.lru_cache(maxsize=None)
def _rg_scorer(name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def reasoning_gym_score(text: str, entry: dict) -> float:
    """reasoning-gym's own score (in [0, 1], partial credit included) of the last ``\\boxed{}`` of ``text``.

    Args:
        entry: the item, at least ``{"answer", "metadata": {"source_dataset"}}``.

    Raises:
        KeyError: ``entry`` has no ``metadata.source_dataset``.
    """
    answer = extract_boxed(text)
    if answer is None:
        return 0.0
    return float(_rg_scorer(entry["metadata"]["source_dataset"])(answer.strip(), entry))


def reasoning_gym_reward(completions, rg_entry, **kwargs) -> list[float]:
    """1.0 where reasoning-gym's scorer gives exactly 1.0 to the completion's boxed answer, else 0.0.

    Args:
        rg_entry: per completion, the item as JSON (``triage_trl.data.reasoning_gym_dataset``) or a dict.
    """
    rewards = []
    for completion, entry in zip(completions, rg_entry, strict=True):
        entry = json.loads(entry) if isinstance(entry, str) else entry
        rewards.append(1.0 if reasoning_gym_score(completion_text(completion), entry) == 1.0 else 0.0)
    return rewards


def accuracy_reward(completions, answer, answer_kind, rg_entry=None, **kwargs) -> list[float]:
    """1.0 for a correct final answer, else 0.0, checked per row by ``answer_kind``.

    Args:
        completions: TRL completions (str or messages), ``B`` of them.
        answer: ``B`` reference answers (str).
        answer_kind: ``B`` kinds: ``reasoning_gym`` (needs ``rg_entry``) or a ``triage_trl.answers.KINDS`` entry
            (``gsm8k``, ``math``, ...), checked with math-verify.
        rg_entry: ``B`` reasoning-gym items (JSON), for ``reasoning_gym`` rows.

    Raises:
        ValueError: an unknown kind, or a ``reasoning_gym`` row without ``rg_entry``.
    """
    # math-verify's timeouts use signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    entries = rg_entry if rg_entry is not None else [None] * len(completions)
    rewards = []
    for completion, reference, kind, entry in zip(completions, answer, answer_kind, entries, strict=True):
        text = completion_text(completion)
        if kind == REASONING_GYM_KIND:
            if entry is None:
                raise ValueError("reasoning_gym rows need the 'rg_entry' column (see triage_trl.data).")
            rewards.append(reasoning_gym_reward([text], [entry])[0])
        elif kind in KINDS:
            rewards.append(1.0 if verify(text, str(reference), kind=kind, timeout_seconds=timeout) else 0.0)
        else:
            raise ValueError(f"Unknown answer_kind {kind!r}: use {REASONING_GYM_KIND!r} or one of {', '.join(KINDS)}.")
    return rewards


REWARD_FUNCS = {
    "accuracy_reward": accuracy_reward,
    "format_reward": format_reward,
    "reasoning_gym_reward": reasoning_gym_reward,
}
"""Reward functions selectable by name in recipes and on the command line."""
