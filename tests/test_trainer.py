"""TriageGRPOTrainer on CPU with hand-built batches and a transformers stand-in for vLLM (fast tests).

The real vLLM sampler is exercised in tests/test_trainer_vllm.py (slow). Here, ``FakeSampler`` takes the place of
``TriageVLLMGeneration`` through the trainer's one sampler seam (``_sampler_factory``): it samples with a copy of
the policy loaded from disk, returns processed log-probs (after temperature) plus an optional offset, and copies
the learner's weights on ``sync_weights`` and then runs ``on_sync`` (the trainer's probe), like the real sampler.
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from triage_trl import METRIC_NAMES, segment_ids, triage_weights
from triage_trl.trainer import StaleSamplerError, TriageGRPOConfig, TriageGRPOTrainer

B, P, T = 4, 5, 8


class FakeSampler:
    """Stand-in for TriageVLLMGeneration: same constructor keywords, generate/sync_weights/score_logps."""

    logprob_offset = 0.0  # added to every returned sampler log-prob (a synthetic mismatch), nats

    def __init__(self, model, accelerator, processing_class, temperature=1.0, max_completion_length=16, **kwargs):
        self.model = model
        self.temperature = temperature
        self.max_completion_length = max_completion_length
        self.kwargs = kwargs
        self.policy = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32).eval()
        self.eos = processing_class.eos_token_id
        self.syncs = 0
        self.on_sync = None
        self.kernel_report = {}

    def sync_weights(self):
        model = self.model
        if hasattr(model, "merge_adapter"):  # PEFT: send merged weights under the base model's names
            model.merge_adapter()
            state = {
                k.removeprefix("base_model.model.").replace(".base_layer", ""): v.clone()
                for k, v in model.state_dict().items() if "lora_" not in k
            }
            model.unmerge_adapter()
        else:
            state = model.state_dict()
        self.policy.load_state_dict(state)
        self.syncs += 1
        if self.on_sync is not None:
            self.on_sync()

    @torch.no_grad()
    def _logps(self, ids: list[int], temperature: float | None = None) -> torch.Tensor:
        logits = self.policy(torch.tensor([ids])).logits[0, :-1].float() / (temperature or self.temperature)
        return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]

    def score_logps(self, token_ids_list, temperature=None):
        return [self._logps(ids, temperature) + self.logprob_offset for ids in token_ids_list]

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        completions, logprobs = [], []
        for ids in prompts:
            out = self.policy.generate(
                torch.tensor([ids]), do_sample=True, temperature=self.temperature, top_k=0,
                max_new_tokens=self.max_completion_length, eos_token_id=self.eos, pad_token_id=self.eos,
            )[0, len(ids):].tolist()
            if self.eos in out:
                out = out[: out.index(self.eos) + 1]
            completions.append(out)
            lps = self._logps(list(ids) + out)[-len(out):] + self.logprob_offset
            logprobs.append([[float(x)] for x in lps])
        return prompts, completions, logprobs, None


@pytest.fixture
def fake_sampler(monkeypatch):
    def factory(self, args, train_dataset, built):
        def make(*a, **kw):
            built.append(FakeSampler(*a, **kw))
            return built[-1]

        return make if args.use_vllm else None

    monkeypatch.setattr(TriageGRPOTrainer, "_sampler_factory", factory)
    FakeSampler.logprob_offset = 0.0
    return FakeSampler


def _reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _dataset(n=8):
    return Dataset.from_dict({"prompt": [f"What is {i} + {i}?\n" for i in range(n)]})


def _args(cls, tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=B,
        num_generations=B,
        max_completion_length=T,
        learning_rate=1e-3,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        loss_type="grpo",
        model_init_kwargs={"dtype": torch.float32},
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def _trainer(cls, tmp_path, model_dir, **overrides):
    trainer_cls = TriageGRPOTrainer if cls is TriageGRPOConfig else GRPOTrainer
    trainer = trainer_cls(
        model=model_dir, reward_funcs=_reward_len, args=_args(cls, tmp_path, **overrides), train_dataset=_dataset()
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _batch(trainer, *, seed=0, sampler_shift=None):
    """A hand-built micro-batch with ragged completions, newline tokens and rollout-time learner log-probs."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(trainer.processing_class)
    newline = trainer.processing_class("\n", add_special_tokens=False)["input_ids"][0]
    completion_ids = torch.randint(10, vocab, (B, T), generator=g)
    completion_ids[:, 3] = newline
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[1, 6:] = 0
    completion_mask[3, 4:] = 0
    inputs = {
        "prompt_ids": torch.randint(10, vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.25, -1.5]),
        "num_items_in_batch": completion_mask.sum(),
    }
    with torch.no_grad():
        old, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], completion_ids], 1),
            torch.cat([inputs["prompt_mask"], completion_mask], 1),
            T,
        )
    inputs["old_per_token_logps"] = old
    shift = sampler_shift if sampler_shift is not None else 0.3 * torch.randn(B, T, generator=g)
    inputs["sampling_per_token_logps"] = old - shift
    return inputs


