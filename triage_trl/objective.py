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

QUADRANTS = ("NA", "PA", "NC", "PC")

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
    _check_inputs(old_logps, sampler_logps, advantages, mask, segment_ids)
    B, T = old_logps.shape
    device = old_logps.device
    ones = torch.ones(B, T, dtype=torch.float32, device=device)
    if config.triage_mode == "off":
        return TriageResult(ones, {})

    valid = mask.detach() != 0
    old = old_logps.detach().float()
    sampler = sampler_logps.detach().float()
    adv = advantages.detach().float()
    adv = adv[:, None].expand(B, T) if adv.dim() == 1 else adv
    _check_finite_on_valid("old_logps (learner log-probs)", old, valid, "the learner's forward pass diverged")
    _check_finite_on_valid("advantages", adv, valid, "check the reward functions for NaN/inf rewards")

    # 1. Gap: learner minus sampler, zero where masked or where the sampler's log-prob is unusable.
    sampler_finite = torch.isfinite(sampler)
    measured = valid & sampler_finite
    nonfinite = valid & ~sampler_finite
    raw_gap = torch.where(measured, old - torch.where(sampler_finite, sampler, 0.0), 0.0)
    abs_gap = raw_gap.abs()
    gap = raw_gap if config.triage_gap_sign == 1 else -raw_gap

    # 2. Direction quadrants.
    adv_neg, adv_pos = measured & (adv < 0), measured & (adv > 0)
    gap_neg, gap_pos = gap < 0, gap > 0
    quadrant = {"NA": adv_neg & gap_neg, "PA": adv_pos & gap_pos, "NC": adv_neg & gap_pos, "PC": adv_pos & gap_neg}
    amplifying = quadrant["NA"] | quadrant["PA"]

    # 3. Tail.
    n_measured = int(measured.sum())
    tau = float(config.triage_tail_min_gap)
    if n_measured:
        kth = abs_gap[measured].kthvalue(order_statistic_rank(n_measured, config.triage_tail_quantile)).values
        tau = max(tau, float(kth))
    tail = measured & (abs_gap >= tau)
    amp_tail = amplifying & tail

    # 4-5. Segment diagnosis: counts per (row, segment) bin.
    flat_seg = (segment_ids.to(device=device, dtype=torch.int64) + torch.arange(B, device=device)[:, None] * T).view(-1)
    n_seg = torch.zeros(B * T, dtype=torch.int64, device=device).index_add_(0, flat_seg, valid.view(-1).to(torch.int64))
    k_seg = torch.zeros(B * T, dtype=torch.int64, device=device).index_add_(0, flat_seg, amp_tail.view(-1).to(torch.int64))
    density = k_seg.double() / n_seg.clamp(min=1).double()
    hot_seg = (k_seg >= config.triage_hot_min_tokens) & (density >= config.triage_hot_density)
    in_hot = hot_seg[flat_seg].view(B, T) & valid

    # 6. Selective rebalancing of the heavier amplifying quadrant inside hot segments.
    abs_adv = adv.abs().double()
    mass_na = (abs_adv * (quadrant["NA"] & in_hot)).sum()
    mass_pa = (abs_adv * (quadrant["PA"] & in_hot)).sum()
    heavy_is_na = bool(mass_na >= mass_pa)
    mass_heavy, mass_light = (mass_na, mass_pa) if heavy_is_na else (mass_pa, mass_na)
    beta = 1.0
    if float(mass_heavy) > 0:
        beta = min(1.0, max(config.triage_rebalance_floor, float(mass_light / mass_heavy)))
    rebalanced = quadrant["NA" if heavy_is_na else "PA"] & in_hot
    if config.triage_rebalance_scope == "tail":
        rebalanced = rebalanced & tail
    if beta == 1.0:
        rebalanced = torch.zeros_like(rebalanced)
    weights = torch.where(rebalanced, beta, 1.0)

    # 7. Bounded repair of residual severe mismatch.
    severe = (measured & (abs_gap >= config.triage_severe_gap)) | nonfinite
    clip = float(config.triage_repair_clip)
    if config.triage_repair_mode == "excess_is":
        excess = torch.sign(raw_gap) * (abs_gap - config.triage_severe_gap)
        # -inf/NaN sampler log-probs: learner/sampler -> +inf; +inf: -> 0.
        excess = torch.where(nonfinite, torch.where(sampler == math.inf, -math.inf, math.inf), excess)
        repair = excess.exp().clamp(1.0 / clip, clip)
        weights = torch.where(severe, weights * repair, weights)
    elif config.triage_repair_mode == "mask":
        weights = torch.where(severe, 0.0, weights)
    else:
        severe = torch.zeros_like(severe)
    weights = torch.where(valid, weights, 1.0)

    metrics = _metrics(
        raw_gap=raw_gap, abs_gap=abs_gap, valid=valid, measured=measured, nonfinite=nonfinite,
        quadrant=quadrant, tail=tail, amp_tail=amp_tail, n_seg=n_seg, k_seg=k_seg, hot_seg=hot_seg,
        in_hot=in_hot, rebalanced=rebalanced, severe=severe, weights=weights, beta=beta, tau=tau,
    )
    if config.triage_mode == "diagnose":
        return TriageResult(ones, metrics)
    return TriageResult(weights, metrics)


