"""Null models for the paper's two observations (``docs/stability.md``, "Null models").

1. *NA dominates the amplifying tail.* Tokens are drawn from the sampler, so the gap (learner - sampler) on sampled
   tokens is negative on average for any sampler noise (its mean is minus a KL): negative gaps, and so NA, are
   favoured whatever the advantages. :func:`na_share_null` compares the observed NA share of the amplifying tail with
   its distribution when the advantages are permuted among the completions of each group (which keeps the gaps, the
   tail and each group's advantages, and breaks any link between a completion's advantage and its gaps).
2. *The amplifying tail concentrates in few segments.* With heavy-tailed per-completion mismatch some concentration
   is expected by chance. :func:`tail_concentration_null` compares the observed share of tail tokens in the top
   ``ceil(10%)`` segments with its distribution when the tail labels are permuted across the tokens of segments of
   equal length (which keeps the number of tail tokens per length class, and makes every token of a class equally
   likely to be one).

Each returns the observed value, the null's mean and 95% range, and the one-sided permutation p-value
``(1 + #{null >= observed}) / (1 + n_perm)``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..objective.steps import direction_quadrants, measure_gap, tail_threshold, tail_tokens


def na_share(gap: torch.Tensor, advantages: torch.Tensor, tail: torch.Tensor) -> float:
    """NA tail tokens / amplifying tail tokens (NA + PA); NaN when the tail holds no amplifying token.

    Args:
        gap: (B, T) learner - sampler (nats), 0 off the measured tokens; advantages: (B, 1) or (B, T);
        tail: (B, T) bool tail tokens.
    """
    quadrants = direction_quadrants(gap, advantages, 1)
    n_na = int(torch.count_nonzero(quadrants["NA"] & tail))
    n_pa = int(torch.count_nonzero(quadrants["PA"] & tail))
    return n_na / (n_na + n_pa) if n_na + n_pa else math.nan


def _gap_and_tail(learner, sampler, mask, tail_quantile: float, tail_min_gap: float):
    """TRIAGE's measured gap and tail (``docs/objective.md``, steps 1 and 3) of a batch."""
    valid = mask.bool() if mask.dtype != torch.bool else mask
    gap = measure_gap(learner.detach().float(), sampler.detach().float(), valid)
    measured_f = gap.measured.float()
    n = int(torch.count_nonzero(gap.measured))
    tau = tail_threshold(gap.abs_gap * measured_f, n, tail_quantile, tail_min_gap)
    return gap, tail_tokens(gap.abs_gap * measured_f, tau, measured_f)


def na_share_null(learner: torch.Tensor, sampler: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  group_size: int, *, tail_quantile: float = 0.98, tail_min_gap: float = 0.05, n_perm: int = 1000,
                  seed: int = 0, keep_draws: bool = False) -> dict:
    """Observed NA share of the amplifying tail against advantages permuted within groups.

    The tail is TRIAGE's (``docs/objective.md``, step 3: ``|gap| >= max(min_gap, q-quantile)``) over the valid tokens
    with a finite sampler log-prob; it does not depend on the advantages, so only the quadrants move under the null.

    Args:
        learner, sampler: (B, T) log-probs (nats); advantages: (B,) one per completion; mask: (B, T).
        group_size: completions per group (B a multiple of it; groups are consecutive rows, as in TRL's batches).
        tail_quantile, tail_min_gap: TRIAGE's ``triage_tail_quantile`` and ``triage_tail_min_gap``.
        n_perm: permutations; seed: their seed. keep_draws: also return the null's draws (``"draws"``, for
            :func:`pooled_null`).

    Returns:
        ``{"observed", "null_mean", "null_low", "null_high", "p_value", "n_tail"}`` (NaN p-value when the observed
        share is NaN).

    Raises:
        ValueError: ``advantages`` is not (B,), or B is not a multiple of ``group_size``.
    """
    B = learner.shape[0]
    if advantages.shape != (B,) or group_size < 1 or B % group_size:
        raise ValueError(f"advantages must be (B,) = ({B},) and B a multiple of group_size={group_size}; got "
                         f"{tuple(advantages.shape)}: pass one advantage per completion, in whole groups.")
    gap, tail = _gap_and_tail(learner, sampler, mask, tail_quantile, tail_min_gap)
    adv = advantages.detach().float()
    observed = na_share(gap.gap, adv[:, None], tail)
    generator = torch.Generator().manual_seed(seed)
    null = []
    for _ in range(n_perm):
        permuted = permute_within_groups(adv, group_size, generator)
        null.append(na_share(gap.gap, permuted[:, None], tail))
    kept = [v for v in null if not math.isnan(v)]
    return {**_compare(observed, kept), "n_tail": int(torch.count_nonzero(tail)),
            **({"draws": null} if keep_draws else {})}