def _loss_and_grads(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


# ---------------------------------------------------------------------------------------------- config


def test_a_bad_triage_or_nvfp4_value_is_named_before_transformers_device_checks(tmp_path):
    # no use_cpu on a CPU machine: transformers would refuse TRL's bf16 default first, hiding the bad value
    with pytest.raises(ValueError, match="nvfp4_recipe"):
        TriageGRPOConfig(output_dir=str(tmp_path), nvfp4_recipe="nvfp4_paper")
    with pytest.raises(ValueError, match="triage_mode"):
        TriageGRPOConfig(output_dir=str(tmp_path), triage_mode="fulll")


def test_config_defaults_turn_trl_correction_off_and_resolve_probe_bound(tmp_path):
    args = _args(TriageGRPOConfig, tmp_path)
    assert args.triage_mode == "full" and args.vllm_importance_sampling_correction is False
    assert args.resolved_sync_probe_max_gap == 0.1
    assert _args(TriageGRPOConfig, tmp_path, triage_mode="off").vllm_importance_sampling_correction is True
    mixed = _args(TriageGRPOConfig, tmp_path, use_vllm=True, sampler_precision="nvfp4")
    assert mixed.resolved_sync_probe_max_gap == 2.0  # W4A4 on the sampler: SmolLM2-135M measures 0.78-1.18 nats
    weight_only = _args(TriageGRPOConfig, tmp_path, use_vllm=True, sampler_precision="nvfp4",
                        nvfp4_sampler_kernel="weight_only")
    assert weight_only.resolved_sync_probe_max_gap == 0.5
    assert _args(TriageGRPOConfig, tmp_path, sync_probe_max_gap=0.02).resolved_sync_probe_max_gap == 0.02
    # The learner mirrors the sampler's NVFP4 scales only when there is an NVFP4 sampler to mirror.
    both = _args(TriageGRPOConfig, tmp_path, use_vllm=True, sampler_precision="nvfp4", learner_precision="nvfp4")
    assert both.resolved_nvfp4_learner_scales == "sampler" and both.nvfp4_emulation_dtype == "auto"
    assert mixed.resolved_nvfp4_learner_scales == "dynamic" and args.resolved_nvfp4_learner_scales == "dynamic"


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"vllm_importance_sampling_correction": True}, ValueError, "twice"),
        ({"loss_type": "cispo"}, NotImplementedError, "loss_type='cispo'"),
        ({"loss_type": "sapo"}, NotImplementedError, "grpo, dr_grpo, dapo, bnpo"),
        ({"top_p": 0.9}, ValueError, "top_p=0.9"),
        ({"top_k": 20}, ValueError, "top_k=20"),
        ({"repetition_penalty": 1.1}, ValueError, "repetition_penalty"),
        ({"generation_kwargs": {"min_p": 0.1}}, ValueError, "set `min_p` instead"),
        ({"generation_kwargs": {"presence_penalty": 0.5}}, ValueError, "presence_penalty=0.5"),
        ({"learner_precision": "fp8"}, ValueError, "learner_precision"),
        ({"sampler_precision": "nvfp4", "triage_mode": "off"}, ValueError, "use_vllm=True"),
        ({"sampler_precision": "nvfp4", "vllm_mode": "server"}, NotImplementedError, "colocate"),
        ({"generation_kwargs": {"temperature": 0.5}}, ValueError, "set `temperature` instead"),
        ({"generation_kwargs": {"logprobs": 5}}, ValueError, "'logprobs'"),
        ({"triage_mode": "off", "use_vllm": True, "top_p": 0.9}, ValueError, "TRL's vLLM importance-sampling correction"),
        ({"nvfp4_keep_first_blocks": -1}, ValueError, "nvfp4_keep_first_blocks"),
        ({"nvfp4_calibration_prompts": 0}, ValueError, "nvfp4_calibration_prompts"),
        ({"nvfp4_learner_scales": "sampler"}, ValueError, "nvfp4_learner_scales='dynamic'"),
        ({"nvfp4_learner_scales": "static"}, ValueError, "nvfp4_learner_scales='static'"),
        ({"nvfp4_emulation_dtype": "fp16"}, ValueError, "nvfp4_emulation_dtype"),
        ({"sync_probe_max_gap": 0.0}, ValueError, "sync_probe_max_gap"),
        ({"triage_tail_quantile": 1.5}, ValueError, "triage_tail_quantile"),
    ],
)
def test_config_validation_errors(tmp_path, overrides, error, match):
    with pytest.raises(error, match=match):
        _args(TriageGRPOConfig, tmp_path, **overrides)


