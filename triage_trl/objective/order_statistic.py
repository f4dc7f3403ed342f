"""Exact order statistics of |gap| for the tail threshold (step 3 of ``docs/objective.md``).

``torch.quantile`` refuses more than 2^24 elements and interpolates; the tail threshold needs neither.
"""

from __future__ import annotations

import math

import torch


def order_statistic_rank(n: int, q: float) -> int:
    """1-based rank ``k = ceil(q * n)``, clamped to [1, n], of the ``q`` quantile of ``n`` values.

    This is numpy's ``inverted_cdf`` quantile: the k-th smallest value, no interpolation.
    """
    return min(n, max(1, math.ceil(q * n)))


def kth_smallest(values: torch.Tensor, k: int) -> float:
    """Exact k-th smallest (1-based, ``1 <= k <= values.numel()``) of a 1-D tensor, any size.

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
