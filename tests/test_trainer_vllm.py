"""TriageGRPOTrainer with the real sampler: vLLM's CPU build in-process (bf16 or NVFP4), tiny Qwen3 (slow).

Each configuration starts one engine and trains once (session cache ``vllm_trainers`` in conftest.py); the tests
then read its logs. Bounds on ``triage/sync_probe_gap`` (mean |learner - sampler| log-prob of the probe, nats):
bf16 learner vs bf16 sampler < 0.02 (same weights, different kernels); any NVFP4 side < 0.1 (measured ~0.05 on
this tiny random model).
"""

from __future__ import annotations

import math

import pytest
import torch

from triage_trl import METRIC_NAMES
from triage_trl.trainer import StaleSamplerError

pytestmark = pytest.mark.slow

CONFIGS = {
    "bf16-bf16": dict(learner_precision="bf16", sampler_precision="bf16"),
    "bf16-nvfp4": dict(learner_precision="bf16", sampler_precision="nvfp4"),
    "nvfp4-nvfp4": dict(learner_precision="nvfp4", sampler_precision="nvfp4"),
}
PROBE_BOUND = {"bf16-bf16": 0.02, "bf16-nvfp4": 0.1, "nvfp4-nvfp4": 0.1}


@pytest.mark.parametrize("key", list(CONFIGS))
def test_one_training_step_with_triage_full(vllm_trainers, key):
    trainer = vllm_trainers(key, **CONFIGS[key])
    logs = [h for h in trainer.state.log_history if "triage/gap_abs_mean" in h]
    assert len(logs) == 1 and trainer.state.global_step == 1
    for name in METRIC_NAMES:
        assert math.isfinite(logs[0][f"triage/{name}"]), name
    assert trainer.vllm_generation.num_syncs == 1
    assert 0 <= trainer.sync_probe_gaps[0] < PROBE_BOUND[key]
    report = trainer.kernel_report()
    assert f"sampler_precision={CONFIGS[key]['sampler_precision']}" in report["sampler"]
    if CONFIGS[key]["learner_precision"] == "nvfp4":
        assert "emulated=14" in report["learner"]


def test_skipped_sync_is_caught_and_a_real_sync_clears_it(vllm_trainers):
    trainer = vllm_trainers("bf16-bf16", **CONFIGS["bf16-bf16"])
    state = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        with torch.no_grad():  # an optimizer step the sampler never received
            for p in trainer.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        with pytest.raises(StaleSamplerError, match="stale"):
            trainer._run_sync_probe()
        trainer.vllm_generation.sync_weights()
        assert trainer._run_sync_probe() < PROBE_BOUND["bf16-bf16"]
    finally:
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                p.copy_(state[n])
        trainer.vllm_generation.sync_weights()


def test_lora_on_nvfp4_learner_with_nvfp4_sampler_two_steps(vllm_trainers):
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = vllm_trainers("lora-nvfp4", peft_config=lora, max_steps=2, learning_rate=1e-2,
                            **CONFIGS["nvfp4-nvfp4"])
    assert trainer.state.global_step == 2 and trainer.vllm_generation.num_syncs == 2
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.detach().abs().max()) > 0 for p in lora_b), "LoRA B starts at 0 and must train"
    # The second sync sent the merged (trained) weights: the probe still agrees within the NVFP4 bound.
    assert len(trainer.sync_probe_gaps) == 2 and max(trainer.sync_probe_gaps) < PROBE_BOUND["nvfp4-nvfp4"]


def test_one_calibration_set_gives_every_seed_bit_identical_sampler_scales(vllm_trainers):
    """Runs that draw other training prompts and seeds, calibrated on one fixed set (``calibration_dataset``), serve
    the same NVFP4 activation scales bit for bit (the demo and the stability lab rely on it)."""
    from triage_trl.data.arith import arith_dataset

    seed0 = vllm_trainers("nvfp4-nvfp4", **CONFIGS["nvfp4-nvfp4"])  # calibrates on its training set by default
    calibration = arith_dataset(8, seed=0)  # that same set, now passed as the calibration set
    runs = [(seed0.train_dataset["prompt"], seed0.vllm_generation.calibration_texts(),
             seed0.vllm_generation.input_global_scales)]
    for seed in (1, 2):
        with vllm_trainers.build(f"calibration-seed{seed}", train=False, seed=seed, train_seed=seed,
                                 calibration_dataset=calibration, **CONFIGS["nvfp4-nvfp4"]) as trainer:
            runs.append((trainer.train_dataset["prompt"], trainer.vllm_generation.calibration_texts(),
                         trainer.vllm_generation.input_global_scales))
    assert len({str(prompts) for prompts, _, _ in runs}) == 3, "each seed must draw other training prompts"
    (_, texts, scales), others = runs[0], runs[1:]
    assert len(texts) == 2 and len(scales) == 14
    for _, other_texts, other_scales in others:
        assert other_texts == texts
        assert other_scales.keys() == scales.keys()
        assert all(torch.equal(other_scales[k], scales[k]) for k in scales)
