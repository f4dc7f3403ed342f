"""Steps 1-7 of the TRIAGE objective as small pure functions (``docs/objective.md``).

Each function takes the float32, detached (B, T) tensors :func:`triage_trl.triage_weights` prepares
(advantages as (B, 1) or (B, T), so a per-sequence advantage broadcasts without a copy) and returns
tensors of the same shape. Gaps are learner minus sampler log-probs, in nats.

Speed notes (CPU, 1M tokens): ``masked_fill``/``where``/``nonzero`` and bool->float promotions cost
several times a plain float op, so masks are applied by multiplying with one float copy of the mask,
and full-size work is skipped when a cheap reduction shows it has nothing to do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .order_statistic import kth_smallest, order_statistic_rank

QUADRANTS = ("NA", "PA", "NC", "PC")  # amplifying, amplifying, contracting, contracting
AMPLIFYING = ("NA", "PA")


class NonFiniteSamplerLogprobsError(RuntimeError):
    """More than ``triage_nonfinite_max_frac`` of a micro-batch's valid tokens have a NaN or +-inf
    sampler log-prob: the sampler is broken, and no objective can correct for it."""


# --------------------------------------------------------------------------------------- step 1


@dataclass(frozen=True)
class MeasuredGap:
    """Step 1's result: the learner-sampler gap and which tokens it was measured on.

    Attributes:
        gap: (B, T) float32, ``old_logps - sampler_logps`` (nats); 0 where masked or unmeasured.
        abs_gap: (B, T) float32, ``|gap|``.
        valid: (B, T) bool mask; ``valid_f`` is its float32 copy.
        nonfinite: (B, T) bool, valid tokens whose sampler log-prob is NaN or +-inf; ``None`` when
            there are none.
        measured: (B, T) bool, valid tokens with a finite sampler log-prob.
        n_valid, n_nonfinite: token counts.
    """

    gap: torch.Tensor
    abs_gap: torch.Tensor
    valid: torch.Tensor
    valid_f: torch.Tensor
    nonfinite: torch.Tensor | None
    measured: torch.Tensor
    n_valid: int
    n_nonfinite: int


def measure_gap(old_logps: torch.Tensor, sampler_logps: torch.Tensor, valid: torch.Tensor) -> MeasuredGap:
    """Step 1: ``gap = old_logps - sampler_logps`` on valid tokens with a finite sampler log-prob.

    This is TRL's ``per_token_logps_diff`` and verl's ``log_ratio``. A non-finite sampler log-prob
    leaves the token *unmeasured* (gap 0, flagged in ``nonfinite``); nothing here is ever NaN.

    Args:
        old_logps: (B, T) float32 learner log-probs at rollout time (nats), finite on valid tokens.
        sampler_logps: (B, T) float32 sampler log-probs of the same tokens (nats), any values.
        valid: (B, T) bool mask.
    """
    valid_f = valid.float()
    gap = (old_logps - sampler_logps).mul_(valid_f)
    nonfinite, n_nonfinite = None, 0
    if not bool(torch.isfinite(gap.sum())):  # a finite sum proves every gap finite
        nonfinite = valid & ~torch.isfinite(sampler_logps)
        n_nonfinite = int(torch.count_nonzero(nonfinite))
        if not n_nonfinite:
            nonfinite = None  # the NaN/inf came from masked positions
        torch.nan_to_num_(gap, nan=0.0, posinf=0.0, neginf=0.0)
    measured = valid if nonfinite is None else valid & ~nonfinite
    n_valid = int(torch.count_nonzero(valid))
    return MeasuredGap(gap, gap.abs(), valid, valid_f, nonfinite, measured, n_valid, n_nonfinite)


def check_nonfinite_share(n_nonfinite: int, n_valid: int, max_frac: float) -> None:
    """Step 1: stop when more than ``max_frac`` of the valid tokens have a non-finite sampler log-prob.

    Raises:
        NonFiniteSamplerLogprobsError: ``n_nonfinite > max_frac * n_valid``.
    """
    if n_nonfinite > max_frac * n_valid:
        raise NonFiniteSamplerLogprobsError(
            f"{n_nonfinite} of {n_valid} valid tokens ({n_nonfinite / n_valid:.2%}) have a NaN or +-inf sampler "
            f"log-prob, more than triage_nonfinite_max_frac={max_frac}: the sampler is broken. Check that it "
            "returns the sampled token's own log-prob after temperature (vLLM: logprobs=0, "
            "logprobs_mode='processed_logprobs'), that the served weights are finite after the last sync (NVFP4 "
            "scales included), and that no sampling setting gives the sampled token zero probability. Raise "
            "triage_nonfinite_max_frac only if a few unscorable tokens are expected."
        )


# --------------------------------------------------------------------------- zero-signal groups


@dataclass(frozen=True)
class DiagnosedTokens:
    """The tokens that take part in the diagnosis: measured, in a group with reward spread.

    Attributes:
        advantages: (B, 1) or (B, T) float32, 0 in zero-signal rows (so they join no quadrant and are
            never repaired).
        abs_gap: (B, T) float32, ``|gap|`` on diagnosed tokens, 0 elsewhere.
        mask_f: (B, T) float32 0/1 mask of the diagnosed tokens.
        count: number of diagnosed tokens.
    """

    advantages: torch.Tensor
    abs_gap: torch.Tensor
    mask_f: torch.Tensor
    count: int


def exclude_zero_signal(
    measured: MeasuredGap, advantages: torch.Tensor, zero_signal: torch.Tensor | None
) -> DiagnosedTokens:
    """Drop the completions of zero-signal groups from the diagnosis (``docs/objective.md``, notes).

    A group whose rewards are all equal carries no policy-gradient update, although TRL's normalised
    advantage of it is not exactly 0 in floating point. Its tokens keep weight 1 and stay out of the
    quadrant, tail and segment statistics; they still count in the mismatch metrics.

    Args:
        measured: step 1's result.
        advantages: (B, 1) or (B, T) float32.
        zero_signal: (B,) bool, True for completions of a group with zero reward spread, or ``None``.
    """
    mask_f = measured.valid_f if measured.nonfinite is None else measured.measured.float()
    if zero_signal is None or not bool(zero_signal.any()):
        count = measured.n_valid - measured.n_nonfinite
        return DiagnosedTokens(advantages, measured.abs_gap, mask_f, count)
    signal_rows = (~zero_signal).float()[:, None]
    mask_f = mask_f * signal_rows
    count = int(torch.count_nonzero(mask_f))  # exact at any size, unlike a float32 sum
    return DiagnosedTokens(advantages * signal_rows, measured.abs_gap * signal_rows, mask_f, count)


# --------------------------------------------------------------------------------------- step 2


def direction_quadrants(gap: torch.Tensor, advantages: torch.Tensor, gap_sign: int) -> dict[str, torch.Tensor]:
    """Step 2: amplifying when ``sign(A) == sign(gap_sign * gap)``, contracting when they differ.

    Args:
        gap: (B, T) float32 learner - sampler (nats), 0 on tokens that take no part.
        advantages: (B, 1) or (B, T) float32, 0 on tokens that take no part.
        gap_sign: +1, or -1 to flip the convention (``triage_gap_sign``).

    Returns:
        ``{"NA", "PA", "NC", "PC"}`` -> (B, T) bool; a token with gap 0 or A = 0 is in none.
    """
    gap_pos, gap_neg = gap > 0, gap < 0
    if gap_sign == -1:
        gap_pos, gap_neg = gap_neg, gap_pos
    adv_pos, adv_neg = advantages > 0, advantages < 0
    return {"NA": gap_neg & adv_neg, "PA": gap_pos & adv_pos, "NC": gap_pos & adv_neg, "PC": gap_neg & adv_pos}


# --------------------------------------------------------------------------------------- step 3


def tail_threshold(abs_gap: torch.Tensor, n_diagnosed: int, quantile: float, min_gap: float) -> float:
    """Step 3: ``tau = max(min_gap, k-th smallest |gap| over diagnosed tokens)``, ``k = ceil(q n)``.

    Args:
        abs_gap: (B, T) |gap| (nats) on the ``n_diagnosed`` diagnosed tokens and exactly 0 elsewhere.
            Zeros are the smallest values, so the k-th diagnosed value is the (B*T - n + k)-th overall.
        n_diagnosed: number of diagnosed tokens.
        quantile, min_gap: ``triage_tail_quantile`` and ``triage_tail_min_gap`` (nats).

    Returns:
        tau in nats; ``min_gap`` when nothing is diagnosed.
    """
    if not n_diagnosed:
        return float(min_gap)
    rank = abs_gap.numel() - n_diagnosed + order_statistic_rank(n_diagnosed, quantile)
    return max(float(min_gap), kth_smallest(abs_gap.reshape(-1), rank))


def tail_tokens(abs_gap: torch.Tensor, tau: float, diagnosed_f: torch.Tensor) -> torch.Tensor:
    """Step 3: (B, T) bool, diagnosed tokens with ``|gap| >= tau`` (``abs_gap`` 0 off the diagnosis)."""
    tail = abs_gap >= tau
    return tail & (diagnosed_f > 0) if tau <= 0 else tail


# ----------------------------------------------------------------------------------- steps 4-5


@dataclass(frozen=True)
class SegmentDiagnosis:
    """Steps 4-5 over the B * S (row, segment) bins, S segment ids per row.

    Attributes:
        n_tokens: (B*S,) float32, diagnosed tokens per segment (``n_s``).
        n_amp_tail: (B*S,) float32, amplifying tail tokens per segment (``k_s``).
        hot: (B*S,) bool, hot segments.
        in_hot: (B, T) bool, valid positions of hot segments; ``None`` when no segment is hot.
    """

    n_tokens: torch.Tensor
    n_amp_tail: torch.Tensor
    hot: torch.Tensor
    in_hot: torch.Tensor | None


def diagnose_segments(
    segment_ids: torch.Tensor,
    num_segments: int,
    diagnosed_f: torch.Tensor,
    amp_tail: torch.Tensor,
    valid: torch.Tensor,
    hot_min_tokens: int,
    hot_density: float,
) -> SegmentDiagnosis:
    """Steps 4-5: a segment is hot when ``k_s >= hot_min_tokens`` and ``k_s / n_s >= hot_density``.

    Args:
        segment_ids: (B, T) integer per-row segment index in [0, num_segments) (:func:`triage_trl.segment_ids`).
        num_segments: S, one more than the largest id.
        diagnosed_f: (B, T) float32 0/1 mask of diagnosed tokens (counted in ``n_s``).
        amp_tail: (B, T) bool amplifying tail tokens (counted in ``k_s``).
        valid: (B, T) bool mask (``in_hot`` is restricted to it).
        hot_min_tokens, hot_density: ``triage_hot_min_tokens`` and ``triage_hot_density``; the density
            is compared in float64, so 3/30 is hot at 0.1.
    """
    B, T = valid.shape
    device = valid.device
    n_bins = B * num_segments
    index_dtype = torch.int32 if n_bins < 2**31 else torch.int64  # int32 adds and gathers are cheaper
    rows = torch.arange(B, device=device, dtype=index_dtype)[:, None] * num_segments
    flat_seg = (segment_ids.to(index_dtype) + rows).reshape(-1)
    n_tokens = torch.zeros(n_bins, device=device).index_add_(0, flat_seg, diagnosed_f.reshape(-1))
    amp_tail_bins = flat_seg[amp_tail.reshape(-1)]  # amplifying tail tokens are few: work on them only
    n_amp_tail = torch.zeros(n_bins, device=device).index_add_(
        0, amp_tail_bins, torch.ones(amp_tail_bins.numel(), device=device)
    )
    density = n_amp_tail.double() / n_tokens.clamp(min=1).double()
    hot = (n_amp_tail >= hot_min_tokens) & (density >= hot_density)
    in_hot = hot.index_select(0, flat_seg).view(B, T) & valid if bool(hot.any()) else None
    return SegmentDiagnosis(n_tokens, n_amp_tail, hot, in_hot)


# --------------------------------------------------------------------------------------- step 6


@dataclass(frozen=True)
class Rebalance:
    """Step 6's result: ``beta`` in [floor, 1] on ``tokens`` (``None`` when beta is 1) of quadrant ``heavy``."""

    beta: float
    heavy: str
    tokens: torch.Tensor | None


