"""The spec's invariants, hand-computed cases and bad input for the TRIAGE objective."""

import math

import numpy as np
import pytest
import torch

from triage_trl import METRIC_NAMES, NonFiniteSamplerLogprobsError, TriageConfig, segment_ids, triage_weights
from triage_trl.objective import kth_smallest, order_statistic_rank
from objective_reference import random_objective_batch  # noqa: E402


def random_batch(B=6, T=40, seed=0, gap_scale=0.4):
    return random_objective_batch(B, T, seed, gap_scale)


def run(old, sampler, adv, mask, seg, **cfg):
    return triage_weights(old, sampler, adv, mask, seg, TriageConfig(**cfg))


def hot_config(**over):
    cfg = dict(triage_tail_quantile=0.5, triage_hot_min_tokens=1, triage_hot_density=0.0)
    cfg.update(over)
    return cfg


# --- hand-computed case -------------------------------------------------------------------------

def test_hand_computed_rebalancing_and_repair():
    # One sequence, 4 tokens, one segment. A = -1 on all tokens: every negative gap is NA.
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-0.5, -0.75, -1.25, -3.0]])  # gap = -0.5, -0.25, +0.25, +2.0
    adv = torch.tensor([-1.0])
    mask = torch.ones(1, 4, dtype=torch.bool)
    seg = torch.zeros(1, 4, dtype=torch.long)
    r = run(old, sampler, adv, mask, seg, triage_tail_quantile=0.25, triage_hot_min_tokens=1, triage_hot_density=0.0)
    m = r.metrics
    # |gap| sorted: 0.25 0.25 0.5 2.0, k = ceil(0.25 * 4) = 1 -> tau = max(0.05, 0.25) = 0.25: every token is tail
    assert m["tau"] == 0.25
    assert (m["frac_NA"], m["frac_NC"], m["frac_PA"], m["frac_PC"]) == (0.5, 0.5, 0.0, 0.0)
    assert (m["tail_count_NA"], m["tail_count_NC"]) == (2.0, 2.0)
    # M_NA = 2, M_PA = 0 -> beta = floor = 0.25 on NA tokens; token 3 (gap 2.0) is severe and contracting:
    # r = clamp(exp(2.0 - log 2), 1/2, 2) = 2
    assert m["beta"] == 0.25
    torch.testing.assert_close(r.weights, torch.tensor([[0.25, 0.25, 1.0, 2.0]]))
    assert m["amp_imbalance"] == 2.0  # 2 / (0 + 1)
    assert m["hot_segment_frac"] == 1.0 and m["tail_in_hot_frac"] == 1.0 and m["tail_concentration"] == 1.0
    assert m["rebalanced_frac"] == 0.5 and m["repaired_frac"] == 0.25
    assert m["gap_mean"] == pytest.approx(0.375) and m["log_ppl_diff"] == pytest.approx(-0.375)  # verl's sign
    assert m["k3_kl"] == pytest.approx(np.mean([math.expm1(g) - g for g in (-0.5, -0.25, 0.25, 2.0)]), rel=1e-6)
    assert m["weight_min"] == 0.25 and m["weight_max"] == 2.0 and m["weight_mean"] == pytest.approx(0.875)


def test_beta_is_mass_ratio_between_floor_and_one():
    # NA mass 4 x 1.0, PA mass 2 x 1.0 in one hot segment -> beta = 2/4 on NA tokens
    old = torch.zeros(2, 6)
    sampler = torch.tensor([[0.5] * 4 + [0.0] * 2, [-0.5] * 2 + [0.0] * 4])  # gap -0.5 (row 0), +0.5 (row 1)
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.ones(2, 6, dtype=torch.bool)
    seg = torch.zeros(2, 6, dtype=torch.long)
    r = run(old, sampler, adv, mask, seg, **hot_config(triage_hot_density=0.3))
    assert r.metrics["beta"] == 0.5
    torch.testing.assert_close(r.weights, torch.tensor([[0.5] * 4 + [1.0] * 2, [1.0] * 6]))
    # scope "tail" with a threshold above the gaps: nothing is tail, nothing hot, nothing rebalanced
    r = run(old, sampler, adv, mask, seg, **hot_config(triage_tail_min_gap=1.0))
    assert r.metrics["beta"] == 1.0 and torch.equal(r.weights, torch.ones(2, 6))


