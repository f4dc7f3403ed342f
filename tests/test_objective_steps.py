"""Each step function of the TRIAGE objective on hand-computed values (docs/objective.md, steps 1-7)."""

import math

import pytest
import torch

from triage_trl.objective import NonFiniteSamplerLogprobsError
from triage_trl.objective import steps

T_, F_ = True, False


def test_measure_gap_leaves_nonfinite_sampler_tokens_unmeasured():
    old = torch.tensor([[-1.0, -1.0, -1.0, -2.0]])
    sampler = torch.tensor([[-0.5, math.nan, -math.inf, -1.0]])
    valid = torch.tensor([[T_, T_, F_, T_]])
    g = steps.measure_gap(old, sampler, valid)
    assert g.gap.tolist() == [[-0.5, 0.0, 0.0, -1.0]] and g.abs_gap.tolist() == [[0.5, 0.0, 0.0, 1.0]]
    assert g.nonfinite.tolist() == [[F_, T_, F_, F_]]  # the -inf sits on a masked position
    assert g.measured.tolist() == [[T_, F_, F_, T_]]
    assert (g.n_valid, g.n_nonfinite) == (3, 1)
    finite = steps.measure_gap(old, old - 0.25, valid)
    assert finite.nonfinite is None and finite.gap.tolist() == [[0.25, 0.25, 0.0, 0.25]]


@pytest.mark.parametrize(
    "n_nonfinite,n_valid,max_frac,raises",
    [(1, 100, 0.01, False), (2, 100, 0.01, True), (0, 0, 0.0, False), (1, 5, 0.0, True), (5, 5, 1.0, False)],
)
def test_check_nonfinite_share(n_nonfinite, n_valid, max_frac, raises):
    if raises:
        with pytest.raises(NonFiniteSamplerLogprobsError, match="triage_nonfinite_max_frac"):
            steps.check_nonfinite_share(n_nonfinite, n_valid, max_frac)
    else:
        steps.check_nonfinite_share(n_nonfinite, n_valid, max_frac)


def test_exclude_zero_signal_zeroes_advantages_and_gaps_of_those_rows():
    old = torch.zeros(2, 3)
    sampler = torch.tensor([[0.5, -0.5, math.nan], [0.25, 0.0, 1.0]])
    valid = torch.ones(2, 3, dtype=torch.bool)
    g = steps.measure_gap(old, sampler, valid)
    adv = torch.tensor([[3e-4], [-1.0]])
    d = steps.exclude_zero_signal(g, adv, torch.tensor([True, False]))
    assert d.advantages.tolist() == [[0.0], [-1.0]]
    assert d.abs_gap.tolist() == [[0.0, 0.0, 0.0], [0.25, 0.0, 1.0]]
    assert d.mask_f.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]] and d.count == 3
    # no zero-signal row: the measured tokens
    d = steps.exclude_zero_signal(g, adv, torch.tensor([False, False]))
    assert d.advantages is adv and d.count == 5 and d.mask_f.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def test_direction_quadrants():
    gap = torch.tensor([[-1.0, 1.0, 0.0], [-1.0, 1.0, 0.5]])
    adv = torch.tensor([[-2.0], [3.0]])
    q = steps.direction_quadrants(gap, adv, 1)
    assert q["NA"].tolist() == [[T_, F_, F_], [F_] * 3] and q["NC"].tolist() == [[F_, T_, F_], [F_] * 3]
    assert q["PA"].tolist() == [[F_] * 3, [F_, T_, T_]] and q["PC"].tolist() == [[F_] * 3, [T_, F_, F_]]
    flipped = steps.direction_quadrants(gap, adv, -1)
    assert flipped["NA"].tolist() == q["NC"].tolist() and flipped["PA"].tolist() == q["PC"].tolist()
    assert not any(m.any() for m in steps.direction_quadrants(gap, torch.zeros(2, 1), 1).values())


def test_tail_threshold_is_the_inverted_cdf_quantile_over_diagnosed_tokens():
    abs_gap = torch.tensor([[0.4, 0.1, 0.0], [0.3, 0.2, 0.0]])  # two zeros off the diagnosis
    assert steps.tail_threshold(abs_gap, 4, 0.5, 0.0) == pytest.approx(0.2)  # k = ceil(0.5 * 4) = 2
    assert steps.tail_threshold(abs_gap, 4, 0.8, 0.0) == pytest.approx(0.4)  # k = ceil(3.2) = 4
    assert steps.tail_threshold(abs_gap, 4, 0.5, 0.25) == 0.25  # the floor wins
    assert steps.tail_threshold(abs_gap, 0, 0.5, 0.05) == 0.05  # nothing diagnosed
    tail = steps.tail_tokens(abs_gap, 0.2, (abs_gap > 0).float())
    assert tail.tolist() == [[T_, F_, F_], [T_, T_, F_]]
    # tau 0: every diagnosed token is a tail token, the rest never
    assert steps.tail_tokens(abs_gap, 0.0, torch.tensor([[1.0, 0, 1], [0, 0, 0]])).tolist() == [
        [T_, F_, T_], [F_, F_, F_]
    ]