def selective_rebalance(
    advantages: torch.Tensor,
    quadrants: dict[str, torch.Tensor],
    in_hot: torch.Tensor | None,
    tail: torch.Tensor,
    floor: float,
    scope: str,
) -> Rebalance:
    """Step 6: down-weight the heavier amplifying quadrant inside hot segments.

    ``M_Q = sum |A|`` over quadrant-Q tokens in hot segments (float64); the heavier of NA and PA gets
    ``beta = clamp(M_light / M_heavy, floor, 1)``; ties and an empty heavy mass give 1.

    Args:
        advantages: (B, 1) or (B, T) float32.
        quadrants: step 2's masks; in_hot: steps 4-5's (``None``: nothing hot); tail: step 3's.
        floor, scope: ``triage_rebalance_floor`` and ``triage_rebalance_scope`` (``"tail"`` restricts
            beta to the heavy quadrant's tail tokens).
    """
    if in_hot is None:
        return Rebalance(1.0, "NA", None)
    mass_na = _advantage_mass(advantages, quadrants["NA"] & in_hot)
    mass_pa = _advantage_mass(advantages, quadrants["PA"] & in_hot)
    heavy = "NA" if mass_na >= mass_pa else "PA"
    mass_heavy, mass_light = (mass_na, mass_pa) if heavy == "NA" else (mass_pa, mass_na)
    beta = min(1.0, max(floor, mass_light / mass_heavy)) if mass_heavy > 0 else 1.0
    if beta >= 1.0:
        return Rebalance(1.0, heavy, None)
    tokens = quadrants[heavy] & in_hot
    if scope == "tail":
        tokens &= tail
    return Rebalance(beta, heavy, tokens)