def test_order_statistic_rank_matches_numpy_inverted_cdf():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 50, 101, 1000):
        x = rng.random(n)
        for q in (0.01, 0.5, 0.9, 0.98, 0.999):
            k = order_statistic_rank(n, q)
            assert np.sort(x)[k - 1] == np.quantile(x, q, method="inverted_cdf")


# --- the spec's invariants ----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_zero_gap_or_zero_advantages_give_unit_weights(seed):
    old, sampler, adv, mask, seg = random_batch(seed=seed, gap_scale=2.0)
    r = run(old, old.clone(), adv, mask, seg, **hot_config())
    assert torch.equal(r.weights, torch.ones_like(old))
    r = run(old, sampler, torch.zeros_like(adv), mask, seg, **hot_config())
    assert torch.equal(r.weights, torch.ones_like(old))
    assert r.metrics["repaired_frac"] == 0.0


@pytest.mark.parametrize("seed", range(8))
def test_weights_are_bounded_and_contracting_never_downweighted(seed):
    old, sampler, adv, mask, seg = random_batch(seed=seed, gap_scale=1.5)
    floor, clip = 0.25, 2.0
    r = run(old, sampler, adv, mask, seg, **hot_config(triage_rebalance_floor=floor, triage_repair_clip=clip))
    w = r.weights[mask]
    assert (w >= floor / clip - 1e-7).all() and (w <= clip + 1e-7).all()
    assert r.metrics["beta"] < 1.0, "the fixture must exercise rebalancing"
    # without repair, contracting tokens keep weight exactly 1
    r = run(old, sampler, adv, mask, seg, **hot_config(triage_repair_mode="none"))
    gap = old - sampler
    contracting = mask & (torch.sign(adv)[:, None] * torch.sign(gap) < 0)
    assert torch.equal(r.weights[contracting], torch.ones(int(contracting.sum())))


@pytest.mark.parametrize("segment_mode", ["newline", "fixed"])
def test_padding_invariance(segment_mode):
    old, sampler, adv, mask, _ = random_batch(seed=3, gap_scale=1.0)
    B, T = old.shape
    table = torch.zeros(16, dtype=torch.bool)
    table[3] = True
    ids = torch.randint(0, 16, (B, T), generator=torch.Generator().manual_seed(0))
    cfg = hot_config(triage_segment_mode=segment_mode, triage_segment_max_tokens=5)

    def weights_and_metrics(old, sampler, adv, mask, ids):
        seg = segment_ids(ids, mode=segment_mode, max_tokens=5, newline_table=table)
        return run(old, sampler, adv, mask, seg, **cfg)

    base = weights_and_metrics(old, sampler, adv, mask, ids)
    pad = 7
    padded = weights_and_metrics(
        torch.cat([old, torch.randn(B, pad)], 1),
        torch.cat([sampler, torch.full((B, pad), math.nan)], 1),  # garbage in padding is ignored
        adv,
        torch.cat([mask, torch.zeros(B, pad, dtype=torch.bool)], 1),
        torch.cat([ids, torch.randint(0, 16, (B, pad))], 1),
    )
    assert torch.equal(padded.weights[:, :T], base.weights)
    assert torch.equal(padded.weights[:, T:], torch.ones(B, pad))
    assert padded.metrics == pytest.approx(base.metrics, rel=1e-6, abs=1e-9)
    # a fully masked extra sequence changes nothing either
    extra = weights_and_metrics(
        torch.cat([old, old[:1]]), torch.cat([sampler, sampler[:1]]), torch.cat([adv, adv[:1]]),
        torch.cat([mask, torch.zeros(1, T, dtype=torch.bool)]), torch.cat([ids, ids[:1]]),
    )
    assert torch.equal(extra.weights[:B], base.weights)
    assert extra.metrics == pytest.approx(base.metrics, rel=1e-6, abs=1e-9)


