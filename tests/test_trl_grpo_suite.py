# Copyright 2020-2026 The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Adapted by triage-trl from TRL's GRPO trainer tests: huggingface/trl, tests/test_grpo_trainer.py at commit
# f2cd57710ae345ea6428ae95363267fcf38a3dc8 (TRL main of 2026-07-24), run against the installed TRL 1.16.
# Changes: a subset of `TestGRPOTrainer` (every feature family TRL trains on CPU; VLM, GPU, vLLM-server, Liger,
# tool/environment and mock-only tests left out); `GRPOTrainer`/`GRPOConfig` -> `TRAINER`/`CONFIG` below
# (`TriageGRPOTrainer`/`TriageGRPOConfig` with their defaults: TRIAGE on, colocated vLLM sampler); offline: the
# Hub models and the `trl-internal-testing/zen` dataset are replaced by tiny random models of the same families
# and the Zen of Python prompts built here; `use_cpu=True` (TRL's config refuses bf16 on a CPU-only machine
# otherwise); `max_steps=2` instead of TRL's 3 epochs (two weight syncs and two sync probes per test), logged at
# each step; `scale_rewards` without its two aliases (True, "none"); each trainer is closed after its test (each
# colocated engine holds a 1 GiB KV cache; several trainers in one process, never closed, are tested in
# tests/test_trainer_close.py). The features TRIAGE cannot run are refused before any
# model loads (docs/trainer.md, "TRL features refused"): those tests assert the refusal and its remedy.
"""TRL's own GRPO trainer tests, run against ``TriageGRPOTrainer`` as a drop-in (slow: about 40 tiny trainers, each
with its colocated vLLM engine; see the header for the source and the changes)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from triage_trl.trainer import TriageGRPOConfig, TriageGRPOTrainer

pytestmark = pytest.mark.slow

TRAINER, CONFIG = TriageGRPOTrainer, TriageGRPOConfig

_ATTENTION = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64)  # vLLM's CPU attention needs head_dim >= 64
# The model families TRL's tests train, as tiny random models (shapes only; TRL's own are on the Hub).
FAMILIES = {
    "Qwen2": {k: v for k, v in _ATTENTION.items() if k != "head_dim"},
    "Qwen3": _ATTENTION,
    "Qwen3Moe": {**_ATTENTION, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
                 "decoder_sparse_step": 1, "mlp_only_layers": []},
    "Cohere2": {**_ATTENTION, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32},
    "Gemma2": {**_ATTENTION, "sliding_window": 32, "tie_word_embeddings": True},  # TRL's tiny Gemma2 is tied
    "Glm4Moe": {**_ATTENTION, "moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    # MoE with attention sinks, transposed experts with biases
    "GptOss": {**_ATTENTION, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
               "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32},
    # hybrid Mamba-2 / attention / MLP blocks
    "NemotronH": {**_ATTENTION, "num_hidden_layers": 3, "hybrid_override_pattern": "M*-", "mamba_num_heads": 4,
                  "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1},
}

ZEN = [
    "Beautiful is better than", "Explicit is", "Simple is better than", "Complex is better than",
    "Flat is better than", "Sparse is better than", "Readability", "Special cases aren't special enough",
    "Although practicality beats", "Errors should never", "Unless explicitly", "In the face of ambiguity,",
    "There should be one--", "Although that way may not be obvious at first", "Now is better than",
    "Although never is often better than", "If the implementation is hard to explain,",
    "If the implementation is easy to explain,", "Namespaces are one honking great idea --",
]


def zen(config_name: str, split: str = "train") -> Dataset:
    """The two prompt-only formats of TRL's ``zen`` test dataset (17 train rows, 2 test rows)."""
    prompts = ZEN[:17] if split == "train" else ZEN[17:]
    if config_name == "standard_prompt_only":
        return Dataset.from_dict({"prompt": prompts})
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(family)``: the folder of a tiny random ``<family>ForCausalLM`` (built once per module);
    ``tiny("reward")``: a tiny random ``Qwen2ForSequenceClassification`` (TRL's tiny reward model's family)."""
    from triage_trl.testing import save_tiny_model

    root, built = tmp_path_factory.mktemp("trl-suite-models"), {}

    def get(family: str) -> str:
        if family not in built:
            if family == "reward":
                path = save_tiny_model(root / family, "Qwen2", head="ForSequenceClassification", num_labels=1,
                                       **FAMILIES["Qwen2"])
            else:
                path = save_tiny_model(root / family, family, **FAMILIES[family])
            built[family] = str(path)
        return built[family]

    return get


@pytest.fixture(autouse=True)
def _close_trainers(in_process_vllm, monkeypatch):
    """Every trainer a test builds is closed after it (see the header)."""
    trainers = []
    init = TRAINER.__init__

    def tracked(self, *args, **kwargs):
        trainers.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(TRAINER, "__init__", tracked)
    yield
    for trainer in trainers:
        trainer.close()


def _args(tmp_path, **overrides) -> TriageGRPOConfig:
    return CONFIG(**{
        "output_dir": str(tmp_path),
        "learning_rate": 0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        "per_device_train_batch_size": 3,  # reduce the batch size to reduce memory usage
        "num_generations": 3,  # reduce the number of generations to reduce memory usage
        "max_completion_length": 8,  # reduce the completion length to reduce memory usage
        "report_to": "none",
        "use_cpu": True,
        "max_steps": 2,
        "logging_steps": 1,
        **overrides,
    })


def _train_and_check(trainer, *, trainable_only=False):
    """TRL's checks after ``trainer.train()``: a train loss, and every (trainable) parameter changed; plus the
    drop-in's own: two syncs, each probed, none judged stale."""
    previous = {n: p.clone() for n, p in trainer.model.named_parameters() if p.requires_grad or not trainable_only}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, param in previous.items():
        assert not torch.equal(param, trainer.model.get_parameter(n)), f"Parameter {n} has not changed."
    assert len(trainer.sync_probe_gaps) == 2 and set(trainer.sync_probe_verdicts) <= {"ok", "drift"}