def test_config_allows_trl_correction_in_diagnose_and_any_loss_when_off(tmp_path):
    diag = _args(TriageGRPOConfig, tmp_path, triage_mode="diagnose", vllm_importance_sampling_correction=True)
    assert diag.vllm_importance_sampling_correction is True
    off = _args(TriageGRPOConfig, tmp_path, triage_mode="off", loss_type="cispo", use_vllm=True, top_p=0.9,
                vllm_importance_sampling_correction=False)
    assert off.loss_type == "cispo" and not off.uses_trl_is_hook


def test_triage_needs_the_vllm_sampler_and_turns_it_on_by_default(tmp_path):
    with pytest.raises(ValueError, match="use_vllm=True"):
        _args(TriageGRPOConfig, tmp_path, use_vllm=False)
    assert _args(TriageGRPOConfig, tmp_path).use_vllm is True  # TRL's quickstart call needs no use_vllm
    assert _args(TriageGRPOConfig, tmp_path, triage_mode="off").use_vllm is False  # TRL's default


@pytest.mark.parametrize("calibration", [[], [{"question": "no prompt column"}]], ids=["empty", "no-prompt"])
def test_trainer_refuses_a_calibration_dataset_without_prompts(tmp_path, tiny_qwen3_dir, calibration):
    args = _args(TriageGRPOConfig, tmp_path)
    with pytest.raises(ValueError, match="calibration_dataset has no prompt"):
        TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=_reward_len, args=args, train_dataset=_dataset(),
                          calibration_dataset=calibration)


def test_trainer_refuses_rollout_func(tmp_path, tiny_qwen3_dir):
    args = _args(TriageGRPOConfig, tmp_path)
    with pytest.raises(NotImplementedError, match="rollout_func"):
        TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=_reward_len, args=args, train_dataset=_dataset(),
                          rollout_func=lambda prompts, trainer: {})


def test_diagnose_keeps_trl_correction_when_asked(tmp_path, tiny_qwen3_dir, fake_sampler):
    """diagnose + vllm_importance_sampling_correction=True: TRL's ratio reaches the loss, TRIAGE only measures."""
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True, triage_mode="diagnose",
                       vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate")
    inputs = _batch(trainer)
    ones, _ = _loss_and_grads(trainer, {**inputs, "importance_sampling_ratio": torch.ones(B, T)})
    twos, _ = _loss_and_grads(trainer, {**inputs, "importance_sampling_ratio": torch.full((B, T), 2.0)})
    torch.testing.assert_close(twos, 2 * ones, rtol=1e-6, atol=0)
    assert math.isfinite(trainer.triage_history[-1]["gap_abs_mean"])


def test_trainer_refuses_plain_grpo_config(tmp_path, tiny_qwen3_dir):
    with pytest.raises(TypeError, match="TriageGRPOConfig"):
        TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=_reward_len, args=_args(GRPOConfig, tmp_path),
                          train_dataset=_dataset())


# ---------------------------------------------------------------------------------------------- loss


def test_diagnose_equals_plain_grpo_loss_and_gradients(tmp_path, tiny_qwen3_dir, fake_sampler):
    triage = _trainer(TriageGRPOConfig, tmp_path / "t", tiny_qwen3_dir, use_vllm=True, triage_mode="diagnose")
    plain = _trainer(GRPOConfig, tmp_path / "p", tiny_qwen3_dir)
    inputs = _batch(triage)
    loss_t, grads_t = _loss_and_grads(triage, inputs)
    loss_p, grads_p = _loss_and_grads(plain, inputs)
    assert torch.equal(loss_t, loss_p)
    assert grads_t.keys() == grads_p.keys() and len(grads_t) > 0
    for name in grads_t:
        assert torch.equal(grads_t[name], grads_p[name]), name
    for name in METRIC_NAMES:  # diagnose still measures everything
        assert math.isfinite(triage.triage_history[-1][name]), name