def permute_within_groups(advantages: torch.Tensor, group_size: int, generator: torch.Generator) -> torch.Tensor:
    """The advantages permuted among the completions of each group (groups are consecutive rows, as in TRL's
    batches), drawn from ``generator`` (the NA-share null draws many from one; E1's null arm seeds one per batch).

    Args:
        advantages: (B,) or (B, 1) one advantage per completion; B a multiple of ``group_size``.

    Returns:
        A tensor of the same shape and dtype: each group holds the same values in another order.

    Raises:
        ValueError: B is not a multiple of ``group_size``.
    """
    flat = advantages.reshape(-1)
    if group_size < 1 or flat.numel() % group_size:
        raise ValueError(f"{flat.numel()} advantages do not split into groups of {group_size}: pass whole groups.")
    groups = flat.view(-1, group_size)
    order = torch.argsort(torch.rand(groups.shape, generator=generator), dim=1)
    return torch.gather(groups, 1, order).reshape(advantages.shape)


def segment_tail_counts(learner: torch.Tensor, sampler: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        segments: torch.Tensor, *, tail_quantile: float = 0.98,
                        tail_min_gap: float = 0.05) -> tuple[list[int], list[int]]:
    """Per segment, its diagnosed tokens and its amplifying tail tokens, the inputs of
    :func:`tail_concentration_null` (as ``triage/tail_concentration`` counts them: diagnosed = valid, measured tokens
    of completions with a non-zero advantage; tail = TRIAGE's, ``docs/objective.md`` step 3; amplifying = NA or PA).

    Args:
        learner, sampler: (B, T) log-probs (nats); advantages: (B,); mask: (B, T);
        segments: (B, T) segment index per position (``triage_trl.objective.segments.segment_ids``).

    Returns:
        ``(lengths, counts)``: one entry per segment holding at least one diagnosed token.
    """
    gap, tail = _gap_and_tail(learner, sampler, mask, tail_quantile, tail_min_gap)
    adv = advantages.detach().float()[:, None].expand_as(gap.gap)
    quadrants = direction_quadrants(gap.gap, adv, 1)
    diagnosed = gap.measured & (adv != 0)
    amp_tail = tail & (quadrants["NA"] | quadrants["PA"]) & diagnosed
    key = torch.arange(segments.shape[0])[:, None] * (segments.shape[1] + 1) + segments.long()
    lengths, counts = defaultdict(int), defaultdict(int)
    for k, d, a in zip(key[diagnosed].tolist(), [1] * int(diagnosed.sum()), amp_tail[diagnosed].tolist()):
        lengths[k] += d
        counts[k] += int(a)
    order = sorted(lengths)
    return [lengths[k] for k in order], [counts[k] for k in order]


def top_decile_share(tail_counts: list[int]) -> float:
    """Share of tail tokens in the ``ceil(10%)`` of segments holding the most (0 when there is none), as the
    trainer's ``triage/tail_concentration``; ``tail_counts`` has one entry per segment with a diagnosed token."""
    total = sum(tail_counts)
    if total == 0:
        return 0.0
    top = (len(tail_counts) + 9) // 10
    return sum(sorted(tail_counts, reverse=True)[:top]) / total