def test_sequence_permutation_permutes_weights():
    old, sampler, adv, mask, seg = random_batch(seed=5, gap_scale=1.0)
    perm = torch.randperm(old.shape[0], generator=torch.Generator().manual_seed(1))
    base = run(old, sampler, adv, mask, seg, **hot_config())
    permuted = run(old[perm], sampler[perm], adv[perm], mask[perm], seg[perm], **hot_config())
    assert torch.equal(permuted.weights, base.weights[perm])
    assert permuted.metrics == pytest.approx(base.metrics, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("repair", ["excess_is", "mask", "none"])
def test_mirror_symmetry_swaps_na_and_pa(repair):
    old, sampler, adv, mask, seg = random_batch(seed=7, gap_scale=1.0)
    cfg = hot_config(triage_repair_mode=repair)
    base = run(old, sampler, adv, mask, seg, **cfg)
    assert base.metrics["beta"] < 1.0
    # (a) negate the advantages and flip the gap convention: identical weights, repair included
    flipped = run(old, sampler, -adv, mask, seg, **cfg, triage_gap_sign=-1)
    assert torch.equal(flipped.weights, base.weights)
    for a, b in (("NA", "PA"), ("NC", "PC")):
        assert flipped.metrics[f"frac_{a}"] == base.metrics[f"frac_{b}"]
        assert flipped.metrics[f"tail_count_{a}"] == base.metrics[f"tail_count_{b}"]
    # (b) negate the advantages and the physical gap (swap learner and sampler): identical rebalancing;
    # the repair importance weight becomes its reciprocal, so only repair-free modes match exactly.
    swapped = run(sampler, old, -adv, mask, seg, **cfg)
    assert swapped.metrics["beta"] == base.metrics["beta"]
    assert swapped.metrics["frac_NA"] == base.metrics["frac_PA"]
    if repair != "excess_is":
        assert torch.equal(swapped.weights, base.weights)


def test_gradients_never_flow_through_weights():
    old, sampler, adv, mask, seg = random_batch(seed=2, gap_scale=1.0)
    logps = old.clone().requires_grad_(True)
    r = run(logps, sampler, adv, mask, seg, **hot_config())
    assert not r.weights.requires_grad
    ratio = torch.exp(logps - logps.detach())
    loss = -(r.weights * ratio * adv[:, None] * mask).sum()
    loss.backward()
    torch.testing.assert_close(logps.grad, -(r.weights * adv[:, None] * mask))


def test_metric_documentation_says_what_diagnose_mode_reports():
    from triage_trl import METRICS

    assert tuple(METRICS) == METRIC_NAMES and all(METRICS.values())
    full_mode = {"beta", "rebalanced_frac", "repaired_frac", "weight_mean", "weight_min", "weight_max"}
    for name, meaning in METRICS.items():
        assert ("In diagnose mode: what full mode would apply" in meaning) == (name in full_mode), name
    assert "verl's log_ppl_diff (same sign)" in METRICS["log_ppl_diff"]


def test_diagnose_reports_what_full_would_apply():
    old, sampler, adv, mask, seg = random_batch(seed=4, gap_scale=1.0)
    full = run(old, sampler, adv, mask, seg, **hot_config())
    diag = run(old, sampler, adv, mask, seg, **hot_config(triage_mode="diagnose"))
    assert torch.equal(diag.weights, torch.ones_like(old))
    assert diag.metrics == full.metrics
    off = run(old, sampler, adv, mask, seg, triage_mode="off")
    assert off.metrics == {} and torch.equal(off.weights, torch.ones_like(old))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_match_their_float32_upcast(dtype):
    old, sampler, adv, mask, seg = random_batch(seed=6, gap_scale=1.0)
    old, sampler, adv = old.to(dtype), sampler.to(dtype), adv.to(dtype)
    low = run(old, sampler, adv, mask, seg, **hot_config())
    up = run(old.float(), sampler.float(), adv.float(), mask, seg, **hot_config())
    assert low.weights.dtype == torch.float32
    assert torch.equal(low.weights, up.weights) and low.metrics == up.metrics


def test_per_token_advantages_equal_broadcast_per_sequence():
    old, sampler, adv, mask, seg = random_batch(seed=8, gap_scale=1.0)
    per_seq = run(old, sampler, adv, mask, seg, **hot_config())
    per_tok = run(old, sampler, adv[:, None].expand_as(old).contiguous(), mask, seg, **hot_config())
    assert torch.equal(per_seq.weights, per_tok.weights)
    assert per_seq.metrics == pytest.approx(per_tok.metrics, rel=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU path is tested everywhere")
def test_cuda_matches_cpu():
    old, sampler, adv, mask, seg = random_batch(seed=9, gap_scale=1.0)
    cpu = run(old, sampler, adv, mask, seg, **hot_config())
    gpu = run(old.cuda(), sampler.cuda(), adv.cuda(), mask.cuda(), seg.cuda(), **hot_config())
    assert gpu.weights.is_cuda
    torch.testing.assert_close(gpu.weights.cpu(), cpu.weights)
    assert gpu.metrics == pytest.approx(cpu.metrics, rel=1e-5, abs=1e-6)


# --- bad and edge input -------------------------------------------------------------------------

def _all_finite(result):
    assert torch.isfinite(result.weights).all()
    assert set(result.metrics) == set(METRIC_NAMES)
    assert all(math.isfinite(v) for v in result.metrics.values()), result.metrics


def test_mismatched_shapes_raise():
    old, sampler, adv, mask, seg = random_batch()
    with pytest.raises(ValueError, match=r"sampler_logps has shape \(6, 39\)"):
        run(old, sampler[:, :-1], adv, mask, seg)
    with pytest.raises(ValueError, match=r"advantages has shape \(5,\)"):
        run(old, sampler, adv[:-1], mask, seg)
    with pytest.raises(ValueError, match="segment_ids must lie in"):
        run(old, sampler, adv, mask, seg + 100)
    with pytest.raises(ValueError, match="floating-point"):
        run(old, sampler, adv.long(), mask, seg)
    with pytest.raises(ValueError, match="shape \\(B, T\\)"):
        run(old[0], sampler[0], adv, mask[0], seg[0])


def test_nonfinite_learner_logps_or_advantages_raise():
    old, sampler, adv, mask, seg = random_batch()
    bad = old.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="learner log-probs.*1 non-finite"):
        run(bad, sampler, adv, mask, seg)
    bad_adv = adv.clone()
    bad_adv[1] = math.inf
    with pytest.raises(ValueError, match="advantages hold .* non-finite.*reward"):
        run(old, sampler, bad_adv, mask, seg)
    # non-finite values on masked positions are ignored
    bad = old.clone()
    bad[~mask] = math.nan
    _all_finite(run(bad, sampler, adv, mask, seg))


@pytest.mark.parametrize("repair", ["excess_is", "mask", "none"])
def test_nonfinite_sampler_logps_get_weight_zero_and_are_counted(repair):
    old = torch.full((2, 4), -1.0)
    sampler = torch.tensor([[-math.inf, math.nan, -1.0, -1.0], [math.inf, -1.0, -1.5, -1.0]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 4, dtype=torch.bool)
    seg = torch.zeros(2, 4, dtype=torch.long)
    r = run(old, sampler, adv, mask, seg, triage_repair_mode=repair, triage_nonfinite_max_frac=0.5)
    _all_finite(r)
    torch.testing.assert_close(r.weights, torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]]))
    m = r.metrics
    assert m["nonfinite_sampler_frac"] == 3 / 8 and m["repaired_frac"] == 0.0 and m["weight_min"] == 0.0
    # out of the mismatch metrics and the diagnosis: 5 measured tokens, one gap of +0.5 (A < 0: NC)
    assert m["gap_abs_max"] == 0.5 and m["gap_mean"] == pytest.approx(0.1)
    assert m["frac_NC"] == 1 / 5 and m["tau"] == 0.5 and m["tail_count_NC"] == 1.0
    # log_ppl_diff (verl's sign): row 0 has mean gap 0, row 1 mean gap 0.5 / 3 -> -(0 + 1/6) / 2
    assert m["log_ppl_diff"] == pytest.approx(-1 / 12)