def test_off_mode_is_plain_grpo(tmp_path, tiny_qwen3_dir, fake_sampler):
    triage = _trainer(TriageGRPOConfig, tmp_path / "t", tiny_qwen3_dir, use_vllm=True, triage_mode="off",
                      vllm_importance_sampling_correction=False)
    plain = _trainer(GRPOConfig, tmp_path / "p", tiny_qwen3_dir)
    inputs = _batch(triage)
    assert torch.equal(_loss_and_grads(triage, inputs)[0], _loss_and_grads(plain, inputs)[0])
    assert triage.triage_history == [] and triage.triage_metrics.pop("train") == {}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_full_mode_scales_loss_by_the_repair_weight(tmp_path, tiny_qwen3_dir, fake_sampler, loss_type):
    """Every valid token severe with excess log(1.5), no hot segment: every weight is 1.5, so loss and grads x1.5."""
    common = dict(use_vllm=True, loss_type=loss_type, triage_hot_min_tokens=10_000)
    full = _trainer(TriageGRPOConfig, tmp_path / "f", tiny_qwen3_dir, **common)
    diag = _trainer(TriageGRPOConfig, tmp_path / "d", tiny_qwen3_dir, triage_mode="diagnose", **common)
    inputs = _batch(full, sampler_shift=torch.full((B, T), math.log(2.0) + math.log(1.5)))
    loss_f, grads_f = _loss_and_grads(full, inputs)
    loss_d, grads_d = _loss_and_grads(diag, inputs)
    assert full.triage_history[-1]["weight_min"] == pytest.approx(1.5, rel=1e-6)
    assert full.triage_history[-1]["weight_max"] == pytest.approx(1.5, rel=1e-6)
    torch.testing.assert_close(loss_f, 1.5 * loss_d, rtol=1e-6, atol=0)
    for name in grads_d:
        scale = float(grads_d[name].abs().max())  # float32 cancellation: tolerance relative to the tensor's scale
        torch.testing.assert_close(grads_f[name], 1.5 * grads_d[name], rtol=1e-5, atol=1e-5 * scale)


def test_full_mode_loss_equals_weighted_closed_form(tmp_path, tiny_qwen3_dir, fake_sampler):
    """With old == current log-probs the GRPO per-token loss is -A; the loss is mean_b(-A_b * masked_mean_t(w))."""
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True, loss_type="grpo",
                       triage_tail_quantile=0.5, triage_hot_density=0.0)
    inputs = _batch(trainer, seed=3)
    loss, _ = _loss_and_grads(trainer, inputs)
    mask = inputs["completion_mask"]
    seg = segment_ids(inputs["completion_ids"], newline_table=trainer._newline_table)
    w = triage_weights(inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], inputs["advantages"],
                       mask, seg, trainer.args).weights
    assert not torch.all(w == 1.0), "the batch must exercise non-trivial weights"
    expected = (-inputs["advantages"] * (w * mask).sum(1) / mask.sum(1)).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)


def test_metrics_present_finite_and_nonfinite_sampler_counted(tmp_path, tiny_qwen3_dir, fake_sampler):
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True, triage_nonfinite_max_frac=0.1)
    inputs = _batch(trainer)
    inputs["sampling_per_token_logps"][0, 1] = float("nan")  # vLLM's unscorable token (TRL maps None to NaN)
    inputs["sampling_per_token_logps"][2, 0] = float("-inf")
    loss, _ = _loss_and_grads(trainer, inputs)
    assert math.isfinite(float(loss))
    assert len(trainer.triage_history) == 1
    metrics = trainer.triage_history[0]
    for name in METRIC_NAMES:
        assert math.isfinite(metrics[name]), name
    assert metrics["nonfinite_sampler_frac"] == pytest.approx(2 / int(inputs["completion_mask"].sum()))
    assert metrics["weight_min"] == 0.0  # a log-prob nobody can trust gives no update
    logged = trainer.triage_metrics.pop("train")
    assert logged["triage/nonfinite_sampler_frac"] == metrics["nonfinite_sampler_frac"]


def test_broken_sampler_log_probs_stop_the_step(tmp_path, tiny_qwen3_dir, fake_sampler):
    from triage_trl import NonFiniteSamplerLogprobsError

    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir)  # default bound: 1% of valid tokens
    inputs = _batch(trainer)
    inputs["sampling_per_token_logps"][0, 1] = float("nan")
    with pytest.raises(NonFiniteSamplerLogprobsError):
        trainer.compute_loss(trainer.model, inputs)


def _reward_constant(completions, **kwargs):
    return [0.35] * len(completions)  # TRL's advantage of such a group is +2.98e-4, not 0


