"""LoRA configurations the sampler sync cannot serve are refused before the model loads
(``trainer.run_checks.check_sampler_peft_config``)."""

import pytest
from peft import LoraConfig

from triage_trl.trainer.run_checks import check_sampler_peft_config


@pytest.mark.parametrize("config, match", [
    (LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), "use_dora"),
    (LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True), "lora_bias"),
    (LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), r"\['lm_head'\]"),
    (LoraConfig(r=4, target_modules=["model.embed_tokens", "v_proj"]), "embed_tokens"),
    (LoraConfig(r=4, target_modules=r".*(embed_tokens|q_proj)"), "embed_tokens"),
])
def test_unservable_lora_is_refused(config, match):
    with pytest.raises(ValueError, match=match):
        check_sampler_peft_config(config)


@pytest.mark.parametrize("config", [
    None,
    LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),  # the demo's (all-linear leaves out lm_head)
    LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    LoraConfig(r=4, target_modules=r".*\.(q|v)_proj"),
])
def test_decoder_lora_passes(config):
    check_sampler_peft_config(config)


def test_the_trainer_refuses_before_loading(grpo_config):
    from triage_trl.trainer import TriageGRPOTrainer

    with pytest.raises(ValueError, match="use_dora"):  # a model id that would fail to load: the check runs first
        TriageGRPOTrainer("no-such-org/no-such-model", reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=grpo_config(), train_dataset=[{"prompt": "1 + 1 ="}],
                          peft_config=LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