def test_nonfinite_sampler_share_above_the_bound_raises():
    old = torch.full((1, 100), -1.0)
    mask = torch.ones(1, 100, dtype=torch.bool)
    seg = torch.zeros(1, 100, dtype=torch.long)
    sampler = old.clone()
    sampler[0, 0] = math.nan  # 1 of 100 valid tokens: at the default bound 0.01, allowed
    r = run(old, sampler, torch.tensor([1.0]), mask, seg)
    assert r.metrics["nonfinite_sampler_frac"] == 0.01 and r.weights[0, 0] == 0.0
    sampler[0, 1] = -math.inf  # 2 of 100: above it
    for mode in ("full", "diagnose"):
        with pytest.raises(NonFiniteSamplerLogprobsError, match=r"2 of 100 valid tokens .*sampler is broken.*logprobs"):
            run(old, sampler, torch.tensor([1.0]), mask, seg, triage_mode=mode)
    assert issubclass(NonFiniteSamplerLogprobsError, RuntimeError)
    run(old, sampler, torch.tensor([1.0]), mask, seg, triage_mode="off")  # off computes nothing
    run(old, sampler, torch.tensor([1.0]), mask, seg, triage_nonfinite_max_frac=0.02)
    # masked positions do not count, whatever they hold
    mask[0, :2] = False
    assert run(old, sampler, torch.tensor([1.0]), mask, seg).metrics["nonfinite_sampler_frac"] == 0.0