def test_zero_signal_groups_get_weight_one_through_the_training_loop(tmp_path, tiny_qwen3_dir, fake_sampler):
    """Severe mismatch everywhere (gap 1 nat > log 2) but every group's rewards are equal: no token is repaired."""
    fake_sampler.logprob_offset = -1.0
    args = _args(TriageGRPOConfig, tmp_path, max_steps=1, sync_probe_max_gap=2.0)
    trainer = TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=_reward_constant, args=args, train_dataset=_dataset())
    trainer.train()
    record = trainer.triage_history[0]
    assert record["gap_abs_mean"] > 0.9  # the mismatch is there and measured
    assert record["repaired_frac"] == 0.0 and record["weight_min"] == record["weight_max"] == 1.0
    assert record["frac_NA"] == record["frac_PA"] == record["frac_NC"] == record["frac_PC"] == 0.0
    logged = [h for h in trainer.state.log_history if "triage/zero_signal_frac" in h][0]
    assert logged["triage/zero_signal_frac"] == 1.0


def test_missing_sampler_logprobs_error_names_the_fix(tmp_path, tiny_qwen3_dir, fake_sampler):
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True)
    inputs = _batch(trainer)
    del inputs["sampling_per_token_logps"]
    with pytest.raises(ValueError, match="sampling_per_token_logps.*use_vllm=True"):
        trainer.compute_loss(trainer.model, inputs)


def test_trl_ratio_never_reaches_the_loss(tmp_path, tiny_qwen3_dir, fake_sampler):
    """A stray TRL ratio in the batch is overwritten by TRIAGE's weights."""
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True)
    inputs = _batch(trainer)
    clean, _ = _loss_and_grads(trainer, inputs)
    stray, _ = _loss_and_grads(trainer, {**inputs, "importance_sampling_ratio": torch.full((B, T), 3.0)})
    assert torch.equal(clean, stray)
    # One source of truth: the hook TRL's loss reads is the config's property; TRL's own ratio is off in the args.
    assert trainer.vllm_importance_sampling_correction is trainer.args.uses_trl_is_hook is True
    assert trainer.args.vllm_importance_sampling_correction is False and trainer.args.triage_replaces_trl_ratio