def _metrics(*, raw_gap, abs_gap, valid, measured, nonfinite, quadrant, tail, amp_tail, n_seg, k_seg,
             hot_seg, in_hot, rebalanced, severe, weights, beta, tau) -> dict[str, float]:
    f64 = torch.float64
    n_valid = valid.sum().to(f64).clamp(min=1)
    n_meas = measured.sum().to(f64).clamp(min=1)
    k3 = torch.where(measured, raw_gap.double().clamp(max=_K3_MAX_EXPONENT).exp() - 1 - raw_gap.double(), 0.0)
    per_seq_tokens = measured.sum(dim=1)
    seq_has_tokens = per_seq_tokens > 0
    per_seq_mean = raw_gap.double().sum(dim=1) / per_seq_tokens.clamp(min=1)
    n_amp_tail = amp_tail.sum()
    nonempty_segments = int((n_seg > 0).sum())
    w_valid = weights[valid]

    stats = {
        "gap_mean": raw_gap.double().sum() / n_meas,
        "gap_abs_mean": abs_gap.double().sum() / n_meas,
        "gap_abs_max": abs_gap.max() if abs_gap.numel() else 0.0,
        "k3_kl": k3.sum() / n_meas,
        "log_ppl_diff": per_seq_mean[seq_has_tokens].sum() / seq_has_tokens.sum().clamp(min=1),
        "nonfinite_sampler_frac": nonfinite.sum() / n_valid,
    }
    for name in QUADRANTS:
        stats[f"frac_{name}"] = quadrant[name].sum() / n_valid
    for name in QUADRANTS:
        stats[f"tail_count_{name}"] = (quadrant[name] & tail).sum()
    stats["amp_imbalance"] = stats["tail_count_NA"] / (stats["tail_count_PA"] + 1.0)
    stats["hot_segment_frac"] = hot_seg.sum() / max(nonempty_segments, 1)
    stats["tail_in_hot_frac"] = (amp_tail & in_hot).sum() / n_amp_tail.clamp(min=1)
    stats["tail_concentration"] = _top_decile_share(k_seg, nonempty_segments, n_amp_tail)
    stats["beta"] = beta
    stats["rebalanced_frac"] = rebalanced.sum() / n_valid
    stats["repaired_frac"] = severe.sum() / n_valid
    stats["weight_mean"] = w_valid.double().sum() / n_valid if w_valid.numel() else 1.0
    stats["weight_min"] = w_valid.min() if w_valid.numel() else 1.0
    stats["weight_max"] = w_valid.max() if w_valid.numel() else 1.0
    stats["tau"] = tau
    values = torch.stack([torch.as_tensor(stats[k], dtype=f64, device=valid.device).reshape(()) for k in METRIC_NAMES])
    return dict(zip(METRIC_NAMES, values.tolist()))


def _top_decile_share(k_seg: torch.Tensor, nonempty_segments: int, n_amp_tail: torch.Tensor):
    """Share of amplifying tail tokens held by the ceil(10%) of non-empty segments with the most."""
    total = int(n_amp_tail)
    if total == 0:
        return 0.0
    top = (nonempty_segments + 9) // 10
    holding = k_seg[k_seg > 0]
    if holding.numel() <= top:
        return 1.0
    return float(holding.topk(top).values.sum()) / total


def _check_inputs(old_logps, sampler_logps, advantages, mask, segment_ids) -> None:
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
    if segment_ids.numel() and (segment_ids.min() < 0 or segment_ids.max() >= shape[1]):
        raise ValueError(
            f"segment_ids must lie in [0, T={shape[1]}); got [{int(segment_ids.min())}, {int(segment_ids.max())}]. "
            "Build them with triage_trl.segment_ids()."
        )


def _check_finite_on_valid(name: str, values: torch.Tensor, valid: torch.Tensor, remedy: str) -> None:
    bad = int((valid & ~torch.isfinite(values)).sum())
    if bad:
        raise ValueError(f"{name} hold {bad} non-finite values on valid tokens: {remedy}.")
