"""Paired comparison helpers of ``triage_trl.eval.held_out`` (pure Python)."""

from __future__ import annotations

import math

import pytest

from triage_trl.eval.held_out import HeldOutResult, items_won_lost, paired_difference, shared_prompts


def _result(outcomes):
    return HeldOutResult(sum(outcomes), len(outcomes), list(outcomes), [""] * len(outcomes))


def test_won_lost_are_the_discordant_pairs_of_the_paired_difference():
    before = _result([1, 1, 0, 0, 1, 0, 1, 1])
    after = _result([1, 0, 1, 1, 1, 0, 0, 1])
    assert items_won_lost(before, after) == (2, 2)
    gain, se = paired_difference(before, after)
    assert gain == 0.0
    assert se == pytest.approx(math.sqrt((4 / 7) / 8))  # d = (0,-1,1,1,0,0,-1,0): var = 4/7
    assert items_won_lost(before, _result([1] * 8)) == (3, 0)
    with pytest.raises(ValueError, match="same items"):
        items_won_lost(before, _result([1]))


def test_shared_prompts_counts_held_out_questions_found_in_training():
    train = {"prompt": [[{"role": "user", "content": q}] for q in ("1 + 2", "3 - 4", "1 + 2")]}
    held_out = {"prompt": [[{"role": "user", "content": q}] for q in ("1 + 2", "5 + 5", "3 - 4", "1 + 2")]}
    assert shared_prompts(held_out, train) == 3


def test_demo_task_repeats_questions_across_seeds():
    pytest.importorskip("reasoning_gym")
    from triage_trl.data import HELD_OUT_SEED, TRAIN_SEED, reasoning_gym_dataset

    train = reasoning_gym_dataset(size=256, seed=TRAIN_SEED)
    held_out = reasoning_gym_dataset(size=128, seed=HELD_OUT_SEED)
    assert shared_prompts(held_out, train) == 90  # chain_sum, 2 terms of 1 digit: 200 distinct problems