def reward_len(completions, **kwargs):
    """Reward function that rewards longer completions."""
    return [float(len(completion)) for completion in completions]


def reward_unique_letters(completions, **kwargs):
    """Reward function that rewards completions with more unique letters."""
    return [float(len(set(completion))) for completion in completions]


# ----------------------------------------------------------------------------------------- TestGRPOTrainer


def test_init_minimal(tiny, tmp_path, monkeypatch):
    # Test that GRPOTrainer can be instantiated with only model, reward_model and train_dataset
    monkeypatch.chdir(tmp_path)  # args=None: the default output folder is named after the model, in the cwd
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"), train_dataset=zen("standard_prompt_only"))
    assert trainer.args.triage_mode == "full" and trainer.args.use_vllm and trainer.args.vllm_mode == "colocate"


@pytest.mark.parametrize("family", ["Cohere2", "Glm4Moe", "GptOss", "Qwen2", "Qwen3Moe", "NemotronH"])
def test_train(tiny, tmp_path, family):
    trainer = TRAINER(model=tiny(family), reward_funcs=tiny("reward"), args=_args(tmp_path),
                      train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)
    if trainer.aux_loss_enabled:  # MoE models log the load-balancing auxiliary loss (on by default)
        assert trainer.state.log_history[-2]["aux_loss"] is not None  # the last step's log, before the summary


@pytest.mark.parametrize("config_name", ["standard_prompt_only", "conversational_prompt_only"])
def test_train_dataset_format(tiny, tmp_path, config_name):
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"), args=_args(tmp_path),
                      train_dataset=zen(config_name))
    _train_and_check(trainer)


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo"])
def test_train_loss_types(tiny, tmp_path, loss_type):
    args = _args(tmp_path, max_completion_length=32, gradient_accumulation_steps=2, loss_type=loss_type)
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"), args=args,
                      train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_train_loss_types_refused(tmp_path, loss_type):
    # refused by design: TRIAGE weights the per-token policy-gradient term of grpo, dr_grpo, dapo and bnpo only
    with pytest.raises(NotImplementedError, match="Pick one of those, or set triage_mode='off'"):
        _args(tmp_path, importance_sampling_level="sequence" if loss_type == "luspo" else "token",
              max_completion_length=32, gradient_accumulation_steps=2, loss_type=loss_type)


def test_train_with_eval(tiny, tmp_path):
    args = _args(tmp_path, per_device_eval_batch_size=3, eval_strategy="steps", eval_steps=2)
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"), args=args,
                      train_dataset=zen("standard_prompt_only"), eval_dataset=zen("standard_prompt_only", "test"))
    trainer.train()
    assert any("eval_loss" in h for h in trainer.state.log_history)


def test_train_multiple_iterations(tiny, tmp_path):
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"), args=_args(tmp_path, num_iterations=2),
                      train_dataset=zen("standard_prompt_only"))
    previous = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()  # two optimizer steps on one generation batch: one sync
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in previous.items())
    assert len(trainer.sync_probe_gaps) == 1


def test_train_reward_func_standard(tiny, tmp_path):
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=reward_len, args=_args(tmp_path),
                      train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)


def test_train_reward_func_conversational(tiny, tmp_path):
    def reward_func(completions, **kwargs):
        """Reward function that gives higher scores to longer completion content."""
        return [float(len(completion[0]["content"])) for completion in completions]

    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=reward_func, args=_args(tmp_path),
                      train_dataset=zen("conversational_prompt_only"))
    _train_and_check(trainer)


def test_train_multiple_reward_funcs(tiny, tmp_path):
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=[reward_len, reward_unique_letters], args=_args(tmp_path),
                      train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)


def test_train_sync_and_async_reward_funcs(tiny, tmp_path):
    def sync_reward_func2(completions, **kwargs):
        return [1 for _ in completions]

    async def async_reward_func(completions, **kwargs):
        """Async Reward function that rewards completions with more unique letters."""
        return [float(len(set(completion))) for completion in completions]

    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=[reward_len, sync_reward_func2, async_reward_func],
                      args=_args(tmp_path), train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)


