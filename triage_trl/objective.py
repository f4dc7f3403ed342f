"""The TRIAGE objective as pure torch: per-token weights and the ``triage/`` metrics.

Spec: ``shared/design/triage-objective.md``, a reconstruction of TRIAGE (arXiv 2610.07043) from its
abstract. This module has no TRL import; the trainer multiplies TRL's per-token policy-gradient
loss by :attr:`TriageResult.weights` before TRL's own aggregation (spec step 8).

Choices where the spec is silent (each documented in ``docs/objective.md``):

* Tail threshold: ``tau = max(triage_tail_min_gap, x_(k))`` with ``x_(k)`` the k-th smallest |gap|
  over valid tokens with finite sampler log-probs, ``k = ceil(q * n)`` (numpy's ``inverted_cdf``
  quantile): an exact order statistic from ``torch.kthvalue``, no interpolation, any size.
* Non-finite sampler log-probs (-inf, NaN, +inf) on valid tokens are severe mismatch: they take
  no part in the diagnosis or the mismatch metrics (their gap is unknown or infinite) and get the
  saturated repair weight: ``C`` for -inf/NaN (the sampler gave the token no usable probability,
  so learner/sampler -> infinity), ``1/C`` for +inf; 0 in ``mask`` mode, 1 in ``none`` mode.
* Repair touches only tokens with a non-zero advantage: a token with A = 0 carries no
  policy-gradient update, and the spec's invariant "all advantages 0 -> every weight is 1" holds.
* ``triage_gap_sign`` flips the direction classification only. The repair weight is an
  importance weight of learner over sampler and the mismatch metrics describe learner - sampler,
  whatever the convention flag says.
* ``diagnose`` mode reports the statistics of the weights ``full`` mode would apply (beta,
  rebalanced/repaired shares, weight range) while returning weights of exactly 1.
* ``k3_kl`` clamps the exponent at 80 nats so the metric stays finite for absurd gaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .triage_config import TriageConfig

QUADRANTS = ("NA", "PA", "NC", "PC")  # amplifying, amplifying, contracting, contracting

METRIC_NAMES = (
    "gap_mean",
    "gap_abs_mean",
    "gap_abs_max",
    "k3_kl",
    "log_ppl_diff",
    "nonfinite_sampler_frac",
    "frac_NA",
    "frac_PA",
    "frac_NC",
    "frac_PC",
    "tail_count_NA",
    "tail_count_PA",
    "tail_count_NC",
    "tail_count_PC",
    "amp_imbalance",
    "hot_segment_frac",
    "tail_in_hot_frac",
    "tail_concentration",
    "beta",
    "rebalanced_frac",
    "repaired_frac",
    "weight_mean",
    "weight_min",
    "weight_max",
    "tau",
)

_K3_MAX_EXPONENT = 80.0


@dataclass(frozen=True)
class TriageResult:
    """What the objective returns for one micro-batch.

    Attributes:
        weights: (B, T) float32, detached, on the inputs' device. Multiply TRL's per-token
            policy-gradient loss by it before aggregation. Exactly 1 on masked positions, in
            ``diagnose`` and ``off`` modes, and wherever nothing applies.
        metrics: the spec's metrics (names in :data:`METRIC_NAMES`, without the ``triage/``
            prefix) as Python floats; empty in ``off`` mode. Gaps are in nats.
    """

    weights: torch.Tensor
    metrics: dict[str, float]


def order_statistic_rank(n: int, q: float) -> int:
    """1-based rank ``k = ceil(q * n)`` (clamped to [1, n]) of the ``q`` quantile of ``n`` values."""
    return min(n, max(1, math.ceil(q * n)))


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
    """TRIAGE's per-token weights and metrics for one micro-batch (spec steps 1-7 and 9).

    Args:
        old_logps: (B, T) learner log-probs (nats) of the sampled tokens at rollout time. Detached
            here; pass ``logps`` when TRL has no ``old_per_token_logps``.
        sampler_logps: (B, T) the sampler's log-probs (nats) of the same tokens after temperature
            (TRL's ``sampling_per_token_logps``). May hold -inf/NaN: see the module notes.
        advantages: (B,) or (B, T).
        mask: (B, T) bool or 0/1 completion mask (times the tool mask where present).
        segment_ids: (B, T) integer per-row segment index in [0, T), from :func:`segment_ids`.
        config: the ``triage_*`` settings.

    Returns:
        :class:`TriageResult`.

    Raises:
        ValueError: mismatched shapes or devices, non-float log-probs, non-integer segment ids or
            ids outside [0, T), or non-finite learner log-probs or advantages on valid tokens.
    """
    num_segments = _check_inputs(old_logps, sampler_logps, advantages, mask, segment_ids)
    B, T = old_logps.shape
    device = old_logps.device
    ones = torch.ones(B, T, dtype=torch.float32, device=device)
    if config.triage_mode == "off":
        return TriageResult(ones, {})
    # Speed notes (CPU, 1M tokens): masked_fill/where/nonzero and bool->float promotions cost several
    # times a plain float op, so masks are applied by multiplying with one float copy of the mask and
    # full-size work is skipped when a cheap reduction shows it has nothing to do.
    mask = mask.detach()
    valid = mask if mask.dtype == torch.bool else mask != 0
    valid_f = valid.float()
    old = old_logps.detach().float()
    sampler = sampler_logps.detach().float()
    adv = advantages.detach().float()
    adv = adv[:, None] if adv.dim() == 1 else adv  # (B, 1) broadcasts without a (B, T) copy
    if zero_signal is not None:  # a group with no reward spread carries no update: its advantage is exactly 0
        adv = adv * (~zero_signal.to(device=adv.device, dtype=torch.bool))[:, None]
    _check_finite_on_valid("old_logps (learner log-probs)", old, valid, "the learner's forward pass diverged")
    _check_finite_on_valid("advantages", adv, valid, "check the reward functions for NaN/inf rewards")

    # 1. Gap: learner minus sampler; zero where masked or where the sampler's log-prob is unusable.
    raw_gap = (old - sampler).mul_(valid_f)
    nonfinite = None
    if not bool(torch.isfinite(raw_gap.sum())):  # a finite sum proves every gap finite
        nonfinite = valid & ~torch.isfinite(sampler)
        if not bool(nonfinite.any()):
            nonfinite = None  # the NaN/inf came from learner log-probs on masked positions
        torch.nan_to_num_(raw_gap, nan=0.0, posinf=0.0, neginf=0.0)
    measured = valid if nonfinite is None else valid & ~nonfinite
    abs_gap = raw_gap.abs()

    # 2. Direction quadrants: amplifying when sign(A) == sign(gap), contracting when they differ.
    gap_pos, gap_neg = raw_gap > 0, raw_gap < 0
    if config.triage_gap_sign == -1:
        gap_pos, gap_neg = gap_neg, gap_pos
    adv_pos, adv_neg = adv > 0, adv < 0
    quadrant = {"NA": gap_neg & adv_neg, "PA": gap_pos & adv_pos, "NC": gap_pos & adv_neg, "PC": gap_neg & adv_pos}

    # 3. Tail: tau is an exact order statistic of |gap| over measured tokens. Unmeasured tokens hold
    # |gap| = 0, the smallest value, so the k-th measured value is the (unmeasured + k)-th overall.
    n_measured = int(torch.count_nonzero(measured))
    tau = float(config.triage_tail_min_gap)
    if n_measured:
        rank = B * T - n_measured + order_statistic_rank(n_measured, config.triage_tail_quantile)
        tau = max(tau, _kth_smallest(abs_gap.reshape(-1), rank))
    tail = abs_gap >= tau
    if tau <= 0:
        tail &= measured
    amp_tail = (quadrant["NA"] | quadrant["PA"]) & tail

    # 4-5. Segment diagnosis over (row, segment) bins: n_s valid tokens, k_s amplifying tail tokens.
    n_bins = B * num_segments
    index_dtype = torch.int32 if n_bins < 2**31 else torch.int64  # int32 adds and gathers are cheaper
    rows = torch.arange(B, device=device, dtype=index_dtype)[:, None] * num_segments
    flat_seg = (segment_ids.to(index_dtype) + rows).reshape(-1)
    n_seg = torch.zeros(n_bins, device=device).index_add_(0, flat_seg, valid_f.reshape(-1))
    amp_tail_bins = flat_seg[amp_tail.reshape(-1)]  # amplifying tail tokens are few: work on them only
    k_seg = torch.zeros(n_bins, device=device).index_add_(
        0, amp_tail_bins, torch.ones(amp_tail_bins.numel(), device=device)
    )
    density = k_seg.double() / n_seg.clamp(min=1).double()
    hot_seg = (k_seg >= config.triage_hot_min_tokens) & (density >= config.triage_hot_density)
    any_hot = bool(hot_seg.any())
    in_hot = hot_seg.index_select(0, flat_seg).view(B, T) & valid if any_hot else None

    # 6. Selective rebalancing of the heavier amplifying quadrant inside hot segments.
    beta, rebalanced, heavy_is_na = 1.0, None, True
    if any_hot:
        mass_na = _advantage_mass(adv, quadrant["NA"] & in_hot)
        mass_pa = _advantage_mass(adv, quadrant["PA"] & in_hot)
        heavy_is_na = mass_na >= mass_pa
        mass_heavy, mass_light = (mass_na, mass_pa) if heavy_is_na else (mass_pa, mass_na)
        if mass_heavy > 0:
            beta = min(1.0, max(config.triage_rebalance_floor, mass_light / mass_heavy))
    weights = ones
    if beta < 1.0:
        rebalanced = quadrant["NA" if heavy_is_na else "PA"] & in_hot
        if config.triage_rebalance_scope == "tail":
            rebalanced &= tail
        weights = 1.0 - (1.0 - beta) * rebalanced

    # 7. Bounded repair of residual severe mismatch. Only tokens that carry a policy-gradient update
    # (A != 0) are repaired; the rest keep weight 1.
    severe = None
    if config.triage_repair_mode != "none":
        adv_nonzero = adv != 0
        severe = (abs_gap >= config.triage_severe_gap) & measured & adv_nonzero
        if nonfinite is not None:
            severe |= nonfinite & adv_nonzero
        if bool(severe.any()):
            if config.triage_repair_mode == "mask":
                weights = weights * ~severe
            else:
                weights = weights * _repair_weight(
                    raw_gap, abs_gap, sampler, severe, nonfinite, config.triage_severe_gap, config.triage_repair_clip
                )

    metrics = _metrics(
        raw_gap=raw_gap, abs_gap=abs_gap, valid=valid, valid_f=valid_f, measured=measured, nonfinite=nonfinite,
        quadrant=quadrant, tail=tail, amp_tail=amp_tail, n_seg=n_seg, k_seg=k_seg, hot_seg=hot_seg, in_hot=in_hot,
        rebalanced=rebalanced, severe=severe, weights=weights, beta=beta, tau=tau,
    )
    if config.triage_mode == "diagnose":
        return TriageResult(ones, metrics)
    return TriageResult(weights, metrics)


def _all_finite(x: torch.Tensor) -> bool:
    """True when every element is finite. A finite sum proves it in one cheap pass; a non-finite sum
    (a NaN/inf element, or overflow) falls back to the exact check."""
    total = x.sum()
    return bool(torch.isfinite(total)) or bool(torch.isfinite(x).all())


def _kth_smallest(values: torch.Tensor, k: int) -> float:
    """Exact k-th smallest (1-based) of a 1-D tensor, any size.

    ``torch.kthvalue`` on the whole tensor is the slowest step of the objective. For a high rank, a
    strided sample gives a bound that, when at least ``n - k + 1`` values reach it, provably lies
    at or below the answer; the answer is then selected among the few values above the bound.
    """
    n = values.numel()
    above_needed = n - k + 1
    if n >= 1 << 16 and above_needed * 8 <= n:
        sample = values[:: n >> 14]
        lower_q = max(0.0, 1.0 - 2.0 * above_needed / n)  # twice the tail share, as a safety margin
        bound = sample.kthvalue(max(1, math.floor(lower_q * sample.numel()))).values
        above = values >= bound
        n_above = int(torch.count_nonzero(above))
        if n_above >= above_needed:  # fewer than k values lie below the bound: the answer is above it
            return float(values[above].kthvalue(n_above - above_needed + 1).values)
    return float(values.kthvalue(k).values)


def _advantage_mass(adv: torch.Tensor, selected: torch.Tensor) -> float:
    """sum |A| over selected tokens; adv is (B, 1) or (B, T). Accumulated in float64."""
    if adv.shape[1] == 1:
        per_row = selected.view(torch.uint8).sum(dim=1, dtype=torch.int32).double()
        return float((per_row * adv[:, 0].double().abs()).sum())
    return float((adv.abs() * selected).sum(dtype=torch.float64))


def _repair_weight(raw_gap, abs_gap, sampler, severe, nonfinite, severe_gap: float, clip: float) -> torch.Tensor:
    """Per-token repair factor: clamp(exp(sign(gap) * (|gap| - severe_gap)), 1/C, C) on severe tokens, 1 elsewhere.

    Non-finite sampler log-probs saturate it: -inf/NaN mean learner/sampler -> inf (weight C), +inf the
    reverse (weight 1/C).
    """
    # relu(|gap| - severe_gap) is 0 below the threshold, so the factor there is exactly exp(0) = 1
    excess = (abs_gap - severe_gap).clamp_(min=0.0).mul_(torch.sign(raw_gap)).mul_(severe)
    if nonfinite is not None and bool(nonfinite.any()):
        saturated = torch.where(sampler == math.inf, -math.inf, math.inf)
        excess = torch.where(nonfinite & severe, saturated, excess)
    return excess.exp_().clamp_(1.0 / clip, clip)


def _metrics(*, raw_gap, abs_gap, valid, valid_f, measured, nonfinite, quadrant, tail, amp_tail, n_seg, k_seg,
             hot_seg, in_hot, rebalanced, severe, weights, beta, tau) -> dict[str, float]:
    count, f64 = torch.count_nonzero, torch.float64
    n_tokens = valid.numel()
    n_valid = int(count(valid))
    per_seq_tokens = valid_f.sum(dim=1)
    if nonfinite is not None:
        per_seq_tokens = per_seq_tokens - nonfinite.view(torch.uint8).sum(dim=1, dtype=torch.int32)
    n_meas = max(int(per_seq_tokens.sum()), 1)
    seq_has_tokens = per_seq_tokens > 0
    per_seq_sum = raw_gap.sum(dim=1).double()  # rows of float32 sums, the total in float64
    k3 = torch.expm1(raw_gap.clamp(max=_K3_MAX_EXPONENT)).sub_(raw_gap)  # 0 where unmeasured (gap 0)
    n_amp_tail = int(count(amp_tail))
    nonempty_segments = int(count(n_seg))
    dv = max(n_valid, 1)

    stats = {
        "gap_mean": per_seq_sum.sum() / n_meas,
        "gap_abs_mean": abs_gap.sum(dim=1).double().sum() / n_meas,
        "gap_abs_max": abs_gap.max() if n_tokens else 0.0,
        "k3_kl": k3.sum(dim=1).double().sum() / n_meas,
        "log_ppl_diff": (per_seq_sum / per_seq_tokens.clamp(min=1)).sum() / count(seq_has_tokens).clamp(min=1),
        "nonfinite_sampler_frac": count(nonfinite) / dv if nonfinite is not None else 0.0,
    }
    for name in QUADRANTS:
        stats[f"frac_{name}"] = count(quadrant[name]) / dv  # quadrants hold measured tokens only
    for name in QUADRANTS:
        stats[f"tail_count_{name}"] = count(quadrant[name] & tail)
    stats["amp_imbalance"] = stats["tail_count_NA"] / (stats["tail_count_PA"] + 1.0)
    stats["hot_segment_frac"] = count(hot_seg) / max(nonempty_segments, 1)
    stats["tail_in_hot_frac"] = count(amp_tail & in_hot) / max(n_amp_tail, 1) if in_hot is not None else 0.0
    stats["tail_concentration"] = _top_decile_share(k_seg, nonempty_segments, n_amp_tail)
    stats["beta"] = beta
    stats["rebalanced_frac"] = count(rebalanced) / dv if rebalanced is not None else 0.0
    stats["repaired_frac"] = count(severe) / dv if severe is not None else 0.0
    stats["weight_mean"], stats["weight_min"], stats["weight_max"] = _weight_range(weights, valid, n_valid)
    stats["tau"] = tau
    values = torch.stack(
        [torch.as_tensor(stats[k], dtype=f64, device=valid.device).reshape(()) for k in METRIC_NAMES]
    )
    return dict(zip(METRIC_NAMES, values.tolist()))


def _weight_range(weights: torch.Tensor, valid: torch.Tensor, n_valid: int):
    """Mean, min and max of the weights over valid tokens. Masked positions hold exactly 1."""
    if n_valid == 0:
        return 1.0, 1.0, 1.0
    n_masked = valid.numel() - n_valid
    mean = (weights.sum(dim=1).double().sum() - n_masked) / n_valid
    low, high = float(weights.min()), float(weights.max())
    # A masked 1 can hide the valid extreme only when every valid weight lies beyond 1 on that side.
    if n_masked and low == 1.0:
        low = float((weights + (~valid) * 1e30).min())
    if n_masked and high == 1.0:
        high = float((weights - (~valid) * 1e30).max())
    return mean, low, high


def _top_decile_share(k_seg: torch.Tensor, nonempty_segments: int, total: int) -> float:
    """Share of amplifying tail tokens held by the ceil(10%) of non-empty segments with the most."""
    if total == 0:
        return 0.0
    top = (nonempty_segments + 9) // 10
    holding = k_seg[k_seg > 0]
    if holding.numel() <= top:
        return 1.0
    return float(holding.topk(top).values.sum()) / total


def _check_inputs(old_logps, sampler_logps, advantages, mask, segment_ids) -> int:
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
    devices = {t.device for t in (old_logps, sampler_logps, advantages, mask, segment_ids)}
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
    if _all_finite(values):
        return
    bad = int(torch.count_nonzero(valid & ~torch.isfinite(values)))
    if bad:
        raise ValueError(f"{name} hold {bad} non-finite values on valid tokens: {remedy}.")
