"""The vectorised objective equals the plain per-sequence Python reference (hypothesis)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from objective_reference import ReferenceSamplerBroken, reference_segment_ids, reference_triage
from triage_trl import METRIC_NAMES, NonFiniteSamplerLogprobsError, TriageConfig, segment_ids, triage_weights

VOCAB = 12
NEWLINE_IDS = {0, 5}  # token ids whose text holds "\n" in this synthetic vocabulary
NEWLINE_TABLE = torch.tensor([i in NEWLINE_IDS for i in range(VOCAB)])

# log-probs on a 1/16 grid: float32 differences are exact and ties are common, as in bf16 runs.
grid = st.integers(min_value=-48, max_value=0).map(lambda k: k / 16)
sampler_value = st.one_of(
    grid, grid, grid, grid, grid, grid, st.sampled_from([-math.inf, math.nan, math.inf])
)
advantage = st.integers(min_value=-8, max_value=8).map(lambda k: k / 8)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 24))
    old = draw(st.lists(st.lists(grid, min_size=T, max_size=T), min_size=B, max_size=B))
    # sampler = learner + a small perturbation, sometimes large, sometimes non-finite
    delta = draw(st.lists(st.lists(st.one_of(st.just(0.0), grid.map(lambda x: x / 4), grid), min_size=T, max_size=T), min_size=B, max_size=B))
    sampler = [[o + d for o, d in zip(ro, rd)] for ro, rd in zip(old, delta)]
    for b in range(B):
        for t in range(T):
            if draw(st.integers(0, 40)) == 0:
                sampler[b][t] = draw(st.sampled_from([-math.inf, math.nan, math.inf]))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))  # ragged right padding
    holes = draw(st.booleans())  # tool-mask style holes inside the completion
    mask = [[int(t < lengths[b] and not (holes and (b + t) % 5 == 3)) for t in range(T)] for b in range(B)]
    per_token = draw(st.booleans())
    if per_token:
        adv = draw(st.lists(st.lists(advantage, min_size=T, max_size=T), min_size=B, max_size=B))
    else:
        adv = draw(st.lists(advantage, min_size=B, max_size=B))
    ids = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=T, max_size=T), min_size=B, max_size=B))
    zero_signal = None
    if draw(st.booleans()):
        zero_signal = draw(st.lists(st.booleans(), min_size=B, max_size=B))
        # TRL's advantage of an all-equal group is a float32 rounding residue, not 0 (0.35 x 8 -> +2.98e-4)
        residue = draw(st.sampled_from([0.0, 2.98e-4, -2.98e-4]))
        for b in range(B):
            if zero_signal[b]:
                if per_token:
                    adv[b] = [residue] * T
                else:
                    adv[b] = residue
    cfg = TriageConfig(
        triage_mode=draw(st.sampled_from(["full", "full", "diagnose", "off"])),
        triage_gap_sign=draw(st.sampled_from([1, -1])),
        triage_tail_quantile=draw(st.sampled_from([0.5, 0.8, 0.9, 0.98])),
        triage_tail_min_gap=draw(st.sampled_from([0.0, 0.05, 0.25])),
        triage_segment_mode=draw(st.sampled_from(["newline", "fixed"])),
        triage_segment_max_tokens=draw(st.integers(1, 8)),
        triage_hot_min_tokens=draw(st.integers(1, 3)),
        triage_hot_density=draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0])),
        triage_rebalance_floor=draw(st.sampled_from([0.25, 0.5, 1.0])),
        triage_rebalance_scope=draw(st.sampled_from(["segment", "tail"])),
        triage_repair_mode=draw(st.sampled_from(["excess_is", "mask", "none"])),
        triage_severe_gap=draw(st.sampled_from([math.log(2.0), 0.5, 1.0])),
        triage_repair_clip=draw(st.sampled_from([1.0, 2.0, 4.0])),
        triage_nonfinite_max_frac=draw(st.sampled_from([1.0, 1.0, 1.0, 0.25, 0.01, 0.0])),
    )
    return old, sampler, adv, mask, ids, zero_signal, cfg


def _assert_metrics_close(got, want):
    assert set(got) == set(METRIC_NAMES)
    for name in METRIC_NAMES:
        assert math.isfinite(got[name]), name
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_vectorised_equals_reference(batch):
    old, sampler, adv, mask, ids, zero_signal, cfg = batch
    old_t = torch.tensor(old, dtype=torch.float32)
    sampler_t = torch.tensor(sampler, dtype=torch.float32)
    adv_t = torch.tensor(adv, dtype=torch.float32)
    mask_t = torch.tensor(mask, dtype=torch.bool)
    ids_t = torch.tensor(ids, dtype=torch.int64)

    seg = segment_ids(
        ids_t, mode=cfg.triage_segment_mode, max_tokens=cfg.triage_segment_max_tokens, newline_table=NEWLINE_TABLE
    )
    ref_seg = reference_segment_ids(ids, cfg.triage_segment_mode, cfg.triage_segment_max_tokens, NEWLINE_IDS)
    assert seg.tolist() == ref_seg

    zero_signal_t = None if zero_signal is None else torch.tensor(zero_signal, dtype=torch.bool)
    ref_args = (old_t.tolist(), sampler_t.tolist(), adv_t.tolist(), mask, ref_seg, cfg, zero_signal)
    if cfg.triage_mode != "off":
        try:
            ref_weights, ref_metrics = reference_triage(*ref_args)  # the reference sees torch's float32 values
        except ReferenceSamplerBroken:
            event("sampler broken: raises")
            with pytest.raises(NonFiniteSamplerLogprobsError, match="the sampler is broken"):
                triage_weights(old_t, sampler_t, adv_t, mask_t, seg, cfg, zero_signal=zero_signal_t)
            return

    result = triage_weights(old_t, sampler_t, adv_t, mask_t, seg, cfg, zero_signal=zero_signal_t)
    assert result.weights.shape == old_t.shape and result.weights.dtype == torch.float32
    assert not result.weights.requires_grad
    assert torch.isfinite(result.weights).all()
    if cfg.triage_mode == "off":
        assert result.metrics == {}
        assert torch.equal(result.weights, torch.ones_like(old_t))
        return

    _assert_metrics_close(result.metrics, ref_metrics)
    event(f"rebalanced: {ref_metrics['rebalanced_frac'] > 0}")
    event(f"repaired: {ref_metrics['repaired_frac'] > 0}")
    event(f"hot segments: {ref_metrics['hot_segment_frac'] > 0}")
    event(f"zero-signal rows: {zero_signal is not None and any(zero_signal)}")
    event(f"non-finite sampler tokens: {ref_metrics['nonfinite_sampler_frac'] > 0}")
    if cfg.triage_mode == "diagnose":
        assert torch.equal(result.weights, torch.ones_like(old_t))
    else:
        np.testing.assert_allclose(result.weights.numpy(), np.array(ref_weights, dtype=np.float64), rtol=1e-6, atol=0)
