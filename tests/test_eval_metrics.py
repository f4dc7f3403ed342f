"""Unbiased pass@k (Chen et al. 2021) against hand-computed values; avg@n / greedy summaries."""

import math

import pytest

from triage_trl.eval import default_ks, pass_at_k, summarize


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
        (4, 1, 1, 1 / 4),
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
        (10, 0, 5, 0.0),
        (10, 6, 5, 1.0),  # n - c < k: every draw of 5 holds a correct one
        (16, 4, 8, 1 - 495 / 12870),  # 1 - C(12,8)/C(16,8)
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomial_formula_for_large_n():
    n, c, k = 200, 7, 50
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def test_summarize_sampled_and_greedy():
    out = summarize([[True, False, False, True], [False] * 4, [True] * 4], greedy=False)
    assert out == pytest.approx({"avg@4": 0.5, "pass@1": 0.5, "pass@2": (5 / 6 + 0 + 1) / 3, "pass@4": 2 / 3})
    assert summarize([[True], [False], [False], [True]], greedy=True) == {"pass@1": 0.5}
    assert summarize([], greedy=True) == {}
    assert default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6] and default_ks(1) == [1]
    with pytest.raises(ValueError, match="same number of samples"):
        summarize([[True], [True, False]], greedy=False)
    with pytest.raises(ValueError, match="one sample per problem"):
        summarize([[True, False]], greedy=True)