def test_diagnose_segments_counts_and_hot_rule():
    seg = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
    diagnosed = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    amp_tail = torch.tensor([[T_, T_, F_, T_, F_], [F_, F_, T_, T_, F_]])
    valid = torch.tensor([[T_] * 5, [T_, T_, T_, T_, F_]])
    d = steps.diagnose_segments(seg, 2, diagnosed, amp_tail, valid, hot_min_tokens=2, hot_density=0.6)
    # bins (row, segment): n = 3, 2, 2, 2 diagnosed tokens; k = 2, 1, 0, 2 amplifying tail tokens
    assert d.n_tokens.tolist() == [3.0, 2.0, 2.0, 2.0] and d.n_amp_tail.tolist() == [2.0, 1.0, 0.0, 2.0]
    # hot: k >= 2 and k / n >= 0.6 -> 2/3 yes, 1/2 no (k < 2), 0 no, 2/2 yes
    assert d.hot.tolist() == [T_, F_, F_, T_]
    assert d.in_hot.tolist() == [[T_, T_, T_, F_, F_], [F_, F_, T_, T_, F_]]  # the masked position is not in it
    cold = steps.diagnose_segments(seg, 2, diagnosed, amp_tail, valid, hot_min_tokens=3, hot_density=0.0)
    assert not cold.hot.any() and cold.in_hot is None


def test_selective_rebalance_beta_is_the_mass_ratio():
    adv = torch.tensor([[-3.0], [1.0]])
    na = torch.tensor([[T_, F_], [F_, F_]])
    pa = torch.tensor([[F_, F_], [T_, F_]])
    quadrants = {"NA": na, "PA": pa, "NC": torch.zeros_like(na), "PC": torch.zeros_like(na)}
    in_hot = torch.ones(2, 2, dtype=torch.bool)
    tail = torch.zeros(2, 2, dtype=torch.bool)
    r = steps.selective_rebalance(adv, quadrants, in_hot, tail, floor=0.25, scope="segment")
    assert (r.beta, r.heavy) == (pytest.approx(1 / 3), "NA") and r.tokens.tolist() == na.tolist()
    assert steps.rebalance_weights(r, adv.expand(2, 2)).tolist() == [[pytest.approx(1 / 3), 1.0], [1.0, 1.0]]
    assert steps.selective_rebalance(adv, quadrants, in_hot, tail, floor=0.5, scope="segment").beta == 0.5
    assert not steps.selective_rebalance(adv, quadrants, in_hot, tail, floor=0.25, scope="tail").tokens.any()
    mirrored = {**quadrants, "NA": pa, "PA": na}
    r = steps.selective_rebalance(torch.tensor([[3.0], [-1.0]]), mirrored, in_hot, tail, 0.25, "segment")
    assert (r.beta, r.heavy) == (pytest.approx(1 / 3), "PA") and r.tokens.tolist() == na.tolist()
    equal = steps.selective_rebalance(torch.tensor([[-1.0], [1.0]]), quadrants, in_hot, tail, 0.25, "segment")
    assert equal.beta == 1.0 and equal.tokens is None  # a tie rebalances nothing
    assert steps.selective_rebalance(adv, quadrants, None, tail, 0.25, "segment").tokens is None


def test_bounded_repair_factors():
    gap = torch.tensor([[1.0, -1.0, 0.5, 3.0, -3.0, 1.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    severe = steps.severe_tokens(gap.abs(), adv, math.log(2))
    assert severe.tolist() == [[T_, T_, F_, T_, T_, F_]]  # |gap| < log 2, or A = 0: not repaired
    factor = steps.repair_factor(gap, gap.abs(), severe, math.log(2), 2.0)
    e = math.e
    torch.testing.assert_close(factor, torch.tensor([[e / 2, 2 / e, 1.0, 2.0, 0.5, 1.0]]))
    w = torch.full((1, 6), 0.5)
    assert steps.bounded_repair(w, gap, gap.abs(), severe, "mask", math.log(2), 2.0).tolist() == [
        [0.0, 0.0, 0.5, 0.0, 0.0, 0.5]
    ]
    assert steps.bounded_repair(w, gap, gap.abs(), severe, "none", math.log(2), 2.0) is w
    assert steps.severe_tokens(gap.abs(), torch.zeros(1, 1), math.log(2)) is None


def test_drop_unmeasured():
    w = torch.tensor([[2.0, 0.5, 1.0]])
    assert steps.drop_unmeasured(w, torch.tensor([[T_, F_, F_]])).tolist() == [[0.0, 0.5, 1.0]]
    assert steps.drop_unmeasured(w, None) is w