def test_fused_rollout_logps_give_the_loss_grads_and_metrics_of_trls_separate_forward(tmp_path, tiny_qwen3_dir,
                                                                                      fake_sampler):
    """On-policy, the loss forward's detached log-probs are the rollout-time ones: skipping TRL's rollout forward
    (TriageGRPOConfig.fuses_rollout_logps) changes no loss, gradient or TRIAGE metric."""
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True)
    assert trainer.args.fuses_rollout_logps
    inputs = _batch(trainer)
    separate, separate_grads = _loss_and_grads(trainer, inputs)
    separate_metrics = trainer.triage_metrics.pop("train")
    fused_inputs = {k: v for k, v in inputs.items() if k != "old_per_token_logps"}
    fused, fused_grads = _loss_and_grads(trainer, fused_inputs)
    fused_metrics = trainer.triage_metrics.pop("train")
    torch.testing.assert_close(fused, separate)
    assert fused_grads.keys() == separate_grads.keys()
    for name, grad in separate_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, msg=name)
    assert fused_metrics.keys() == separate_metrics.keys()
    for name, value in separate_metrics.items():
        assert fused_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert trainer._metrics["train"]["sampling/sampling_logp_difference/mean"][-1] > 0.0  # TRL's metric kept
    assert "_get_per_token_logps_and_entropies" not in trainer.__dict__  # the class's method again
    calls = []
    own = trainer._get_per_token_logps_and_entropies

    def counted(*args, **kwargs):  # an instance wrapper (as benchmarks/bench_step.py's) survives the fused loss
        calls.append(1)
        return own(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counted
    again, _ = _loss_and_grads(trainer, fused_inputs)
    torch.testing.assert_close(again, separate)
    assert calls == [1] and trainer.__dict__["_get_per_token_logps_and_entropies"] is counted
    del trainer._get_per_token_logps_and_entropies
    stray, _ = _loss_and_grads(trainer, {**fused_inputs, "importance_sampling_ratio": torch.full((B, T), 3.0)})
    torch.testing.assert_close(stray, separate)  # a stray TRL ratio never reaches the fused loss either
    # off-policy batches (2 updates per rollout) and the switch keep TRL's separate forward
    assert not _args(TriageGRPOConfig, tmp_path, use_vllm=True, num_iterations=2).fuses_rollout_logps
    assert not _args(TriageGRPOConfig, tmp_path, use_vllm=True, triage_fuse_rollout_logps=False).fuses_rollout_logps
    assert not _args(TriageGRPOConfig, tmp_path, use_vllm=True, triage_mode="diagnose",
                     vllm_importance_sampling_correction=True).fuses_rollout_logps


def test_shared_prompt_forward_gives_the_loss_and_gradients_of_trls_rows(tmp_path, tiny_qwen3_dir, fake_sampler,
                                                                          monkeypatch):
    """Rows sharing a prompt (GRPO's groups) are scored once per group by default (trainer/shared_prompt.py): the
    loss, gradients and TRIAGE metrics of TRL's row-by-row forward, up to float summation order."""
    import triage_trl.trainer.grpo_trainer as trainer_module

    shared = _trainer(TriageGRPOConfig, tmp_path / "s", tiny_qwen3_dir, use_vllm=True)
    rows = _trainer(TriageGRPOConfig, tmp_path / "r", tiny_qwen3_dir, use_vllm=True, triage_shared_prompt_forward=False)
    assert shared.shared_prompt_forward and not rows.shared_prompt_forward
    assert shared.kernel_report()["learner_forward"].startswith("shared prompt")
    assert rows.kernel_report()["learner_forward"].startswith("TRL's rows (triage_shared_prompt_forward=False; ")
    inputs = _batch(rows)
    for key in ("prompt_ids", "prompt_mask"):  # two groups of two completions
        inputs[key] = inputs[key][[0, 0, 1, 1]]
    inputs["prompt_mask"][:2, :2] = 0  # the first prompt left-padded
    inputs.pop("old_per_token_logps")
    calls = []
    packed = trainer_module.shared_prompt_logps
    monkeypatch.setattr(trainer_module, "shared_prompt_logps", lambda *a, **k: calls.append(1) or packed(*a, **k))
    loss_r, grads_r = _loss_and_grads(rows, inputs)
    assert calls == []
    loss_s, grads_s = _loss_and_grads(shared, inputs)
    assert calls == [1]
    torch.testing.assert_close(loss_s, loss_r, atol=1e-6, rtol=1e-5)
    assert grads_s.keys() == grads_r.keys() and len(grads_s) > 0
    for name, grad in grads_r.items():
        torch.testing.assert_close(grads_s[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert shared.learner_forwards == {"shared_prompt": 1, "rows": 0} and rows.learner_forwards["shared_prompt"] == 0
    for name, value in rows.triage_history[-1].items():
        assert shared.triage_history[-1][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


def test_shared_prompt_forward_required_for_an_unsupported_model_is_refused_before_it_loads(tmp_path, tiny_qwen3_dir,
                                                                                           monkeypatch):
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    args = _args(TriageGRPOConfig, tmp_path, use_vllm=True, triage_shared_prompt_forward=True,
                 model_init_kwargs={"dtype": torch.float32, "attn_implementation": "flash_attention_2"})
    with pytest.raises(ValueError, match=r"triage_shared_prompt_forward=True, but attn_implementation="
                                         r"'flash_attention_2' takes no custom 4-D mask"):
        TriageGRPOTrainer(model=tiny_qwen3_dir, reward_funcs=_reward_len, args=args, train_dataset=_dataset())


# ---------------------------------------------------------------------------------------------- training loop


def test_training_steps_with_stand_in_sampler(tmp_path, tiny_qwen3_dir, fake_sampler):
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True, max_steps=2,
                       learning_rate=1e-4)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "triage/gap_abs_mean" in h]
    assert len(logs) == 2
    for entry in logs:
        for name in METRIC_NAMES:
            assert math.isfinite(entry[f"triage/{name}"]), name
        assert entry["triage/sync_probe_gap"] < 1e-4  # the stand-in copies the weights exactly
        assert 0.0 <= entry["triage/zero_signal_frac"] <= 1.0
        assert not any(k.startswith("sampling/importance_sampling_ratio") for k in entry)
        assert "sampling/sampling_logp_difference/mean" in entry  # TRL's own mismatch metric still logged
    assert trainer.vllm_generation.syncs == 2
    assert len(trainer.sync_probe_gaps) == 2

    trainer.create_model_card(model_name="tiny-triage", dataset_name="openai/gsm8k")  # the CLI calls it
    card = ModelCard.load(tmp_path / "README.md")
    assert {"trl", "grpo", "triage", "nvfp4"} <= set(card.data.tags)
    assert card.data.pipeline_tag == "text-generation" and card.data.datasets == ["openai/gsm8k"]
    assert card.data.model_name == "tiny-triage" and card.data.library_name == "transformers"
    assert card.data.base_model is None  # a random local model names no Hub model, and no link says "None"
    assert "huggingface.co/None" not in card.text and f'model="{tmp_path}"' in card.text
    text = card.text
    assert "2610.07043" in text and "@article{triage2026nvfp4" in text
    assert "reconstructed from the abstract" in text
    assert "| `triage_mode` | `full` |" in text and "| `sampler_precision` | `bf16` |" in text
    assert "| metric | step 1 | step 2 |" in text and "`triage/gap_abs_mean`" in text  # the logs' steps
    assert "Kernels that ran" in text


def test_skipped_sync_is_caught_before_the_batch_trains(tmp_path, tiny_qwen3_dir, fake_sampler):
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True, max_steps=3, learning_rate=5e-2)
    first = trainer.vllm_generation.sync_weights
    calls = {"n": 0}

    def sync_once():  # the first sync works, every later one is skipped entirely (no reload, no probe)
        calls["n"] += 1
        if calls["n"] == 1:
            first()

    trainer.vllm_generation.sync_weights = sync_once
    with pytest.raises(StaleSamplerError, match="at step 1 without a weight sync since step 0"):
        trainer.train()
    assert trainer.state.global_step == 1 and len(trainer.sync_probe_gaps) == 1


def _loads_only_at_the_first_sync(sampler) -> None:
    """Make ``sampler``'s first sync load the weights and every later one only report success (run ``on_sync``)."""
    real_sync = sampler.sync_weights
    calls = {"n": 0}

    def reload_that_does_nothing():
        calls["n"] += 1
        if calls["n"] == 1:
            return real_sync()
        sampler.on_sync()

    sampler.sync_weights = reload_that_does_nothing


def test_sync_that_loads_nothing_is_caught_by_the_probe(tmp_path, tiny_qwen3_dir, fake_sampler):
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True, max_steps=3,
                       learning_rate=5e-2, sync_probe_max_gap=1e-3)
    _loads_only_at_the_first_sync(trainer.vllm_generation)
    with pytest.raises(StaleSamplerError, match="stale"):
        trainer.train()
    assert trainer.sync_probe_gaps[0] < 1e-4 and trainer.sync_probe_gaps[-1] > 1e-3


