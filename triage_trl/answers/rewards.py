"""Verified rewards for GRPO on math tasks, with TRL's reward-function signature.

TRL calls ``reward_func(prompts=..., completions=..., completion_ids=..., **dataset_columns)`` and expects one
float (or ``None``) per completion. Our adapters (``triage_trl.data``) give every row ``answer`` (the reference)
and ``answer_kind``; reasoning-gym rows also give ``rg_entry`` (the item as JSON).

- :func:`verified_answer_reward`: 1.0 when the completion's final answer is correct, else 0.0. GSM8K and
  MATH-style rows are checked with ``math-verify`` through ``triage_trl.answers.verify`` (kinds ``gsm8k``,
  ``math``, ...; bounded time in any thread); reasoning-gym rows with the task's own scorer
  (:func:`reasoning_gym_reward`).
- :func:`reasoning_gym_reward`: reasoning-gym's ``score_answer`` on the last ``\\boxed{}``; only a score of 1.0
  counts (its scorers give partial credit, e.g. 0.5 for "1" against "10", which would reward wrong answers).
- :func:`format_reward`: 1.0 when the completion has a ``\\boxed{...}`` answer, else 0.0.
- :func:`answer_then_stop_reward`: 1.0 when the completion ends with its ``\\boxed{...}`` answer (nothing but
  whitespace, a full stop or a closing ``$`` after it), else 0.0: the demo's format reward.

:data:`REWARD_FUNCS` names these and TRL's own rewards under TRL's names (``accuracy_reward``,
``reasoning_accuracy_reward``, ``think_format_reward``, as in ``trl grpo``; they read a ``solution`` column).
"""

from __future__ import annotations

import functools
import json
import warnings

import re

from .check import KINDS, boxed_span, extract_boxed, verify

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


_ANSWER_END = re.compile(r"[\s.$]*")


def answer_then_stop_reward(completions, **kwargs) -> list[float]:
    """1.0 for each completion that ends with its last ``\\boxed{...}`` answer (only whitespace, ``.`` or ``$`` after
    the closing brace), else 0.0 (no box, an empty box, or any text after it).

    Why: on SmolLM2-135M, GRPO with only an accuracy reward grows text after the answer ("This is a classic example
    of ...") until completions hit the length limit, and greedy accuracy falls with it; this reward makes stopping
    after the answer part of the objective (see ``triage_trl/runs.py``, ``demo_rewards``).
    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        span = boxed_span(text)
        ok = (span is not None and text[span[0]:span[1]].strip() != ""
              and _ANSWER_END.fullmatch(text, span[1] + 1) is not None)
        rewards.append(1.0 if ok else 0.0)
    return rewards


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


def verified_answer_reward(completions, answer, answer_kind, rg_entry=None, **kwargs) -> list[float]:
    """1.0 for a correct final answer, else 0.0, checked per row by ``answer_kind``.

    Args:
        completions: TRL completions (str or messages), ``B`` of them.
        answer: ``B`` reference answers (str).
        answer_kind: ``B`` kinds: ``reasoning_gym`` (needs ``rg_entry``) or a ``triage_trl.answers.KINDS`` entry
            (``gsm8k``, ``math``, ...), checked with math-verify.
        rg_entry: ``B`` reasoning-gym items (JSON), for ``reasoning_gym`` rows.

    Each math-verify check ends within 10 s in any thread (an overrun scores 0.0; see ``triage_trl.answers``).

    Raises:
        ValueError: an unknown kind, or a ``reasoning_gym`` row without ``rg_entry``.
    """
    entries = rg_entry if rg_entry is not None else [None] * len(completions)
    rewards = []
    for completion, reference, kind, entry in zip(completions, answer, answer_kind, entries, strict=True):
        text = completion_text(completion)
        if kind == REASONING_GYM_KIND:
            if entry is None:
                raise ValueError("reasoning_gym rows need the 'rg_entry' column (see triage_trl.data).")
            rewards.append(reasoning_gym_reward([text], [entry])[0])
        elif kind in KINDS:
            rewards.append(1.0 if verify(text, str(reference), kind=kind) else 0.0)
        else:
            raise ValueError(f"Unknown answer_kind {kind!r}: use {REASONING_GYM_KIND!r} or one of {', '.join(KINDS)}.")
    return rewards


def boxed_answer_reward(completions, answer, **kwargs) -> list[float]:
    """The arithmetic task's reward (``triage_trl.data.arith``): 1.0 when the last ``\\boxed{...}`` of the completion
    equals ``answer`` exactly, else 0.0."""
    rewards = []
    for completion, truth in zip(completions, answer, strict=True):
        boxed = extract_boxed(completion_text(completion))
        rewards.append(1.0 if boxed is not None and boxed.strip() == truth else 0.0)
    return rewards


def digit_share_reward(completions, **kwargs) -> list[float]:
    """Share of the completion's characters that are digits (0.0 for an empty completion), in [0, 1]: a dense shaping
    reward that differs between samples even for a random model."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        rewards.append(sum(c.isdigit() for c in text) / len(text) if text else 0.0)
    return rewards


def _trl_rewards() -> dict:
    from trl import rewards

    return {name: getattr(rewards, name) for name in ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")}


REWARD_FUNCS = {
    "verified_answer_reward": verified_answer_reward,
    "format_reward": format_reward,
    "answer_then_stop_reward": answer_then_stop_reward,
    "reasoning_gym_reward": reasoning_gym_reward,
    "boxed_answer_reward": boxed_answer_reward,
    "digit_share_reward": digit_share_reward,
    **_trl_rewards(),
}
"""Reward functions selectable by name in recipes and on the command line: ours, and TRL's under TRL's names."""


def __getattr__(name: str):
    if name == "accuracy_reward":  # the name this reward had before TRL's accuracy_reward joined the registry
        warnings.warn(
            "triage_trl.rewards.accuracy_reward is renamed verified_answer_reward (columns answer, answer_kind); "
            "the registry name 'accuracy_reward' is TRL's trl.rewards.accuracy_reward (column solution).",
            FutureWarning, stacklevel=2,
        )
        return verified_answer_reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