def rebalance_weights(rebalance: Rebalance, like: torch.Tensor) -> torch.Tensor:
    """Step 6: (B, T) float32 weights, ``beta`` on the rebalanced tokens and 1 elsewhere."""
    if rebalance.tokens is None:
        return torch.ones_like(like)
    return 1.0 - (1.0 - rebalance.beta) * rebalance.tokens


def _advantage_mass(advantages: torch.Tensor, selected: torch.Tensor) -> float:
    """sum |A| over the selected tokens, accumulated in float64."""
    if advantages.shape[1] == 1:
        per_row = selected.view(torch.uint8).sum(dim=1, dtype=torch.int32).double()
        return float((per_row * advantages[:, 0].double().abs()).sum())
    return float((advantages.abs() * selected).sum(dtype=torch.float64))


# --------------------------------------------------------------------------------------- step 7


def severe_tokens(abs_gap: torch.Tensor, advantages: torch.Tensor, severe_gap: float) -> torch.Tensor | None:
    """Step 7: (B, T) bool, diagnosed tokens with ``|gap| >= severe_gap`` and a non-zero advantage.

    Args:
        abs_gap: (B, T) |gap| (nats), 0 off the diagnosis (``severe_gap > 0`` then excludes those tokens).
        advantages: (B, 1) or (B, T), 0 in zero-signal rows.
        severe_gap: ``triage_severe_gap`` (nats), > 0.

    Returns:
        The mask, or ``None`` when no token is severe.
    """
    severe = (abs_gap >= severe_gap) & (advantages != 0)
    return severe if bool(severe.any()) else None


