"""The sync probe tells a stale or partial sync from precision drift (``triage_trl/trainer/sync_probe.py``): the rule
on made-up log-probs, then the real colocated vLLM sampler at TRL's test learning rate (0.1, which sharpens a random
tiny model's logits step by step): drift warns and training goes on; a skipped or partial sync stops at once."""

from __future__ import annotations

import math

import pytest
import torch

from triage_trl.trainer.sync_probe import (PROBE_FLOOR_FLOAT32, PROBE_FLOOR_HALF, PROBE_FLOOR_MIXED, PROBE_FLOOR_W4A4,
                                           StaleSamplerError, classify_probe, expected_probe_gap, untracked_move)


def test_bound_follows_what_each_engine_computes():
    assert expected_probe_gap("bf16", "bf16", "float32", "float32")[0] == PROBE_FLOOR_FLOAT32 == 0.02
    assert expected_probe_gap("bf16", "bf16", "float32", "bfloat16")[0] == PROBE_FLOOR_HALF == 0.1  # TRL's default
    assert expected_probe_gap("bf16", "bf16", "bfloat16", "bfloat16")[0] == PROBE_FLOOR_HALF
    # W4A4 on either side: activation codes rounded apart (SmolLM2-135M: 0.5-1.2 nats); weight-only as before
    assert expected_probe_gap("nvfp4", "nvfp4", "float32", "float32")[0] == PROBE_FLOOR_W4A4 == 2.0
    assert expected_probe_gap("bf16", "nvfp4", "float32", "bfloat16")[0] == PROBE_FLOOR_W4A4
    assert "W4A4" in expected_probe_gap("nvfp4", "bf16", "bfloat16", "bfloat16")[1]
    assert expected_probe_gap("nvfp4", "nvfp4", "float32", "float32", activations_quantised=False)[0] \
        == PROBE_FLOOR_HALF
    assert expected_probe_gap("nvfp4", "bf16", "bfloat16", "bfloat16", False)[0] == PROBE_FLOOR_MIXED == 0.5
    assert "sampler bf16 computing float32" in expected_probe_gap("bf16", "bf16", "float32", "float32")[1]


def _verdict(learner, sampler, prev_learner, prev_sampler, bound=0.1):
    learner, sampler = torch.tensor(learner), torch.tensor(sampler)
    moved, untracked = untracked_move(learner, sampler, torch.tensor(prev_learner), torch.tensor(prev_sampler))
    gap = float((learner - sampler).abs().mean())
    return classify_probe(gap, bound, step=3, what="test", first=False, moved=moved, untracked=untracked)


def test_rule_stale_partial_drift_and_first_probe():
    prev = [-2.0, -3.0, -1.0, -4.0]
    moved = [-1.0, -3.5, -0.5, -4.5]  # the learner moved 0.5 nats per token
    assert _verdict(moved, prev, prev, prev).kind == "stale"  # the sampler did not move at all
    partial = [-1.0, -3.0, -0.5, -4.0]  # it followed half the tokens
    assert _verdict(moved, partial, prev, prev).kind == "stale"
    drifted = [m + 0.15 for m in moved]  # followed the move, 0.15 apart now (0.05 before): drift, above the bound
    verdict = _verdict(moved, drifted, prev, [p + 0.05 for p in prev])
    assert verdict.kind == "drift" and not verdict.is_error and "precision drift" in verdict.message
    assert _verdict(moved, [m + 0.01 for m in moved], prev, prev).kind == "ok"
    still = _verdict(prev, prev, prev, prev)  # no move, no gap
    assert still.kind == "ok"
    # Below the bound nothing is judged stale: step-to-step bf16 noise can exceed a small move (measured on Cohere2)
    small = [p + 0.06 for p in prev]
    assert _verdict(small, prev, prev, prev).kind == "ok"
    first = classify_probe(0.3, 0.1, step=0, what="learner bf16 ..., sampler bf16 ...", first=True)
    assert first.kind == "mismatch" and "before any update" in first.message and "0.3 nats" in first.message
    assert classify_probe(math.inf, 0.1, step=0, what="t", first=True).kind == "corrupt"


# ------------------------------------------------------------------------------------ real sampler, lr 0.1

def _reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from triage_trl.testing import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("probe-qwen2"), "Qwen2", hidden_size=128,
                               intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1))


def _trainer(tmp_path, model, **overrides):
    from datasets import Dataset

    from triage_trl.trainer import TriageGRPOConfig, TriageGRPOTrainer

    prompts = ["Beautiful is better than", "Explicit is", "Simple is better than", "Complex is better than",
               "Flat is better than", "Sparse is better than", "Readability", "Errors should never"]
    args = TriageGRPOConfig(**{"output_dir": str(tmp_path), "learning_rate": 0.1, "per_device_train_batch_size": 3,
                               "num_generations": 3, "max_completion_length": 8, "report_to": "none",
                               "use_cpu": True, "logging_steps": 1, "save_strategy": "no", **overrides})
    return TriageGRPOTrainer(model, _reward_len, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}))


@pytest.mark.slow
def test_precision_drift_at_trl_learning_rate_warns_and_trains(tmp_path, tiny_qwen2, in_process_vllm):
    """float32 learner, bf16 sampler, lr 0.1: the gap grows past a tight bound while the sampler follows the
    learner; a warning and the metric, no error."""
    with _trainer(tmp_path, tiny_qwen2, max_steps=4, sync_probe_max_gap=0.004) as trainer:
        with pytest.warns(UserWarning, match="precision drift"):
            trainer.train()
        print(f"\nprobe gaps {trainer.sync_probe_gaps}, verdicts {trainer.sync_probe_verdicts}")
        assert trainer.state.global_step == 4 and "drift" in trainer.sync_probe_verdicts
        assert trainer.sync_probe_gaps[-1] > 0.004 > trainer.sync_probe_gaps[0]
        logged = [h for h in trainer.state.log_history if "triage/sync_probe_untracked" in h]
        assert len(logged) == 4 and all(h["triage/sync_probe_bound"] == 0.004 for h in logged)
        assert trainer.sync_probe_bound()[1].endswith("set by sync_probe_max_gap")


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["skipped", "partial"])
def test_stale_or_partial_sync_at_trl_learning_rate_stops_at_once(tmp_path, tiny_qwen2, in_process_vllm, sync):
    """Default bound; after the first sync the sampler reloads nothing (skipped) or only the first decoder block and
    the embedding (partial): the next sync's probe raises, naming a stale or partially synced sampler."""
    with _trainer(tmp_path, tiny_qwen2, max_steps=3) as trainer:
        sampler = trainer.vllm_generation
        assert trainer.sync_probe_bound() == (0.1, trainer.sync_probe_bound()[1])  # float32 vs bf16: 0.1
        real_iter = sampler._iter_sampler_weights

        def later_syncs(*args, **kwargs):
            if sampler.num_syncs == 0:
                yield from real_iter(*args, **kwargs)
            elif sync == "partial":
                yield from ((n, t) for n, t in real_iter(*args, **kwargs)
                            if "layers.1." not in n and not n.startswith(("lm_head", "model.norm")))

        sampler._iter_sampler_weights = later_syncs
        with pytest.raises(StaleSamplerError, match="stale or partially synced") as caught:
            trainer.train()
        print(f"\n{sync}: probe gaps {trainer.sync_probe_gaps}: {caught.value}")
        assert trainer.state.global_step == 1 and len(trainer.sync_probe_gaps) == 2
