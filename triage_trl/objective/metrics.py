"""The ``triage/`` metrics of one micro-batch (``docs/objective.md``, "Metrics").

:data:`METRICS` is the single list the trainer logs, each name with its meaning. Three token sets:

* *valid*: the completion mask;
* *measured*: valid tokens with a finite sampler log-prob (the mismatch metrics, zero-signal groups
  included: they measure the two engines, whatever the rewards);
* *diagnosed*: measured tokens of groups with reward spread (direction, tail, segment and share metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .steps import QUADRANTS, MeasuredGap, Rebalance, SegmentDiagnosis

_FULL = " In diagnose mode: what full mode would apply (the returned weights are then all 1)."

METRICS: dict[str, str] = {
    "gap_mean": "Mean gap = learner - sampler log-prob over measured tokens (nats).",
    "gap_abs_mean": "Mean |gap| over measured tokens (nats).",
    "gap_abs_max": "Largest |gap| over measured tokens (nats).",
    "k3_kl": "k3 KL estimate mean(e^gap - 1 - gap) over measured tokens (nats), verl's k3_kl.",
    "log_ppl_diff": "Mean over sequences of log PPL(learner) - log PPL(sampler) = -(per-sequence mean gap) "
    "(nats), verl's log_ppl_diff (same sign).",
    "nonfinite_sampler_frac": "Share of valid tokens whose sampler log-prob is NaN or +-inf (weight 0).",
    **{f"frac_{q}": f"Share of diagnosed tokens in quadrant {q}." for q in QUADRANTS},
    **{f"tail_count_{q}": f"Tail tokens (|gap| >= tau) in quadrant {q}." for q in QUADRANTS},
    "amp_imbalance": "NA tail tokens / (PA tail tokens + 1).",
    "hot_segment_frac": "Share of segments with a diagnosed token that are hot.",
    "tail_in_hot_frac": "Share of amplifying tail tokens that sit in hot segments.",
    "tail_concentration": "Share of amplifying tail tokens in the ceil(10%) of segments holding the most.",
    "beta": "Rebalancing factor of the heavier amplifying quadrant in hot segments (the spec's beta, not GRPO's KL "
    "coefficient `beta`)." + _FULL,
    "rebalanced_frac": "Share of diagnosed tokens whose weight beta < 1 multiplies." + _FULL,
    "repaired_frac": "Share of diagnosed tokens with severe mismatch, repaired." + _FULL,
    "weight_mean": "Mean weight over valid tokens." + _FULL,
    "weight_min": "Smallest weight over valid tokens." + _FULL,
    "weight_max": "Largest weight over valid tokens." + _FULL,
    "tau": "Tail threshold (nats).",
}
METRIC_NAMES = tuple(METRICS)

_K3_MAX_EXPONENT = 80.0  # k3_kl stays finite for absurd gaps


@dataclass(frozen=True)
class Diagnosis:
    """Steps 2-5 of one micro-batch, as the metrics need them.

    Attributes:
        quadrants: step 2's (B, T) bool masks by name; tau: step 3's threshold (nats);
        tail, amp_tail: (B, T) bool tail tokens and amplifying tail tokens;
        n_diagnosed: number of diagnosed tokens; segments: steps 4-5.
    """

    quadrants: dict[str, torch.Tensor]
    tau: float
    tail: torch.Tensor
    amp_tail: torch.Tensor
    n_diagnosed: int
    segments: SegmentDiagnosis


def triage_metrics(
    gap: MeasuredGap,
    diagnosis: Diagnosis,
    rebalance: Rebalance,
    severe: torch.Tensor | None,
    weights: torch.Tensor,
) -> dict[str, float]:
    """Every :data:`METRIC_NAMES` entry as a Python float (one device sync for all of them).

    Args:
        gap: step 1; diagnosis: steps 2-5; rebalance: step 6; severe: step 7's repaired tokens or ``None``.
        weights: (B, T) float32 weights of ``full`` mode, exactly 1 on masked positions.
    """
    n_diag = diagnosis.n_diagnosed
    stats = _mismatch(gap)
    for name in QUADRANTS:
        stats[f"frac_{name}"] = _share(diagnosis.quadrants[name], n_diag)
    for name in QUADRANTS:
        stats[f"tail_count_{name}"] = torch.count_nonzero(diagnosis.quadrants[name] & diagnosis.tail)
    stats["amp_imbalance"] = stats["tail_count_NA"] / (stats["tail_count_PA"] + 1.0)
    stats.update(_segment_stats(diagnosis))
    stats["beta"] = rebalance.beta
    stats["rebalanced_frac"] = _share(rebalance.tokens, n_diag)
    stats["repaired_frac"] = _share(severe, n_diag)
    stats["weight_mean"], stats["weight_min"], stats["weight_max"] = _weight_range(weights, gap.valid, gap.n_valid)
    stats["tau"] = diagnosis.tau
    device = weights.device
    values = torch.stack(
        [torch.as_tensor(stats[k], dtype=torch.float64, device=device).reshape(()) for k in METRIC_NAMES]
    )
    return dict(zip(METRIC_NAMES, values.tolist()))


def _mismatch(gap: MeasuredGap) -> dict:
    """The mismatch metrics over measured tokens (the gap is 0 on every other position)."""
    per_seq_tokens = gap.valid_f.sum(dim=1)
    if gap.nonfinite is not None:
        per_seq_tokens = per_seq_tokens - gap.nonfinite.view(torch.uint8).sum(dim=1, dtype=torch.int32)
    n_measured = max(gap.n_valid - gap.n_nonfinite, 1)
    per_seq_sum = gap.gap.sum(dim=1).double()  # rows of float32 sums, the total in float64
    k3 = torch.expm1(gap.gap.clamp(max=_K3_MAX_EXPONENT)).sub_(gap.gap)  # 0 where unmeasured (gap 0)
    seqs_with_tokens = torch.count_nonzero(per_seq_tokens).clamp(min=1)
    return {
        "gap_mean": per_seq_sum.sum() / n_measured,
        "gap_abs_mean": gap.abs_gap.sum(dim=1).double().sum() / n_measured,
        "gap_abs_max": gap.abs_gap.max() if gap.abs_gap.numel() else 0.0,
        "k3_kl": k3.sum(dim=1).double().sum() / n_measured,
        "log_ppl_diff": -(per_seq_sum / per_seq_tokens.clamp(min=1)).sum() / seqs_with_tokens,
        "nonfinite_sampler_frac": gap.n_nonfinite / max(gap.n_valid, 1),
    }


def _segment_stats(diagnosis: Diagnosis) -> dict:
    """hot_segment_frac, tail_in_hot_frac, tail_concentration."""
    segments = diagnosis.segments
    nonempty = int(torch.count_nonzero(segments.n_tokens))
    n_amp_tail = int(torch.count_nonzero(diagnosis.amp_tail))
    in_hot = segments.in_hot
    return {
        "hot_segment_frac": _share(segments.hot, nonempty),
        "tail_in_hot_frac": _share(diagnosis.amp_tail & in_hot, n_amp_tail) if in_hot is not None else 0.0,
        "tail_concentration": _top_decile_share(segments.n_amp_tail, nonempty, n_amp_tail),
    }


def _share(selected: torch.Tensor | None, total: int):
    """count(selected) / total in float64 (0 when nothing is selected or total is 0)."""
    if selected is None:
        return 0.0
    return torch.count_nonzero(selected).double() / max(total, 1)


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


def _top_decile_share(n_amp_tail: torch.Tensor, nonempty_segments: int, total: int) -> float:
    """Share of amplifying tail tokens held by the ceil(10%) of non-empty segments with the most."""
    if total == 0:
        return 0.0
    top = (nonempty_segments + 9) // 10
    holding = n_amp_tail[n_amp_tail > 0]
    if holding.numel() <= top:
        return 1.0
    return float(holding.topk(top).values.sum()) / total