def test_probe_runs_after_the_first_sync_and_every_nth(tmp_path, tiny_qwen3_dir, fake_sampler):
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True, max_steps=5, learning_rate=1e-4,
                       sync_probe_every=2)
    trainer.train()
    assert trainer.vllm_generation.syncs == 5
    assert trainer.sync_probe_steps == [0, 2, 4] and len(trainer.sync_probe_gaps) == 3
    probed = [h["step"] for h in trainer.state.log_history if "triage/sync_probe_gap" in h]
    assert probed == [1, 3, 5]  # logged with the step the probed sync started
    batches = [h for h in trainer.state.log_history if "triage/gap_abs_mean" in h]
    assert len(batches) == 5 and all(math.isfinite(h["triage/k3_kl"]) for h in batches)  # every step's batch gap


def test_a_sync_that_loads_nothing_is_caught_at_the_next_probe(tmp_path, tiny_qwen3_dir, fake_sampler):
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True, max_steps=6,
                       learning_rate=5e-2, sync_probe_max_gap=1e-3, sync_probe_every=3)
    _loads_only_at_the_first_sync(trainer.vllm_generation)
    with pytest.raises(StaleSamplerError, match="stale"):
        trainer.train()
    assert trainer.state.global_step == 3 and trainer.sync_probe_steps == [0, 3]


@pytest.mark.parametrize("every", [0, -1, True, 1.5, "2"])
def test_sync_probe_every_out_of_range_is_refused(tmp_path, every):
    with pytest.raises(ValueError, match="sync_probe_every=.* whole number >= 1"):
        TriageGRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, sync_probe_every=every)


def test_corrupt_sampler_is_caught_by_the_probe(tmp_path, tiny_qwen3_dir, fake_sampler):
    fake_sampler.logprob_offset = -0.5
    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True, max_steps=1)
    with pytest.raises(StaleSamplerError, match="0.5 nats"):
        trainer.train()