def repair_factor(
    gap: torch.Tensor, abs_gap: torch.Tensor, severe: torch.Tensor, severe_gap: float, clip: float
) -> torch.Tensor:
    """Step 7, ``excess_is``: ``clamp(exp(sign(gap) * (|gap| - severe_gap)), 1/C, C)`` on severe tokens, 1 elsewhere.

    The factor is an importance weight of learner over sampler, continuous in gap (1 at the threshold).

    Args:
        gap, abs_gap: (B, T) learner - sampler and its magnitude (nats).
        severe: (B, T) bool from :func:`severe_tokens`.
        severe_gap, clip: ``triage_severe_gap`` (nats) and ``triage_repair_clip`` (C >= 1).
    """
    # relu(|gap| - severe_gap) is 0 below the threshold, so the factor there is exactly exp(0) = 1
    excess = (abs_gap - severe_gap).clamp_(min=0.0).mul_(torch.sign(gap)).mul_(severe)
    return excess.exp_().clamp_(1.0 / clip, clip)


def bounded_repair(
    weights: torch.Tensor,
    gap: torch.Tensor,
    abs_gap: torch.Tensor,
    severe: torch.Tensor | None,
    mode: str,
    severe_gap: float,
    clip: float,
) -> torch.Tensor:
    """Step 7: multiply ``weights`` by the repair of ``mode`` (``triage_repair_mode``) on severe tokens.

    ``excess_is``: :func:`repair_factor`; ``mask``: 0 (MIS-style ablation); ``none``: unchanged.
    """
    if severe is None or mode == "none":
        return weights
    if mode == "mask":
        return weights * ~severe
    return weights * repair_factor(gap, abs_gap, severe, severe_gap, clip)


def drop_unmeasured(weights: torch.Tensor, nonfinite: torch.Tensor | None) -> torch.Tensor:
    """Step 1: weight 0 for tokens whose sampler log-prob is non-finite (no update from an unmeasured token)."""
    return weights if nonfinite is None else weights.masked_fill(nonfinite, 0.0)