def tail_concentration_null(segment_lengths: list[int], tail_counts: list[int], *, n_perm: int = 1000,
                            seed: int = 0, keep_draws: bool = False) -> dict:
    """Observed tail concentration against tail labels permuted across segments of equal length.

    Within each length class (segments with the same number of diagnosed tokens) the class's tail tokens are dealt
    to random token positions of its segments (a multivariate hypergeometric draw of the per-segment counts).

    Args:
        segment_lengths: diagnosed tokens per segment (>= 1 each); tail_counts: tail tokens per segment (<= its
            length). One entry per segment, same order.
        n_perm: permutations; seed: their seed. keep_draws: also return the null's draws (``"draws"``, for
            :func:`pooled_null`).

    Returns:
        ``{"observed", "null_mean", "null_low", "null_high", "p_value", "n_segments"}``; all NaN when no segment holds
        a tail token.

    Raises:
        ValueError: lists of different lengths, a length < 1, or a count outside [0, length].
    """
    if len(segment_lengths) != len(tail_counts):
        raise ValueError("segment_lengths and tail_counts need one entry per segment each.")
    for length, count in zip(segment_lengths, tail_counts):
        if length < 1 or not 0 <= count <= length:
            raise ValueError(f"A segment of {length} tokens cannot hold {count} tail tokens: lengths must be >= 1 "
                             "and counts in [0, length].")
    if sum(tail_counts) == 0:  # no tail token: nothing to test (NaN, which pooled_null leaves out)
        return {**_compare(math.nan, []), "n_segments": len(segment_lengths), **({"draws": []} if keep_draws else {})}
    classes = defaultdict(list)
    for i, length in enumerate(segment_lengths):
        classes[length].append(i)
    generator = torch.Generator().manual_seed(seed)
    null = []
    for _ in range(n_perm):
        counts = [0] * len(segment_lengths)
        for length, members in classes.items():
            k = sum(tail_counts[i] for i in members)
            if k == 0:
                continue
            picks = torch.randperm(length * len(members), generator=generator)[:k] // length
            for j in picks.tolist():
                counts[members[j]] += 1
        null.append(top_decile_share(counts))
    return {**_compare(top_decile_share(list(tail_counts)), null), "n_segments": len(segment_lengths),
            **({"draws": null} if keep_draws else {})}


def pooled_null(results: list[dict]) -> dict:
    """One test over several batches: the mean of the batches' observed values against the mean of their null
    draws taken draw by draw (independent permutations per batch), so the p-value answers "is the observation above
    its null on average over the batches". Batches whose observed value is NaN (no amplifying tail) are left out,
    and so is a draw in which any kept batch's null value is NaN.

    Args:
        results: outputs of :func:`na_share_null` or :func:`tail_concentration_null` with ``keep_draws=True``.

    Returns:
        ``{"observed", "null_mean", "null_low", "null_high", "p_value", "batches"}``.

    Raises:
        ValueError: a result without draws, or results with different numbers of draws.
    """
    kept = [r for r in results if not math.isnan(r["observed"])]
    if any("draws" not in r for r in kept):
        raise ValueError("pooled_null needs each batch's draws: call the null with keep_draws=True.")
    if len({len(r["draws"]) for r in kept}) > 1:
        raise ValueError("pooled_null needs the same number of draws for every batch (one n_perm).")
    if not kept:
        return {**_compare(math.nan, []), "batches": 0}
    observed = sum(r["observed"] for r in kept) / len(kept)
    null = []
    for draws in zip(*(r["draws"] for r in kept)):
        if not any(math.isnan(v) for v in draws):
            null.append(sum(draws) / len(draws))
    return {**_compare(observed, null), "batches": len(kept)}


def _compare(observed: float, null: list[float]) -> dict:
    if not null:
        return {"observed": observed, "null_mean": math.nan, "null_low": math.nan, "null_high": math.nan,
                "p_value": math.nan}
    ordered = sorted(null)
    low = ordered[int(0.025 * (len(ordered) - 1))]
    high = ordered[int(math.ceil(0.975 * (len(ordered) - 1)))]
    p = math.nan if math.isnan(observed) else (1 + sum(v >= observed for v in null)) / (1 + len(null))
    return {"observed": observed, "null_mean": sum(null) / len(null), "null_low": low, "null_high": high,
            "p_value": p}
