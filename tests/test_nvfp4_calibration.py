"""Reproducible NVFP4 activation calibration: on the float master model (quantisers off), power-of-two global
scales, fused groups sharing, bit-identical across seeds and learner states."""

import pytest
import torch

from triage_trl.nvfp4.calibration import calibrate_input_global_scales, nvfp4_quantizers_disabled
from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.nvfp4.learner import convert_to_nvfp4_learner

PROMPTS = ["What is 3 + 4? Let me think step by step.", "Compute 12 - 5.\nFirst, 12 - 5 = 7.",
           "The quick brown fox jumps over the lazy dog."]
BOTH_NVFP4 = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4")


def _learner_with_lora(load, seed):
    """A converted NVFP4 learner under a randomly initialised LoRA: everything a run's seed touches."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    torch.randn(1000)  # the run consumed some random numbers before calibrating
    model, tok = load()
    convert_to_nvfp4_learner(model, BOTH_NVFP4)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"], lora_dropout=0.1)), tok


def _bits(scales):
    return {name: s.view(torch.int32).item() for name, s in scales.items()}


def test_three_seeds_give_bit_identical_scales(nvfp4_tiny_qwen3):
    runs = [_bits(calibrate_input_global_scales(*_learner_with_lora(nvfp4_tiny_qwen3, seed), PROMPTS)) for seed in (0, 1, 2)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 14


def test_scales_are_the_float_models_powers_of_two_shared_in_fused_groups(nvfp4_tiny_qwen3):
    plain, tok = nvfp4_tiny_qwen3()
    expected = calibrate_input_global_scales(plain, tok, PROMPTS)
    learner, _ = nvfp4_tiny_qwen3()
    convert_to_nvfp4_learner(learner, BOTH_NVFP4)
    assert _bits(calibrate_input_global_scales(learner, tok, PROMPTS)) == _bits(expected)
    for name, scale in expected.items():
        assert torch.frexp(scale).mantissa.item() == 0.5, name  # a power of two
    for i in range(2):
        qkv = {_bits(expected)[f"model.layers.{i}.self_attn.{m}_proj"] for m in "qkv"}
        gate_up = {_bits(expected)[f"model.layers.{i}.mlp.{m}_proj"] for m in ("gate", "up")}
        assert len(qkv) == 1 and len(gate_up) == 1
    # the amax rule by hand for one layer: the input of o_proj over the prompts, 2688 / amax rounded down to 2**k
    seen = []
    hook = plain.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].abs().amax()))
    with torch.no_grad():
        for p in PROMPTS:
            plain(input_ids=tok(p, return_tensors="pt")["input_ids"])
    hook.remove()
    ideal = 2688.0 / torch.stack(seen).amax().float()
    assert expected["model.layers.1.self_attn.o_proj"].item() == 2.0 ** torch.floor(torch.log2(ideal)).item()


def test_quantizers_disabled_runs_the_float_model_and_restores(nvfp4_tiny_qwen3):
    plain, _ = nvfp4_tiny_qwen3(torch.float32)
    learner, _ = nvfp4_tiny_qwen3(torch.float32)
    convert_to_nvfp4_learner(learner, BOTH_NVFP4)
    ids = torch.arange(1, 17).reshape(1, 16)
    with torch.no_grad():
        float_logits = plain(input_ids=ids).logits
        nvfp4_logits = learner(input_ids=ids).logits
        with nvfp4_quantizers_disabled(learner):
            assert torch.equal(learner(input_ids=ids).logits, float_logits)
        assert torch.equal(learner(input_ids=ids).logits, nvfp4_logits)
    assert not torch.equal(nvfp4_logits, float_logits)


def test_nan_activation_raises_naming_the_layer(nvfp4_tiny_qwen3):
    model, tok = nvfp4_tiny_qwen3()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))  # NaN reaches block 1's attention input
    with pytest.raises(ValueError, match=r"The input of model\.layers\.1\.self_attn\.(q|k|v)_proj holds NaN or inf"):
        calibrate_input_global_scales(model, tok, PROMPTS)
    with pytest.raises(ValueError, match="at least one prompt"):
        calibrate_input_global_scales(model, tok, [])


@pytest.mark.slow
def test_three_seeds_give_bit_identical_scales_on_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    runs = []
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
        convert_to_nvfp4_learner(model, BOTH_NVFP4)
        runs.append(_bits(calibrate_input_global_scales(model, tok, PROMPTS)))
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 30 * 7