def test_all_masked_batch():
    old, sampler, adv, _, seg = random_batch()
    r = run(old, sampler, adv, torch.zeros_like(old, dtype=torch.bool), seg)
    _all_finite(r)
    assert torch.equal(r.weights, torch.ones_like(old))
    assert r.metrics["tau"] == 0.05 and r.metrics["beta"] == 1.0 and r.metrics["weight_mean"] == 1.0


@pytest.mark.parametrize("shape", [(3, 0), (0, 5), (0, 0)])
def test_empty_completions(shape):
    z = torch.zeros(shape)
    r = triage_weights(z, z, torch.zeros(shape[0]), z.bool(), z.long(), TriageConfig())
    assert r.weights.shape == shape
    _all_finite(r)


def test_single_token_batch():
    r = run(torch.tensor([[-1.0]]), torch.tensor([[-3.0]]), torch.tensor([1.0]), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long))
    _all_finite(r)
    # |gap| = 2 is the only value, so tau = 2; PA tail token alone in its segment; repair: exp(2 - log 2) -> 2
    assert r.metrics["tau"] == 2.0 and r.metrics["frac_PA"] == 1.0
    assert r.weights.item() == 2.0


def test_huge_gaps_keep_metrics_finite():
    old = torch.full((1, 3), -0.1)
    sampler = torch.tensor([[-1e4, -0.1, -300.0]])
    r = run(old, sampler, torch.tensor([1.0]), torch.ones(1, 3), torch.zeros(1, 3, dtype=torch.long))
    _all_finite(r)


def test_four_million_tokens():
    """4M valid tokens: the exact order statistic works where torch.quantile's size limit would bite."""
    B, T = 512, 8192
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=g)
    sampler = old + torch.randn(B, T, generator=g) * 0.1
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    seg = segment_ids(torch.zeros(B, T, dtype=torch.long), mode="fixed", max_tokens=64)
    r = run(old, sampler, adv, mask, seg)
    _all_finite(r)
    abs_gap = (old - sampler).abs().numpy().ravel()
    assert r.metrics["tau"] == pytest.approx(float(np.quantile(abs_gap, 0.98, method="inverted_cdf")), rel=0, abs=0)
    assert r.metrics["tail_count_NA"] + r.metrics["tail_count_PA"] + r.metrics["tail_count_NC"] + r.metrics[
        "tail_count_PC"
    ] == pytest.approx(0.02 * B * T, rel=1e-3)


@pytest.mark.slow
def test_past_two_to_the_24_tokens():
    """torch.quantile refuses inputs over 2**24 elements; the objective must not."""
    B, T = 2, 2**23 + 8
    old = torch.zeros(B, T)
    sampler = torch.linspace(-1.0, 0.0, B * T).view(B, T)
    with pytest.raises(RuntimeError):
        torch.quantile(sampler.reshape(-1), 0.5)
    r = run(old, sampler, torch.tensor([1.0, -1.0]), torch.ones(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.long))
    _all_finite(r)
    assert r.metrics["tau"] == pytest.approx(0.98, abs=1e-6)


@pytest.mark.parametrize("kind", ["uniform", "ties", "constant", "sorted", "heavy_tail", "mostly_zero"])
def test_kth_smallest_is_exact_on_every_path(kind):
    """The sampled-bound shortcut of the order statistic must return exactly torch.kthvalue's value."""
    g = torch.Generator().manual_seed(0)
    n = 300_000
    values = {
        "uniform": torch.rand(n, generator=g),
        "ties": torch.randint(0, 5, (n,), generator=g).float(),
        "constant": torch.full((n,), 0.25),
        "sorted": torch.linspace(0, 1, n),
        "heavy_tail": torch.randn(n, generator=g).abs() ** 6,
        "mostly_zero": (torch.rand(n, generator=g) < 0.01) * torch.rand(n, generator=g),
    }[kind]
    for k in (1, n // 2, n - n // 20, n - n // 50, n - 100, n - 1, n):
        assert kth_smallest(values, k) == float(values.kthvalue(k).values), k
