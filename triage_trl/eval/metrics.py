"""pass@k (unbiased), avg@n and per-benchmark summaries.

Source: Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (Codex), eq. 1: with
``n`` samples of which ``c`` are correct, ``pass@k = 1 - C(n - c, k) / C(n, k)``, computed as the
product ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` to stay finite for large ``n``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["default_ks", "pass_at_k", "summarize"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the probability that at least one of ``k`` samples is correct.

    Args:
        n: samples drawn for the problem (``n >= 1``).
        c: correct ones among them (``0 <= c <= n``).
        k: budget (``1 <= k <= n``).

    Returns:
        ``1 - C(n-c, k) / C(n, k)`` as a float in [0, 1]; ``pass_at_k(n, c, 1) == c / n``.

    Raises:
        ValueError: counts out of range.
    """
    if not (n >= 1 and 0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def default_ks(n: int) -> list[int]:
    """The k reported for ``n`` samples: powers of two below ``n``, and ``n`` itself."""
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k < n]
    return ks + [n]


def summarize(correct: Sequence[Sequence[bool]], *, greedy: bool, ks: Sequence[int] | None = None) -> dict[str, float]:
    """Benchmark metrics from each problem's list of per-sample correctness.

    Args:
        correct: one list per problem, ``n`` booleans each (the same ``n`` for every problem).
        greedy: the samples were greedy (then ``n`` must be 1 and the metric is ``pass@1``).
        ks: budgets for pass@k (default :func:`default_ks`).

    Returns:
        Greedy: ``{"pass@1": mean correct}``. Sampled with ``n`` samples: ``{"avg@n": mean over problems
        of c/n, "pass@k": mean unbiased pass@k for each k}`` (``pass@1`` equals ``avg@n``). Fractions in
        [0, 1]; empty input gives ``{}``.

    Raises:
        ValueError: problems with different sample counts, greedy with ``n > 1``, or ``k > n``.
    """
    if not correct:
        return {}
    counts = {len(c) for c in correct}
    if len(counts) != 1:
        raise ValueError(f"every problem needs the same number of samples; got {sorted(counts)}")
    n = counts.pop()
    hits = [sum(bool(x) for x in c) for c in correct]
    if greedy:
        if n != 1:
            raise ValueError(f"greedy decoding gives one sample per problem, got n={n}")
        return {"pass@1": float(np.mean(hits))}
    out = {f"avg@{n}": float(np.mean([h / n for h in hits]))}
    for k in ks or default_ks(n):
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, h, k) for h in hits]))
    return out
