"""``triage_weights``: steps 1-7 and 9 of the TRIAGE objective composed for one micro-batch.

The spec is ``docs/objective.md``, a reconstruction of TRIAGE (arXiv 2610.07043) from its abstract.
No TRL import: the trainer multiplies TRL's per-token policy-gradient loss by
:attr:`TriageResult.weights` before TRL's own aggregation (step 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import TriageConfig
from . import steps
from .controls import direction_blind_weights, touched_tokens
from .metrics import Diagnosis, triage_metrics


@dataclass(frozen=True)
class TriageResult:
    """What the objective returns for one micro-batch.

    Attributes:
        weights: (B, T) float32, detached, on the inputs' device. Multiply TRL's per-token
            policy-gradient loss by it before aggregation. Exactly 1 on masked positions, on tokens of
            zero-signal groups, in ``diagnose`` and ``off`` modes, and wherever nothing applies; exactly
            0 on valid tokens with a non-finite sampler log-prob (``full`` mode).
        metrics: the metrics of :data:`triage_trl.objective.METRICS` (without the ``triage/`` prefix)
            as Python floats; empty in ``off`` mode. Gaps are in nats.
    """

    weights: torch.Tensor
    metrics: dict[str, float]


def triage_weights(
    old_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segment_ids: torch.Tensor,
    config: TriageConfig,
    *,
    zero_signal: torch.Tensor | None = None,
) -> TriageResult:
    """TRIAGE's per-token weights and metrics for one micro-batch (steps 1-7 and 9).

    With ``config.triage_direction="blind"`` the ``full`` weights are those of the direction-blind control
    (:func:`triage_trl.objective.controls.direction_blind_weights`); the metrics then describe them.

    Args:
        old_logps: (B, T) learner log-probs (nats) of the sampled tokens at rollout time (TRL's
            ``old_per_token_logps``; pass ``logps`` when TRL has none). Detached here.
        sampler_logps: (B, T) the sampler's log-probs (nats) of the same tokens after temperature
            (TRL's ``sampling_per_token_logps``). NaN/+-inf leave a token unmeasured: weight 0.
        advantages: (B,) or (B, T).
        mask: (B, T) bool or 0/1 completion mask (times the tool mask where present).
        segment_ids: (B, T) integer per-row segment index in [0, T), from :func:`triage_trl.segment_ids`.
        config: the ``triage_*`` settings.
        zero_signal: optional (B,) bool, True for completions whose group had zero reward spread
            (all rewards equal). Their tokens get weight 1 and stay out of the diagnosis.

    Returns:
        :class:`TriageResult`.

    Raises:
        ValueError: mismatched shapes or devices, non-float log-probs, non-integer segment ids or
            ids outside [0, T), a ``zero_signal`` that is not (B,) bool, or non-finite learner
            log-probs or advantages on valid tokens.
        NonFiniteSamplerLogprobsError: more than ``config.triage_nonfinite_max_frac`` of the valid
            tokens have a non-finite sampler log-prob (``full`` and ``diagnose`` modes).
    """
    num_segments = _check_inputs(old_logps, sampler_logps, advantages, mask, segment_ids, zero_signal)
    if config.triage_mode == "off":
        return TriageResult(torch.ones(old_logps.shape, dtype=torch.float32, device=old_logps.device), {})
    valid = mask.detach()
    valid = valid if valid.dtype == torch.bool else valid != 0
    old = old_logps.detach().float()
    adv = advantages.detach().float()
    adv = adv[:, None] if adv.dim() == 1 else adv  # (B, 1) broadcasts without a (B, T) copy
    _check_finite_on_valid("old_logps (learner log-probs)", old, valid, "the learner's forward pass diverged")
    _check_finite_on_valid("advantages", adv, valid, "check the reward functions for NaN/inf rewards")

    gap = steps.measure_gap(old, sampler_logps.detach().float(), valid)
    steps.check_nonfinite_share(gap.n_nonfinite, gap.n_valid, config.triage_nonfinite_max_frac)
    diagnosed = steps.exclude_zero_signal(gap, adv, zero_signal)
    diagnosis = _diagnose(gap, diagnosed, segment_ids, num_segments, config)

    rebalance = steps.selective_rebalance(
        diagnosed.advantages, diagnosis.quadrants, diagnosis.segments.in_hot, diagnosis.tail,
        config.triage_rebalance_floor, config.triage_rebalance_scope,
    )
    weights = steps.rebalance_weights(rebalance, old)
    severe = None
    if config.triage_repair_mode != "none":
        severe = steps.severe_tokens(diagnosed.abs_gap, diagnosed.advantages, config.triage_severe_gap)
    weights = steps.bounded_repair(
        weights, gap.gap, gap.abs_gap, severe, config.triage_repair_mode,
        config.triage_severe_gap, config.triage_repair_clip,
    )
    weights = steps.drop_unmeasured(weights, gap.nonfinite)
    if config.triage_direction == "blind":
        touched = touched_tokens(diagnosed.mask_f, diagnosed.advantages, diagnosis.segments.in_hot, diagnosis.tail,
                                 rebalance.tokens is not None, config.triage_rebalance_scope, severe)
        weights, _ = direction_blind_weights(weights, touched)

    metrics = triage_metrics(gap, diagnosis, rebalance, severe, weights)
    if config.triage_mode == "diagnose":
        return TriageResult(torch.ones_like(weights), metrics)
    return TriageResult(weights, metrics)


def _diagnose(
    gap: steps.MeasuredGap,
    diagnosed: steps.DiagnosedTokens,
    segment_ids: torch.Tensor,
    num_segments: int,
    config: TriageConfig,
) -> Diagnosis:
    """Steps 2-5: direction quadrants, tail threshold and tokens, segment diagnosis."""
    quadrants = steps.direction_quadrants(gap.gap, diagnosed.advantages, config.triage_gap_sign)
    tau = steps.tail_threshold(
        diagnosed.abs_gap, diagnosed.count, config.triage_tail_quantile, config.triage_tail_min_gap
    )
    tail = steps.tail_tokens(diagnosed.abs_gap, tau, diagnosed.mask_f)
    amp_tail = (quadrants["NA"] | quadrants["PA"]) & tail
    segments = steps.diagnose_segments(
        segment_ids, num_segments, diagnosed.mask_f, amp_tail, gap.valid,
        config.triage_hot_min_tokens, config.triage_hot_density,
    )
    return Diagnosis(quadrants, tau, tail, amp_tail, diagnosed.count, segments)


def _check_inputs(old_logps, sampler_logps, advantages, mask, segment_ids, zero_signal) -> int:
    """Validate shapes, dtypes and devices; return the number of segment ids per row."""
    if old_logps.dim() != 2:
        raise ValueError(f"old_logps must have shape (B, T); got {tuple(old_logps.shape)}.")
    shape = tuple(old_logps.shape)
    for name, t in (("sampler_logps", sampler_logps), ("mask", mask), ("segment_ids", segment_ids)):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but old_logps has {shape}: all must be (B, T).")
    if tuple(advantages.shape) not in (shape[:1], shape):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; it must be (B,) = {shape[:1]} or (B, T) = {shape}."
        )
    for name, t in (("old_logps", old_logps), ("sampler_logps", sampler_logps), ("advantages", advantages)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor; got {t.dtype}.")
    if segment_ids.is_floating_point() or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids must be an integer tensor; got {segment_ids.dtype}.")
    tensors = [old_logps, sampler_logps, advantages, mask, segment_ids]
    if zero_signal is not None:
        if zero_signal.dtype != torch.bool or tuple(zero_signal.shape) != shape[:1]:
            raise ValueError(
                f"zero_signal must be a bool tensor of shape (B,) = {shape[:1]}; got {zero_signal.dtype} "
                f"{tuple(zero_signal.shape)}. Mark each completion whose group's rewards are all equal."
            )
        tensors.append(zero_signal)
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}.")
    if segment_ids.numel() == 0:
        return 1
    lo, hi = int(segment_ids.min()), int(segment_ids.max())
    if lo < 0 or hi >= shape[1]:
        raise ValueError(
            f"segment_ids must lie in [0, T={shape[1]}); got [{lo}, {hi}]. Build them with triage_trl.segment_ids()."
        )
    return hi + 1


def _check_finite_on_valid(name: str, values: torch.Tensor, valid: torch.Tensor, remedy: str) -> None:
    """Raise ``ValueError`` when ``values`` hold NaN/+-inf on valid tokens (a finite sum proves there are none)."""
    if bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all()):
        return
    bad = int(torch.count_nonzero(valid & ~torch.isfinite(values)))
    if bad:
        raise ValueError(f"{name} hold {bad} non-finite values on valid tokens: {remedy}.")
