"""The direction-blind control (docs/objective.md, "Direction-blind control"): TRIAGE's tokens and mean weight,
without the direction."""

import pytest
import torch

from triage_trl import TriageConfig, segment_ids, triage_weights
from triage_trl.objective.controls import direction_blind_weights, touched_tokens
from objective_reference import random_objective_batch  # noqa: E402


def random_batch(B=8, T=40, seed=0, gap_scale=0.6):
    return random_objective_batch(B, T, seed, gap_scale)


def hot(**over):
    return dict(triage_tail_quantile=0.7, triage_hot_min_tokens=1, triage_hot_density=0.0, **over)


def test_hand_computed_case():
    # test_objective.py's hand case: TRIAGE gives [0.25, 0.25, 1, 2] (NA rebalanced, the contracting token 3 repaired)
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-0.5, -0.75, -1.25, -3.0]])
    adv, mask, seg = torch.tensor([-1.0]), torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.long)
    cfg = dict(triage_tail_quantile=0.25, triage_hot_min_tokens=1, triage_hot_density=0.0)
    aware = triage_weights(old, sampler, adv, mask, seg, TriageConfig(**cfg))
    blind = triage_weights(old, sampler, adv, mask, seg, TriageConfig(triage_direction="blind", **cfg))
    torch.testing.assert_close(aware.weights, torch.tensor([[0.25, 0.25, 1.0, 2.0]]))
    # every token is in the hot segment (or severe): each gets the mean 3.5 / 4
    torch.testing.assert_close(blind.weights, torch.full((1, 4), 0.875))
    assert blind.metrics["weight_mean"] == pytest.approx(aware.metrics["weight_mean"]) == pytest.approx(0.875)
    # repair only: the one severe token is the only one touched, its weight is its own mean
    no_rebalance = dict(cfg, triage_rebalance_floor=1.0)
    assert torch.equal(
        triage_weights(old, sampler, adv, mask, seg, TriageConfig(triage_direction="blind", **no_rebalance)).weights,
        torch.tensor([[1.0, 1.0, 1.0, 2.0]]))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("over", [{}, {"triage_rebalance_scope": "tail"}, {"triage_repair_mode": "none"},
                                  {"triage_repair_mode": "mask"}, {"triage_rebalance_floor": 1.0}])
def test_same_mean_weight_same_tokens_one_common_weight(seed, over):
    old, sampler, adv, mask, seg = random_batch(seed=seed)
    aware = triage_weights(old, sampler, adv, mask, seg, TriageConfig(**hot(**over))).weights
    blind = triage_weights(old, sampler, adv, mask, seg, TriageConfig(triage_direction="blind", **hot(**over))).weights
    # the equal-mean-weight property: over valid tokens, the blind control's mean weight is TRIAGE's
    assert blind[mask].double().mean().item() == pytest.approx(aware[mask].double().mean().item(), abs=1e-6)
    changed = aware != 1
    assert torch.equal(blind[~changed & ~(blind != 1)], aware[~changed & ~(blind != 1)])
    moved = blind != aware
    if over.get("triage_repair_mode") == "none" and over.get("triage_rebalance_floor") == 1.0:
        assert not moved.any()
    touched = (blind != 1) | changed
    # one common weight on the touched tokens; untouched tokens keep weight 1 (TRIAGE's) and padding stays 1
    values = blind[touched & mask]
    if values.numel():
        assert torch.allclose(values, values[0].expand_as(values))
    assert bool((blind[~mask] == 1).all())


def test_random_batch_has_something_to_control():
    old, sampler, adv, mask, seg = random_batch(seed=0)
    aware = triage_weights(old, sampler, adv, mask, seg, TriageConfig(**hot()))
    blind = triage_weights(old, sampler, adv, mask, seg, TriageConfig(triage_direction="blind", **hot()))
    assert aware.metrics["beta"] < 1 and aware.metrics["repaired_frac"] > 0
    assert not torch.equal(aware.weights, blind.weights)
    # the blind control touches contracting tokens too: some NC/PC token in a hot segment is down-weighted
    assert int((blind.weights < 1).sum()) > int((aware.weights < 1).sum())


def test_zero_gap_or_diagnose_mode_gives_unit_weights():
    old, _, adv, mask, seg = random_batch(seed=1)
    assert bool((triage_weights(old, old.clone(), adv, mask, seg, TriageConfig(triage_direction="blind")).weights
                 == 1).all())
    _, sampler, _, _, _ = random_batch(seed=1)
    diag = triage_weights(old, sampler, adv, mask, seg, TriageConfig(triage_mode="diagnose", triage_direction="blind",
                                                                     **hot()))
    assert bool((diag.weights == 1).all())


def test_unmeasured_tokens_stay_zero():
    old, sampler, adv, mask, seg = random_batch(seed=2)
    sampler[0, 0] = float("nan")
    mask[0, 0] = True
    cfg = TriageConfig(triage_direction="blind", triage_nonfinite_max_frac=1.0, **hot())
    assert triage_weights(old, sampler, adv, mask, seg, cfg).weights[0, 0].item() == 0.0


def test_pure_functions():
    weights = torch.tensor([[0.25, 1.0, 2.0, 1.0]])
    touched = torch.tensor([[True, False, True, False]])
    blind, common = direction_blind_weights(weights, touched)
    assert common == pytest.approx(1.125) and torch.equal(blind, torch.tensor([[1.125, 1.0, 1.125, 1.0]]))
    assert direction_blind_weights(weights, torch.zeros_like(touched)) == (weights, 1.0)
    diagnosed = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    in_hot = torch.tensor([[True, True, False, True]])
    tail = torch.tensor([[True, False, False, True]])
    adv = torch.tensor([[1.0]])
    assert touched_tokens(diagnosed, adv, in_hot, tail, True, "segment", None).tolist() == [[True, True, False, False]]
    assert touched_tokens(diagnosed, adv, in_hot, tail, True, "tail", None).tolist() == [[True, False, False, False]]
    assert touched_tokens(diagnosed, adv, in_hot, tail, False, "segment", None).tolist() == [[False] * 4]
    assert touched_tokens(diagnosed, torch.tensor([[0.0]]), in_hot, tail, True, "segment",
                          torch.tensor([[False, False, True, False]])).tolist() == [[False, False, True, False]]


def test_bad_direction_raises():
    with pytest.raises(ValueError, match="triage_direction='sideways' is invalid"):
        TriageConfig(triage_direction="sideways")