def test_train_multiple_reward_funcs_with_None_output(tiny, tmp_path):
    def non_applicable_reward_func(completions, **kwargs):
        """A reward function that returns None for all inputs, as it is not applicable to this sample."""
        return [None] * len(completions)

    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=[reward_len, non_applicable_reward_func],
                      args=_args(tmp_path), train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer, trainable_only=True)


def test_train_multiple_reward_funcs_with_weights(tiny, tmp_path):
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=[reward_len, reward_unique_letters],
                      args=_args(tmp_path, reward_weights=[0.7, 0.3]), train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)
    last = trainer.state.log_history[-2]  # the last step's log (the final entry is the run summary)
    for name in ("reward_len", "reward_unique_letters"):
        assert f"rewards/{name}/mean" in last and f"rewards/{name}/std" in last


def test_train_reward_func_additional_column(tiny, tmp_path):
    dataset = zen("standard_prompt_only")
    dataset = dataset.add_column("some_values", list(range(len(dataset))))

    def reward_func(completions, some_values, **kwargs):
        """Reward function that rewards completions with lengths closer to the values in some_values."""
        return [float(abs(len(c) - v)) for c, v in zip(completions, some_values, strict=True)]

    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=reward_func, args=_args(tmp_path), train_dataset=dataset)
    _train_and_check(trainer)


def test_train_with_sync_ref_model(tiny, tmp_path):
    args = _args(tmp_path, beta=0.1, sync_ref_model=True, ref_model_sync_steps=2)
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"), args=args,
                      train_dataset=zen("standard_prompt_only"))
    assert trainer.ref_model is not None
    previous_ref = {n: p.clone() for n, p in trainer.ref_model.named_parameters()}
    _train_and_check(trainer)
    for n, param in previous_ref.items():
        assert not torch.equal(param, trainer.ref_model.get_parameter(n)), f"Ref Parameter {n} has not changed."


# TRL's tests that train Qwen2 on the standard prompt-only data with one config change each (their names as ids)
@pytest.mark.parametrize("overrides", [
    pytest.param(dict(beta=0.1), id="train_beta_non_zero"),
    pytest.param(dict(pad_to_multiple_of=8), id="train_with_pad_to_multiple_of"),
    pytest.param(dict(off_policy_mask_threshold=0.5), id="train_with_off_policy_mask"),
    pytest.param(dict(top_entropy_quantile=0.2), id="train_with_entropy_filter"),
    pytest.param(dict(delta=2.0), id="train_delta_clipping"),
    pytest.param(dict(num_generations=6, gradient_accumulation_steps=2),
                 id="train_num_generations_larger_than_batch_size"),
])
def test_train_with_one_config_change(tiny, tmp_path, overrides):
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"), args=_args(tmp_path, **overrides),
                      train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)


@pytest.mark.parametrize("family", ["Qwen3", "Gemma2"])  # Gemma2 ties the embeddings and lm_head, Qwen3 does not
def test_train_with_cast_lm_head_to_fp32(tiny, tmp_path, family):
    trainer = TRAINER(model=tiny(family), reward_funcs=tiny("reward"), args=_args(tmp_path, cast_lm_head_to_fp32=True),
                      train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)
    assert trainer.model.lm_head.weight.dtype == torch.float32


def test_train_with_static_entropy(tiny, tmp_path):
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"), args=_args(tmp_path, entropy_coef=0.1),
                      train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)
    assert trainer.state.log_history[-2]["policy_loss"] is not None
    assert trainer.state.log_history[-2]["entropy_coef"] is not None


def test_train_with_adaptive_entropy(tiny, tmp_path):
    args = _args(tmp_path, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=15.0)
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"), args=args,
                      train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)
    assert trainer.entropy_coef > 0.01  # entropy < target throughout training


def test_train_with_additional_generation_kwargs_refused(tmp_path):
    # refused by design: TRIAGE compares the sampler's log-probs with the learner's, so sampling is plain
    # temperature sampling, set through the config fields (docs/trainer.md, "Sampling settings")
    with pytest.raises(ValueError, match="set `top_k` instead"):
        _args(tmp_path, generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1})


# TRL's list is [False, "group", "batch", True, "none"]; True is "group" and False is "none" in GRPOConfig
@pytest.mark.parametrize("scale_rewards", [False, "group", "batch"])
def test_train_scale_rewards(tiny, tmp_path, scale_rewards):
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"),
                      args=_args(tmp_path, scale_rewards=scale_rewards), train_dataset=zen("standard_prompt_only"))
    _train_and_check(trainer)


def test_train_sequence_importance_sampling(tiny, tmp_path):
    args = _args(tmp_path, num_iterations=2, importance_sampling_level="sequence")
    trainer = TRAINER(model=tiny("Qwen2"), reward_funcs=tiny("reward"), args=args,
                      train_dataset=zen("standard_prompt_only"))
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None and len(trainer.sync_probe_gaps) == 1
