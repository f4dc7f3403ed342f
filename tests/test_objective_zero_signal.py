"""Zero-signal groups (docs/objective.md): weight exactly 1, out of the diagnosis, with TRL's own arithmetic."""

import math

import pytest
import torch

from triage_trl import TriageConfig, segment_ids, triage_weights, zero_reward_spread

G, T = 8, 32  # one GRPO group of 8 completions, 32 tokens each

# Metrics that describe the diagnosis and the weights' shares: zero-signal tokens take no part in them.
DIAGNOSIS_METRICS = (
    "frac_NA", "frac_PA", "frac_NC", "frac_PC", "tail_count_NA", "tail_count_PA", "tail_count_NC", "tail_count_PC",
    "amp_imbalance", "hot_segment_frac", "tail_in_hot_frac", "tail_concentration", "beta", "rebalanced_frac",
    "repaired_frac", "tau",
)
MISMATCH_METRICS = ("gap_mean", "gap_abs_mean", "gap_abs_max", "k3_kl", "log_ppl_diff", "nonfinite_sampler_frac")


def trl_group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """TRL 1.16's group-normalised advantage, (r - mean) / (std + 1e-4) in float32, with TRL's own nanstd."""
    from trl.trainer.utils import nanstd

    grouped = rewards.view(-1, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(G)
    std = nanstd(grouped, dim=1).repeat_interleave(G)
    return (rewards - mean) / (std + 1e-4)


def realistic_gaps(B, seed=0):
    """Learner and sampler log-probs ~0.9 nats apart per token, as in an early NVFP4 run's bad steps."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    return old, old + torch.randn(B, T, generator=g) * 0.9


def config():
    return TriageConfig(triage_segment_mode="fixed", triage_segment_max_tokens=8, triage_tail_quantile=0.8)


def test_trl_advantage_of_equal_rewards_is_not_zero():
    adv = trl_group_advantages(torch.full((G,), 0.35))
    assert adv[0].item() == pytest.approx(2.98e-4, rel=1e-3) and bool((adv == adv[0]).all())
    for value in (0.3, 1 / 3, 0.7, 0.1):
        assert trl_group_advantages(torch.full((G,), value))[0].item() != 0.0
    for value in (0.0, 1.0):  # 0/1 rewards give exact zeros
        assert trl_group_advantages(torch.full((G,), value))[0].item() == 0.0


def test_equal_rewards_give_unit_weights_and_no_repair():
    adv = trl_group_advantages(torch.full((G,), 0.35))
    old, sampler = realistic_gaps(G)
    mask = torch.ones(G, T, dtype=torch.bool)
    seg = segment_ids(torch.zeros(G, T, dtype=torch.long), mode="fixed", max_tokens=8)
    unflagged = triage_weights(old, sampler, adv, mask, seg, config())
    assert int((unflagged.weights != 1).sum()) == 123 and unflagged.metrics["repaired_frac"] == 117 / 256  # unflagged

    zero_signal = zero_reward_spread(torch.full((G,), 0.35), G)
    assert zero_signal.tolist() == [True] * G
    r = triage_weights(old, sampler, adv, mask, seg, config(), zero_signal=zero_signal)
    assert torch.equal(r.weights, torch.ones(G, T))
    assert r.metrics["repaired_frac"] == 0.0 and r.metrics["rebalanced_frac"] == 0.0 and r.metrics["beta"] == 1.0
    assert all(r.metrics[f"frac_{q}"] == 0.0 and r.metrics[f"tail_count_{q}"] == 0.0 for q in ("NA", "PA", "NC", "PC"))
    assert r.metrics["hot_segment_frac"] == 0.0 and r.metrics["tau"] == config().triage_tail_min_gap
    assert r.metrics["weight_min"] == r.metrics["weight_max"] == r.metrics["weight_mean"] == 1.0
    # the mismatch metrics still measure the two engines on these tokens
    for name in MISMATCH_METRICS:
        assert r.metrics[name] == unflagged.metrics[name], name
    assert r.metrics["gap_abs_mean"] > 0.5


def test_zero_signal_group_changes_nothing_for_the_other_group():
    rewards = torch.cat([torch.full((G,), 0.35), torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.25])])
    adv = trl_group_advantages(rewards)
    old, sampler = realistic_gaps(2 * G, seed=1)
    mask = torch.arange(T)[None, :] < torch.randint(4, T + 1, (2 * G,), generator=torch.Generator().manual_seed(2))[:, None]
    seg = segment_ids(torch.zeros(2 * G, T, dtype=torch.long), mode="fixed", max_tokens=8)
    zero_signal = zero_reward_spread(rewards, G)
    assert zero_signal.tolist() == [True] * G + [False] * G
    both = triage_weights(old, sampler, adv, mask, seg, config(), zero_signal=zero_signal)
    alone = triage_weights(old[G:], sampler[G:], adv[G:], mask[G:], seg[G:], config())
    assert torch.equal(both.weights[:G], torch.ones(G, T))
    assert torch.equal(both.weights[G:], alone.weights)
    assert alone.metrics["beta"] < 1.0 and alone.metrics["repaired_frac"] > 0.0, "the fixture must exercise both"
    for name in DIAGNOSIS_METRICS:
        assert both.metrics[name] == pytest.approx(alone.metrics[name], rel=1e-9), name


def test_nonfinite_sampler_logprob_in_a_zero_signal_group_still_gets_weight_zero():
    old, sampler = realistic_gaps(G)
    sampler[3, 5] = math.nan
    mask = torch.ones(G, T, dtype=torch.bool)
    seg = torch.zeros(G, T, dtype=torch.long)
    r = triage_weights(old, sampler, torch.full((G,), 2.98e-4), mask, seg, config(),
                       zero_signal=torch.ones(G, dtype=torch.bool))
    expected = torch.ones(G, T)
    expected[3, 5] = 0.0
    assert torch.equal(r.weights, expected)
    assert r.metrics["nonfinite_sampler_frac"] == 1 / (G * T)


def test_zero_signal_must_be_a_bool_per_completion():
    old, sampler = realistic_gaps(2)
    args = (old, sampler, torch.ones(2), torch.ones(2, T, dtype=torch.bool), torch.zeros(2, T, dtype=torch.long))
    for bad in (torch.ones(2), torch.ones(3, dtype=torch.bool), torch.ones(2, T, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"zero_signal must be a bool tensor of shape \(B,\)"):
            triage_weights(*args, config(), zero_signal=bad)


def test_zero_reward_spread():
    nan = math.nan
    rewards = torch.tensor([0.35, 0.35, 0.35, 0.35, 1.0, 0.0, 1.0, 1.0, 0.5, nan, 0.5, 0.5, nan, nan, nan, nan])
    assert zero_reward_spread(rewards, 4).tolist() == [True] * 4 + [False] * 4 + [True] * 4 + [True] * 4
    # per reward function: zero-signal only when every function is constant within the group
    per_func = torch.tensor([[1.0, 0.2], [1.0, 0.2], [1.0, 0.2], [1.0, 0.7]])
    assert zero_reward_spread(per_func, 2).tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="groups of num_generations=3"):
        zero_reward_spread(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="groups"):
        zero_reward_spread(torch.zeros(2, 2, 2), 2)
