"""The sync probe: after every weight sync, the sampler and the learner score one fixed sequence.

A sampler left with old (or corrupt) weights must never train silently. The probe is
independent of the training batch: a fixed text, tokenised once, scored by the sampler (vLLM, at the sampling
temperature) and by the learner (TRL's log-prob path, same temperature). Their mean absolute per-token log-prob
difference is ``triage/sync_probe_gap``; above the configured bound the trainer raises :class:`StaleSamplerError`.
"""

from __future__ import annotations

import math

import torch

# Plain text with newlines, digits and common words: every tokenizer splits it into many ordinary tokens.
PROBE_TEXT = (
    "Question: what is 12 + 30?\nLet me think step by step.\n12 + 30 = 42.\n"
    "The quick brown fox jumps over the lazy dog.\nSo the final answer is \\boxed{42}."
)


class StaleSamplerError(RuntimeError):
    """The sampler's log-probs of the probe sequence moved too far from the learner's after a weight sync."""


def probe_token_ids(tokenizer, min_tokens: int = 8) -> list[int]:
    """Token ids of :data:`PROBE_TEXT` (no special tokens added).

    Raises:
        ValueError: the tokenizer gives fewer than ``min_tokens`` tokens for the probe text.
    """
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if len(ids) < min_tokens:
        raise ValueError(
            f"The sync probe text tokenises to {len(ids)} tokens (< {min_tokens}); the tokenizer cannot score it."
        )
    return list(ids)


def probe_batch(ids: list[int], pad_token_id: int, multiple: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The learner's probe inputs: ``ids`` right-padded to a multiple of ``multiple`` tokens (TRL's
    ``pad_to_multiple_of``, which torchao's native NVFP4 kernels need: the sequence length divisible by 128).

    Right padding leaves every probe token's log-prob unchanged under causal attention, except through a dynamic
    per-tensor activation scale, whose amax also sees the padding rows, as it does in the padded training batches.

    Args:
        ids: the probe's token ids (length L >= 2).
        pad_token_id: the tokenizer's padding token.
        multiple: pad to a multiple of this many tokens; ``None`` pads nothing.

    Returns:
        ``(input_ids, attention_mask, logits_to_keep)``: ``[1, T]`` long tensors (mask 0 on padding) and
        ``T - 1``; the first ``L - 1`` of those ``T - 1`` log-probs are the probe tokens 1..L-1.
    """
    length = len(ids)
    total = length if not multiple else -(-length // multiple) * multiple
    input_ids = torch.full((1, total), int(pad_token_id), dtype=torch.long)
    input_ids[0, :length] = torch.tensor(ids, dtype=torch.long)
    attention_mask = torch.zeros((1, total), dtype=torch.long)
    attention_mask[0, :length] = 1
    return input_ids, attention_mask, total - 1


def probe_gap(learner_logps: torch.Tensor, sampler_logps: torch.Tensor) -> tuple[float, float]:
    """Mean and max of ``|learner - sampler|`` over the probe's scored tokens.

    Args:
        learner_logps: (N,) learner log-probs (nats) of probe tokens 1..N.
        sampler_logps: (N,) the sampler's log-probs of the same tokens.

    Returns:
        ``(mean_abs_gap, max_abs_gap)`` in nats; ``(inf, inf)`` when any value is non-finite (a corrupt sampler).

    Raises:
        ValueError: the two have different shapes (the sampler scored a different sequence).
    """
    learner = learner_logps.detach().double().flatten().cpu()
    sampler = torch.as_tensor(sampler_logps).detach().double().flatten().cpu()
    if learner.shape != sampler.shape:
        raise ValueError(
            f"The sampler scored {sampler.numel()} probe tokens but the learner {learner.numel()}: score_logps must "
            "return one log-prob per token after the first."
        )
    diff = (learner - sampler).abs()
    if not bool(torch.isfinite(diff).all()):
        return math.inf, math.inf
    return float(diff.mean()), float(diff.max())


def check_probe_gap(
    gap: float, bound: float, *, step: int, learner_precision: str, sampler_precision: str, rank: int | None = None
) -> None:
    """Raise :class:`StaleSamplerError` when ``gap`` (nats) is not finite or exceeds ``bound``; ``rank`` names the
    process whose sampler it is (multi-process runs check the worst rank)."""
    if math.isfinite(gap) and gap <= bound:
        return
    where = f" on rank {rank}" if rank is not None else ""
    raise StaleSamplerError(
        f"Sync probe at step {step}{where}: the sampler's log-probs of the probe sequence differ from the learner's by "
        f"{gap:.4g} nats on average (bound {bound:.4g}, learner {learner_precision}, sampler {sampler_precision}). "
        "The sampler is stale (a skipped or partial weight sync) or corrupt (a bad reload, e.g. per-tensor loading "
        "on the vLLM CPU build). Check the sampler's sync_weights; raise sync_probe_max_gap only if this gap is the "
        "expected precision mismatch."
    )
