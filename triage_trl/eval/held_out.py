"""Held-out accuracy of the policy a trainer serves: greedy answers from its own vLLM sampler, verified rewards.

Used by the demo and the stability lab before, during and after training. The sampler is the engine TRIAGE trains
and serves (NVFP4 or bf16, synced to the learner by ``trainer.sync_sampler()``), so the accuracy is that of the
policy as deployed. :func:`learner_accuracy` scores the learner's own weights instead (transformers ``generate``), for
runs whose learner computes in another precision than their sampler. The standard errors follow from the binomial
model; :func:`paired_difference` and :func:`items_won_lost` compare two evaluations of the same items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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

    tokenizer = trainer.processing_class
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in dataset["prompt"]]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = trainer.vllm_generation.llm.generate(texts, sampling_params=params, use_tqdm=False)
    completions = [o.outputs[0].text for o in outputs]
    outcomes = _correct(completions, dataset, 1)
    return HeldOutResult(sum(outcomes), len(outcomes), outcomes, completions)


@dataclass
class SampledResult:
    """avg@n of a held-out slice: ``n`` samples per item at ``temperature``; ``item_scores`` is each item's share of
    correct samples (in [0, 1])."""

    item_scores: list[float]
    n: int
    temperature: float

    @property
    def accuracy(self) -> float:
        """avg@n: the mean over items of the share of correct samples."""
        return sum(self.item_scores) / len(self.item_scores) if self.item_scores else math.nan

    @property
    def pass_at_n(self) -> float:
        """Share of items with at least one correct sample."""
        return sum(s > 0 for s in self.item_scores) / len(self.item_scores) if self.item_scores else math.nan


def sampled_accuracy(trainer, dataset, max_tokens: int, *, n: int, temperature: float, seed: int = 0) -> SampledResult:
    """avg@n of the trainer's vLLM sampler on ``dataset``: ``n`` samples per item at ``temperature`` (the training
    temperature: the policy GRPO trains, where greedy answers of a W4A4 model flip with one ulp).

    Call ``trainer.sync_sampler()`` first when the learner changed since the last rollout.

    Args:
        trainer, dataset, max_tokens: as :func:`greedy_accuracy`.
        n: samples per item (>= 1); temperature: sampling temperature (> 0); seed: vLLM's sampling seed (the same
            seed at every evaluation of a run, so two evaluations differ only by the weights).

    Raises:
        ValueError: ``n < 1`` or ``temperature <= 0``.
    """
    from vllm import SamplingParams

    if n < 1 or not temperature > 0:
        raise ValueError(f"avg@n needs n >= 1 and temperature > 0 (got n={n}, temperature={temperature}); use "
                         "greedy_accuracy for temperature 0.")
    tokenizer = trainer.processing_class
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in dataset["prompt"]]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n, seed=seed)
    outputs = trainer.vllm_generation.llm.generate(texts, sampling_params=params, use_tqdm=False)
    completions = [c.text for o in outputs for c in o.outputs]
    correct = _correct(completions, dataset, n)
    return SampledResult([sum(correct[i * n:(i + 1) * n]) / n for i in range(len(texts))], n, temperature)


@torch.no_grad()
def learner_accuracy(trainer, dataset, max_tokens: int, *, n: int = 1, temperature: float = 0.0, seed: int = 0,
                     batch_size: int = 32) -> HeldOutResult | SampledResult:
    """Held-out accuracy of the trainer's learner, its own weights in its own precision (transformers ``generate``
    on ``trainer.model``, left-padded batches), not of the sampler: for a full-precision learner trained with an NVFP4
    sampler, the weights carry no quantisation cost. Greedy (``temperature=0``, ``n=1``) or avg@``n`` sampled at
    ``temperature``; the same prompts and verified rewards as :func:`greedy_accuracy` and :func:`sampled_accuracy`.

    Args:
        trainer: a trainer whose ``model`` is a causal LM (a PEFT model generates with its adapters).
        dataset, max_tokens: as :func:`greedy_accuracy`.
        n, temperature, seed: samples per item, their temperature, and ``torch``'s seed of the first batch (batch
            ``i`` seeds ``seed + i x batch_size``), in a forked RNG state (the process's generators are untouched).
        batch_size: prompts per ``generate`` call.

    Returns:
        :class:`HeldOutResult` (greedy) or :class:`SampledResult` (``n`` samples).

    Raises:
        ValueError: ``temperature == 0`` with ``n > 1``, or ``n < 1``.
        NotImplementedError: an FSDP or DeepSpeed trainer (the learner is not whole on the rank): single process
            or DDP only.
    """
    from .backends import TransformersBackend

    if n < 1 or (temperature == 0 and n > 1):
        raise ValueError(f"learner_accuracy takes n >= 1, and n == 1 when greedy (got n={n}, temperature="
                         f"{temperature}).")
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        raise NotImplementedError("learner_accuracy generates with the whole learner on this rank: run it in a "
                                  "single process or under DDP, not FSDP or DeepSpeed.")
    tokenizer = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    # the text the sampler is given (greedy_accuracy), tokenised as vLLM tokenises a text prompt (special tokens added)
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in dataset["prompt"]]
    prompt_ids = [tokenizer(t)["input_ids"] for t in texts]
    was_training = model.training
    model.eval()
    try:
        backend = TransformersBackend(None, tokenizer=tokenizer, batch_size=batch_size, model=model)
        completions = [c for group in backend.generate(prompt_ids, n=n, temperature=temperature,
                                                       max_new_tokens=max_tokens,
                                                       seeds=[seed + i for i in range(len(prompt_ids))])
                       for c in group]
    finally:
        model.train(was_training)
    if temperature == 0:
        outcomes = _correct(completions, dataset, 1)
        return HeldOutResult(sum(outcomes), len(outcomes), outcomes, completions)
    correct = _correct(completions, dataset, n)
    return SampledResult([sum(correct[i * n:(i + 1) * n]) / n for i in range(len(prompt_ids))], n, temperature)


def _correct(completions: list[str], dataset, n: int) -> list[bool]:
    """Whether each completion (``n`` per row of ``dataset``, row-major) earns the verified-answer reward 1.0."""
    from ..answers.rewards import verified_answer_reward

    repeat = lambda column: [v for v in dataset[column] for _ in range(n)]  # noqa: E731
    extra = {"rg_entry": repeat("rg_entry")} if "rg_entry" in dataset.column_names else {}
    return [r == 1.0 for r in verified_answer_reward(completions, repeat("answer"), repeat("answer_kind"), **extra)]