@pytest.mark.slow
def test_nvfp4_learner_trains_and_logs_its_layers(tmp_path, tiny_qwen3_dir, fake_sampler):
    from triage_trl.nvfp4.learner import NVFP4EmulatedLinear

    trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, use_vllm=True, learner_precision="nvfp4",
                       max_steps=1, learning_rate=1e-4)
    converted = [m for m in trainer.model.modules() if isinstance(m, NVFP4EmulatedLinear)]
    assert len(converted) == 14  # 2 blocks x (q, k, v, o, gate, up, down)
    assert trainer.nvfp4_learner_report.summary()["nvfp4/layers_nvfp4"] == 14
    trainer.train()
    first = next(h for h in trainer.state.log_history if "triage/gap_abs_mean" in h)
    assert first["nvfp4/emulated"] == 14.0 and first["nvfp4/kept_bf16"] == 1.0 and first["nvfp4/layers_bf16"] == 1.0
    # bf16 stand-in sampler vs NVFP4 learner: the gap is the W4A4 quantisation mismatch, under the 0.5 default.
    assert 1e-4 < trainer.sync_probe_gaps[0] < 0.5
    assert "emulated=14" in trainer.kernel_report()["learner"]


@pytest.mark.slow
def test_lora_on_nvfp4_learner_trains_two_steps(tmp_path, tiny_qwen3_dir, fake_sampler):
    from peft import LoraConfig

    from triage_trl.nvfp4.learner import NVFP4EmulatedLinear

    args = _args(TriageGRPOConfig, tmp_path, use_vllm=True, learner_precision="nvfp4", max_steps=2,
                 learning_rate=1e-2)
    trainer = TriageGRPOTrainer(
        model=tiny_qwen3_dir, reward_funcs=_reward_len, args=args, train_dataset=_dataset(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"],
                               task_type="CAUSAL_LM"),
    )
    lora_b = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "base_layer.weight" in n}
    assert len(lora_b) == 6 and len(base) == 6
    bases = [m.base_layer for m in trainer.model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert bases and all(isinstance(b, NVFP4EmulatedLinear) for b in bases)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(after[n], v) for n, v in lora_b.items()), "LoRA adapters must train"
    for n, v in base.items():  # frozen; only the sync's merge/unmerge round trip (as in TRL) may round them
        assert not after[n].requires_grad
        torch.testing.assert_close(after[n], v, rtol=0, atol=1e-6)
    assert len(trainer.sync_probe_gaps) == 2 and all(g < 0.5 for g in trainer.sync_probe_gaps)


def test_sampler_is_seeded_with_the_run_seed(tmp_path, monkeypatch):
    import triage_trl.sampler.vllm_generation as engine

    seen = {}
    monkeypatch.setattr(engine, "TriageVLLMGeneration", lambda *a, **kw: seen.update(kw))
    built = []
    factory = TriageGRPOTrainer._sampler_factory(None, _args(TriageGRPOConfig, tmp_path, seed=7), _dataset(), built)
    factory(None, None, None)
    assert seen["sampler_seed"] == 7 and seen["calibration_prompts"] == _dataset()["prompt"][:16] and built == [None]


def test_user_args_are_unchanged_by_construction(tmp_path, tiny_qwen3_dir, fake_sampler):
    """TRL loads the model with its own rules (model_init_kwargs copied, never cleared) and the learner is converted
    after, on the trainer's device: the config the user built is the config the run reports."""
    import copy

    args = _args(TriageGRPOConfig, tmp_path, learner_precision="nvfp4", model_init_kwargs={"dtype": torch.float32})
    before, init_kwargs = copy.deepcopy(args.to_dict()), copy.deepcopy(args.model_init_kwargs)
    trainer = TriageGRPOTrainer(tiny_qwen3_dir, reward_funcs=_reward_len, args=args, train_dataset=_dataset())
    assert trainer.args is args and args.to_dict() == before
    assert args.model_init_kwargs == init_kwargs and args.model_init_kwargs  # not cleared (the old loader did)
    assert trainer.nvfp4_learner_report.summary()["nvfp4/layers_nvfp4"] == 14
    assert {p.device.type for p in trainer.model.parameters()} == {trainer.accelerator.device.type}


def test_the_probe_scores_at_temperature_1_in_both_engines(tmp_path, tiny_qwen3_dir, fake_sampler):
    """The sync probe asks the sampler for temperature-1 log-probs (no full-vocabulary prompt log-probs) and scores
    the learner at temperature 1 too, then puts the sampling temperature back."""
    asked = []
    score = fake_sampler.score_logps

    def spy(self, token_ids_list, temperature=None):
        asked.append(temperature)
        return score(self, token_ids_list, temperature)

    fake_sampler.score_logps = spy
    try:
        trainer = _trainer(TriageGRPOConfig, tmp_path, tiny_qwen3_dir, temperature=0.7)
        trainer.sync_sampler()  # the sync runs the probe
        gap = trainer.sync_probe_gaps[-1]
    finally:
        fake_sampler.score_logps = score
    assert asked and set(asked) == {1.0}
    assert trainer.temperature == 0.7 and gap < 1e-4  # same weights, same temperature: the engines agree
