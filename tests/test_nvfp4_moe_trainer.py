"""TriageGRPOTrainer on a tiny Qwen3-MoE: NVFP4 learner, NVFP4 sampler (vLLM's CPU build, in-process), TRIAGE full,
two steps; the experts' precision is the same in both engines and the kernel report says which (slow)."""

import math

import pytest
import torch

from triage_trl import METRIC_NAMES
from triage_trl.nvfp4.experts import sampler_nvfp4_moe_support

pytestmark = pytest.mark.slow
PROBE_BOUND = 0.1  # nats, as the dense tiny Qwen3's NVFP4 runs (tests/test_trainer_vllm.py)


def _train(tmp_path_factory, **precision):
    from triage_trl.data.arith import arith_dataset
    from triage_trl.rewards import digit_share_reward
    from triage_trl.testing import save_tiny_qwen3_moe
    from triage_trl.trainer import TriageGRPOConfig, TriageGRPOTrainer

    model_dir = str(save_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe-trainer")))
    args = TriageGRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trainer-moe")), use_cpu=True, bf16=False, use_vllm=True,
        vllm_mode="colocate", vllm_max_model_length=256, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=16, learning_rate=1e-3, max_steps=2, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, loss_type="grpo", nvfp4_calibration_prompts=2, triage_mode="full",
        model_init_kwargs={"dtype": torch.bfloat16}, **precision,
    )
    trainer = TriageGRPOTrainer(model=model_dir, reward_funcs=digit_share_reward, args=args,
                                train_dataset=arith_dataset(8, seed=0))
    experts = trainer.model.model.layers[0].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    trainer.train()
    trainer.moved = float((experts.gate_up_proj.detach() - before).abs().max())
    return trainer


@pytest.fixture(scope="module")
def moe_trainer(tmp_path_factory, in_process_vllm):
    trainer = _train(tmp_path_factory, learner_precision="nvfp4", sampler_precision="nvfp4")
    yield trainer
    trainer.close()


def test_two_steps_nvfp4_both_sides_triage_full(moe_trainer):
    trainer = moe_trainer
    assert trainer.state.global_step == 2 and trainer.vllm_generation.num_syncs == 2
    logs = [h for h in trainer.state.log_history if "triage/gap_abs_mean" in h]
    assert len(logs) == 2
    for name in METRIC_NAMES:
        assert all(math.isfinite(log[f"triage/{name}"]) for log in logs), name
    print(f"\nMoE sync probe gaps (nats): {trainer.sync_probe_gaps}")
    assert len(trainer.sync_probe_gaps) == 2 and max(trainer.sync_probe_gaps) < PROBE_BOUND
    assert trainer.moved > 0  # the experts' master weights trained


def test_experts_precision_is_the_same_in_both_engines_and_reported(moe_trainer):
    trainer = moe_trainer
    report = trainer.kernel_report()
    selection = trainer.nvfp4_learner_report
    if sampler_nvfp4_moe_support()[0]:
        assert "nvfp4/params_bf16_experts=0" in report["learner"]
        assert "CompressedTensorsW4A4Nvfp4MoEMethod" in report["sampler"]
        return
    # vLLM's CPU build: experts in bf16 in the learner and the sampler, attention in NVFP4 in both
    assert "nvfp4/params_nvfp4_experts=0, nvfp4/params_bf16_experts=196608" in report["learner"]
    assert "emulated=8" in report["learner"]  # q, k, v, o of 2 blocks
    assert "moe_kernels=UnquantizedFusedMoEMethod" in report["sampler"]
    assert "FastCpuNvFp4LinearKernel x4" in report["sampler"]
    assert "no NVFP4 MoE kernel" in selection.choice("model.layers.1.mlp.experts.down_proj").reason
    from triage_trl.trainer.model_card import trainer_model_card

    card = str(trainer_model_card(trainer))  # the card carries the same report
    assert "nvfp4/params_bf16_experts=196608" in card and "UnquantizedFusedMoEMethod" in card
    assert "nvfp4_moe_experts" in card


def test_nvfp4_experts_train_in_the_learner(tmp_path_factory, in_process_vllm):
    """Experts in NVFP4 in the learner (emulated W4A4) with a bf16 sampler, which needs no NVFP4 MoE kernel."""
    trainer = _train(tmp_path_factory, learner_precision="nvfp4", sampler_precision="bf16",
                     nvfp4_moe_experts="nvfp4")
    try:
        assert trainer.state.global_step == 2 and trainer.moved > 0
        report = trainer.kernel_report()
        assert "nvfp4/params_nvfp4_experts=196608, nvfp4/params_bf16_experts=0" in report["learner"]
        assert "emulated=12" in report["learner"]  # q, k, v, o, gate_up, down of 2 blocks
        assert type(trainer.model.model.layers[1].mlp.experts).__name__ == "NVFP4EmulatedExperts"
        print(f"\nNVFP4-experts learner vs bf16 sampler, probe gaps (nats): {trainer.sync_probe_gaps}")
        assert max(trainer.sync_probe_gaps) < PROBE_BOUND
    finally:
        trainer.close()
