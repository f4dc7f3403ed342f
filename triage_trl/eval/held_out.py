"""Held-out accuracy of the policy a trainer serves: greedy answers from its own vLLM sampler, verified rewards.

Used by the demo and the stability lab before, during and after training. The sampler is the engine TRIAGE trains
and serves (NVFP4 or bf16, synced to the learner by ``trainer.sync_sampler()``), so the accuracy is that of the
policy as deployed. The standard errors follow from the binomial model; :func:`paired_difference` and
:func:`items_won_lost` compare two evaluations of the same items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class HeldOutResult:
    """Greedy accuracy on a held-out slice: ``correct`` of ``total``, per-item outcomes and the completions."""

    correct: int
    total: int
    outcomes: list[bool]
    completions: list[str]

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else math.nan

    @property
    def standard_error(self) -> float:
        """Binomial standard error of :attr:`accuracy`: ``sqrt(p (1 - p) / n)``."""
        p = self.accuracy
        return math.sqrt(p * (1 - p) / self.total) if self.total else math.nan


def paired_difference(before: HeldOutResult, after: HeldOutResult) -> tuple[float, float]:
    """Accuracy change on the same items and its standard error from the paired outcomes.

    Returns:
        ``(after - before, se)``, where ``se = sqrt(var(d) / n)`` over the per-item differences ``d`` in {-1, 0, 1}
        (the paired, McNemar-style error: items both runs get right or wrong add no noise).

    Raises:
        ValueError: the two results cover different numbers of items.
    """
    if before.total != after.total:
        raise ValueError(f"paired comparison needs the same items: {before.total} vs {after.total}.")
    n = before.total
    diffs = [int(a) - int(b) for a, b in zip(after.outcomes, before.outcomes, strict=True)]
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else math.nan
    return mean, math.sqrt(var / n)


def items_won_lost(before: HeldOutResult, after: HeldOutResult) -> tuple[int, int]:
    """``(won, lost)``: items wrong before and right after, and right before and wrong after (the discordant pairs
    behind :func:`paired_difference`).

    Raises:
        ValueError: the two results cover different numbers of items.
    """
    if before.total != after.total:
        raise ValueError(f"paired comparison needs the same items: {before.total} vs {after.total}.")
    won = sum(1 for a, b in zip(before.outcomes, after.outcomes, strict=True) if b and not a)
    lost = sum(1 for a, b in zip(before.outcomes, after.outcomes, strict=True) if a and not b)
    return won, lost


def shared_prompts(held_out, train) -> int:
    """Number of ``held_out`` rows whose ``prompt`` also occurs in ``train`` (datasets with a ``prompt`` column).

    A procedurally generated task with few distinct problems (the demo's ``chain_sum``, 2 terms of 1 digit: 200)
    repeats questions across seeds, so a slice drawn with another seed is not disjoint from the training items.
    """
    seen = {repr(p) for p in train["prompt"]}
    return sum(1 for p in held_out["prompt"] if repr(p) in seen)


def greedy_accuracy(trainer, dataset, max_tokens: int) -> HeldOutResult:
    """Accuracy of the trainer's vLLM sampler, greedy (temperature 0), on ``dataset``.

    Call ``trainer.sync_sampler()`` first when the learner changed since the last rollout.

    Args:
        trainer: a ``TriageGRPOTrainer`` with ``use_vllm=True``.
        dataset: rows with ``prompt`` (chat), ``answer``, ``answer_kind`` (and ``rg_entry`` for reasoning-gym).
        max_tokens: completion length limit (tokens).
    """
    from vllm import SamplingParams

    from ..answers.rewards import verified_answer_reward

    tokenizer = trainer.processing_class
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in dataset["prompt"]]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = trainer.vllm_generation.llm.generate(texts, sampling_params=params, use_tqdm=False)
    completions = [o.outputs[0].text for o in outputs]
    extra = {"rg_entry": dataset["rg_entry"]} if "rg_entry" in dataset.column_names else {}
    rewards = verified_answer_reward(completions, dataset["answer"], dataset["answer_kind"], **extra)
    outcomes = [r == 1.0 for r in rewards]
    return HeldOutResult(sum(outcomes), len(outcomes), outcomes, completions)
