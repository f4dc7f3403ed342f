"""The lab's null models (docs/stability.md, "Null models") and the pre-registered cost / gain / stability rules."""

import math
import os

import pytest
import torch

from triage_trl.lab.metrics import (COLLAPSE_K3_FACTOR, collapse_by_rule, k3_log_slope, paired_bootstrap, step0_cost,
                                    training_gain)
from triage_trl.lab.null_models import (na_share, na_share_null, pooled_null, tail_concentration_null,
                                        top_decile_share)


def _sampled_batch(B=32, T=24, seed=0, noise=0.5):
    """Completions drawn from a noisy sampler: on sampled tokens the gap tends negative whatever the advantages."""
    g = torch.Generator().manual_seed(seed)
    learner_logits = torch.randn(B, T, 16, generator=g)
    sampler_logits = learner_logits + noise * torch.randn(B, T, 16, generator=g)
    tokens = torch.distributions.Categorical(logits=sampler_logits).sample()
    learner = torch.log_softmax(learner_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    sampler = torch.log_softmax(sampler_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return learner, sampler


def test_na_share_hand_computed():
    gap = torch.tensor([[-1.0, 1.0, -1.0], [1.0, -1.0, 0.5]])
    adv = torch.tensor([[-1.0], [1.0]])
    tail = torch.tensor([[True, True, True], [True, True, False]])
    # NA: row 0 negative gaps (2); PA: row 1 positive gaps in the tail (1)
    assert na_share(gap, adv, tail) == pytest.approx(2 / 3)
    assert math.isnan(na_share(gap, adv, torch.zeros_like(tail)))


def test_na_excess_from_sampling_alone_is_not_significant():
    torch.manual_seed(0)
    learner, sampler = _sampled_batch()
    assert float((learner - sampler).mean()) < 0  # the gap on sampled tokens is minus a KL on average
    adv = torch.randn(32)  # advantages unrelated to the gaps
    result = na_share_null(learner, sampler, adv, torch.ones(32, 24), group_size=8, tail_quantile=0.9, n_perm=200)
    assert result["n_tail"] > 0 and 0 <= result["null_low"] <= result["null_mean"] <= result["null_high"] <= 1
    assert result["p_value"] > 0.05


def test_na_share_linked_to_advantages_is_significant():
    g = torch.Generator().manual_seed(1)
    learner = -torch.rand(32, 24, generator=g) * 3
    # per group of 8: two A < 0 completions with gap -1.5 (NA), two A < 0 with gap +1.5 (NC), four A > 0 with
    # small gaps. The tail holds both signs and only the advantages make it NA: permuted, the +1.5 rows become PA.
    adv = torch.tensor([-1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0] * 4)
    shift = torch.tensor([1.5, 1.5, -1.5, -1.5, 0.0, 0.0, 0.0, 0.0] * 4)[:, None]
    sampler = learner + 0.1 * torch.randn(32, 24, generator=g) + shift
    result = na_share_null(learner, sampler, adv, torch.ones(32, 24), group_size=8, tail_quantile=0.9, n_perm=200)
    assert result["observed"] == 1.0 and result["null_mean"] < 0.8 and result["p_value"] < 0.05
    # reproducible
    again = na_share_null(learner, sampler, adv, torch.ones(32, 24), group_size=8, tail_quantile=0.9, n_perm=200)
    assert again == result
    with pytest.raises(ValueError, match="multiple of group_size"):
        na_share_null(learner, sampler, adv, torch.ones(32, 24), group_size=5)


def test_tail_concentration_null():
    assert top_decile_share([5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]) == pytest.approx(6 / 7)  # ceil(12/10) = 2 segments
    assert top_decile_share([0, 0]) == 0.0
    lengths = [10] * 40
    spread = [1] * 40  # one tail token per segment: no concentration
    packed = [10, 10, 10, 10] + [0] * 36  # all in 4 segments = the top decile
    low = tail_concentration_null(lengths, spread, n_perm=200)
    high = tail_concentration_null(lengths, packed, n_perm=200)
    assert low["observed"] == pytest.approx(0.1) and low["p_value"] == 1.0
    assert high["observed"] == 1.0 and high["p_value"] < 0.01 and high["null_high"] < 1.0
    # the permutation keeps each length class's tail count: one long segment holding all tails stays at 1
    only = tail_concentration_null([50, 5, 5], [7, 0, 0], n_perm=50)
    assert only["observed"] == 1.0 and only["null_mean"] == 1.0
    with pytest.raises(ValueError, match="cannot hold"):
        tail_concentration_null([3], [4])


def test_pooled_null_over_batches():
    lengths = [10] * 40
    spread = tail_concentration_null(lengths, [1] * 40, n_perm=200, keep_draws=True)
    packed = tail_concentration_null(lengths, [10, 10, 10, 10] + [0] * 36, n_perm=200, seed=1, keep_draws=True)
    assert len(spread["draws"]) == 200 and "draws" not in tail_concentration_null(lengths, [1] * 40, n_perm=10)
    # one batch: the pooled test is the batch's own
    alone = pooled_null([packed])
    assert alone["observed"] == packed["observed"] and alone["p_value"] == packed["p_value"] and alone["batches"] == 1
    # a concentrated batch and an even one: the mean (0.55) against the mean of their draws
    both = pooled_null([spread, packed])
    assert both["observed"] == pytest.approx(0.55) and both["batches"] == 2
    assert both["null_mean"] == pytest.approx((spread["null_mean"] + packed["null_mean"]) / 2)
    assert both["p_value"] < 0.01  # one concentrated batch in two already lifts the mean above the pooled null
    # NA shares: batches without an amplifying tail (NaN) are left out
    torch.manual_seed(0)
    learner, sampler = _sampled_batch()
    na = na_share_null(learner, sampler, torch.randn(32), torch.ones(32, 24), group_size=8, tail_quantile=0.9,
                       n_perm=100, keep_draws=True)
    empty = {**na, "observed": math.nan}
    assert pooled_null([na, empty])["observed"] == na["observed"] and pooled_null([empty])["batches"] == 0
    with pytest.raises(ValueError, match="keep_draws=True"):
        pooled_null([{k: v for k, v in na.items() if k != "draws"}])


def test_segment_tail_counts_hand_computed():
    from triage_trl.lab.null_models import segment_tail_counts

    learner = torch.zeros(2, 4)
    # gaps (learner - sampler): row 0: -2, 0.01, 0.01, -0.01 ; row 1: 2, 0.01, -0.01, 0.01
    sampler = torch.tensor([[2.0, -0.01, -0.01, 0.01], [-2.0, -0.01, 0.01, -0.01]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    segments = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    # tail = |gap| >= max(0.05, q98): the two |gap| = 2 tokens; row 0 has A < 0 (NA), row 1 A > 0 (PA)
    lengths, counts = segment_tail_counts(learner, sampler, torch.tensor([-1.0, 1.0]), mask, segments)
    assert lengths == [2, 2, 1, 2] and counts == [1, 0, 1, 0]
    # a zero-advantage completion is diagnosed nowhere
    lengths, counts = segment_tail_counts(learner, sampler, torch.tensor([0.0, 1.0]), mask, segments)
    assert lengths == [1, 2] and counts == [1, 0]


def test_cost_gain_and_paired_bootstrap():
    assert step0_cost(0.422, 0.703) == pytest.approx(0.281)
    gain = training_gain([[0, 1, 0, 1], [1, 1, 0, 0]], [[1, 1, 0, 1], [1, 1, 1, 0]])
    assert gain["mean"] == pytest.approx(2 / 8) and gain["n"] == 8 and gain["low"] <= 0.25 <= gain["high"]
    with pytest.raises(ValueError, match="same seeds and items"):
        training_gain([[0, 1]], [[1]])
    result = paired_bootstrap([1.0, 2.0, 3.0, 4.0, math.nan])
    assert result["n"] == 4 and result["mean"] == 2.5 and 1.0 <= result["low"] < 2.5 < result["high"] <= 4.0


def test_k3_log_slope():
    steps = list(range(1, 11))
    assert k3_log_slope(steps, [0.1 * math.exp(0.05 * s) for s in steps]) == pytest.approx(0.05)
    assert k3_log_slope([1, 2, 3], [0.2, 0.0, math.nan]) != k3_log_slope([1, 2, 3], [0.2, 0.1, 0.1])
    assert math.isnan(k3_log_slope([1], [0.1]))


def test_pre_registered_collapse_rule():
    flat = [0.5] * 30
    k3 = [0.1] * 30
    grads = [1.0] * 30
    assert collapse_by_rule(flat, k3, grads) == {"collapsed": False, "reason": None, "step": None, "criteria": {}}
    assert collapse_by_rule(flat, k3, grads[:5] + [math.inf] + grads[6:])["reason"] == "grad_norm"
    spike = k3[:20] + [COLLAPSE_K3_FACTOR * 0.1] + k3[21:]
    assert collapse_by_rule(flat, spike, grads) == {"collapsed": True, "reason": "k3", "step": 21, "criteria": {"k3": 21}}
    early_spike = [COLLAPSE_K3_FACTOR * 0.1] + k3[1:]  # inside the baseline window: raises the baseline only
    assert not collapse_by_rule(flat, early_spike, grads)["collapsed"]
    drop = [0.8] * 15 + [0.3] * 15  # moving mean reaches 0.6 = peak - 0.2 at step 19 and stays below
    assert collapse_by_rule(drop, k3, grads) == {"collapsed": True, "reason": "reward", "step": 19,
                                                 "criteria": {"reward": 19}}
    # every criterion met is reported, the earliest is the verdict
    both = collapse_by_rule(drop, spike, grads)
    assert (both["reason"], both["step"], both["criteria"]) == ("reward", 19, {"reward": 19, "k3": 21})
    recovered = [0.8] * 15 + [0.3] * 10 + [0.8] * 10
    assert not collapse_by_rule(recovered, k3, grads)["collapsed"]


def test_run_collapse_reports_the_optimizer_step(tmp_path):
    from triage_trl.lab.metrics import run_collapse
    from triage_trl.lab.plots import write_overlay

    # two updates per rollout: reward and k3 logged at odd steps only, the grad norm at every step
    history = []
    for step in range(1, 61):
        record = {"step": step, "grad_norm": 1.0}
        if step % 2:
            record.update({"reward": 0.5, "triage/k3_kl": COLLAPSE_K3_FACTOR * 0.1 if step == 41 else 0.1})
        history.append(record)
    assert run_collapse(history) == {"collapsed": True, "reason": "k3", "step": 41,  # the 21st logged value
                                     "criteria": {"k3": 41}}
    history[10]["grad_norm"] = math.nan
    assert run_collapse(history) == {"collapsed": True, "reason": "grad_norm", "step": 11,
                                     "criteria": {"grad_norm": 11, "k3": 41}}
    # the earliest by optimizer step, not by index in its own series: a non-finite grad norm at step 45 (index 45)
    # comes after the k3 hit at step 41 (index 21), one at step 31 (index 31) before it
    history[10]["grad_norm"] = 1.0
    history[44]["grad_norm"] = math.nan
    assert run_collapse(history)["reason"] == "k3"
    history[44]["grad_norm"], history[30]["grad_norm"] = 1.0, math.nan
    assert run_collapse(history) == {"collapsed": True, "reason": "grad_norm", "step": 31,
                                     "criteria": {"grad_norm": 31, "k3": 41}}
    path = write_overlay({"nvfp4_naive@stress": [history]}, str(tmp_path / "overlay.png"),
                         {"nvfp4_naive@stress": [11]})
    assert os.path.getsize(path) > 10_000


def test_the_overlay_draws_the_fixed_probe_k3_on_its_own_log_panel(tmp_path, monkeypatch):
    from triage_trl.lab import plots

    history = [{"step": s, "reward": 0.5, "triage/k3_kl": 0.1, "entropy": 0.3} for s in range(1, 11)]
    probe = [{"step": 0, "k3": 0.5}, {"step": 5, "k3": 2.0}, {"step": 10, "k3": 40.0}, {"step": 10, "tokens": 3}]
    merged = plots.with_fixed_probe(history, probe)
    assert merged[:10] == history and merged[10:] == [{"step": 0, plots.PROBE_K3: 0.5},
                                                      {"step": 5, plots.PROBE_K3: 2.0},
                                                      {"step": 10, plots.PROBE_K3: 40.0}]
    assert plots.with_fixed_probe(history, None) == history
    drawn = {}
    real_draw = plots._draw

    def spy(ax, histories, key, label, color, smooth=0):
        out = real_draw(ax, histories, key, label, color, smooth)
        drawn[key] = (ax.lines[-1].get_xdata().tolist(), ax.lines[-1].get_ydata().tolist()) if ax.lines else None
        return out

    monkeypatch.setattr(plots, "_draw", spy)
    plots.write_overlay({"bf16_learner_nvfp4_sampler@stress": [merged]}, str(tmp_path / "overlay.png"))
    assert drawn[plots.PROBE_K3] == ([0, 5, 10], [0.5, 2.0, 40.0])
    # an E3 run draws its dose on that panel; a lab without probe records draws no probe panel
    hot = plots.with_fixed_probe(history, [{"step": 0, "k3": 1e-10, "dose_k3": 0.0},
                                           {"step": 5, "k3": 1e-10, "dose_k3": 0.02}])
    assert [r[plots.PROBE_K3] for r in hot[10:]] == [0.0, 0.02]
    drawn.clear()
    plots.write_overlay({"bf16": [history]}, str(tmp_path / "overlay2.png"))
    assert plots.PROBE_K3 not in drawn and "reward" in drawn
    assert plots.PROBE_K3 in plots.LOG_PANELS and [k for k, _, _ in plots.OVERLAY_PANELS][2] == plots.PROBE_K3


def test_moving_mean_reads_full_windows_as_the_collapse_rule():
    from triage_trl.lab.plots import moving_mean

    assert moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [2.0, 4.0, 6.0]
    assert moving_mean([2.0, 4.0], 10) == []


def test_a_batch_without_tail_tokens_is_left_out_of_the_pooled_test():
    """No tail token (in E1: a batch without learning signal, whose advantages are zeroed) leaves nothing to test:
    NaN, not a concentration of 0."""
    empty = tail_concentration_null([3, 4], [0, 0], keep_draws=True)
    assert math.isnan(empty["observed"]) and empty["n_segments"] == 2
    full = tail_concentration_null([3, 3, 3], [3, 0, 0], keep_draws=True)
    assert pooled_null([empty, full])["batches"] == 1
