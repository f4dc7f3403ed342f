"""NVFP4 checkpoint export: compressed-tensors decodes exactly our dequantised weights; names, shapes,
shared global scales; export from a converted learner and from a PEFT model; the config file."""

import json

import pytest
import torch
from torch import nn

from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.nvfp4.checkpoint_tensors import calibrate_input_global_scales, iter_nvfp4_checkpoint_weights, save_nvfp4_checkpoint
from triage_trl.nvfp4.numerics import global_scale_from_amax
from triage_trl.nvfp4.learner import convert_to_nvfp4_learner
from triage_trl.nvfp4.quantize import nvfp4_fake_quantize_reference

PROMPTS = ["What is 3 + 4? Let me think step by step.", "The quick brown fox jumps over the lazy dog."]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _decompress(sd, prefix):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    local = {k[len(prefix) + 1 :]: v for k, v in sd.items() if k.startswith(prefix + ".")}
    return NVFP4PackedCompressor.decompress(local, preset_name_to_scheme("NVFP4", ["Linear"]))["weight"]


def test_weight_global_scale_is_power_of_two_below_ideal():
    for amax in (0.013, 0.5, 1.0, 3.7, 2688.0, 1e4):
        g = global_scale_from_amax(torch.tensor(amax)).item()
        assert g <= 2688.0 / amax < 2 * g
        assert torch.frexp(torch.tensor(g)).mantissa.item() == 0.5
    assert global_scale_from_amax(torch.tensor(0.0)).item() == 1.0


def test_checkpoint_tensors_names_shapes_and_exact_decompression(nvfp4_tiny_qwen3):
    model, tok = nvfp4_tiny_qwen3()
    scales = calibrate_input_global_scales(model, tok, PROMPTS)
    assert set(scales) == {f"model.layers.{i}.{m}" for i in range(2) for m in LINEARS}
    sd = dict(iter_nvfp4_checkpoint_weights(model, scales))
    hf = model.state_dict()
    for i in range(2):
        for m in LINEARS:
            p = f"model.layers.{i}.{m}"
            w = hf[p + ".weight"]
            out_f, in_f = w.shape
            assert p + ".weight" not in sd
            assert sd[p + ".weight_packed"].dtype == torch.uint8 and sd[p + ".weight_packed"].shape == (out_f, in_f // 2)
            assert sd[p + ".weight_scale"].dtype == torch.float8_e4m3fn and sd[p + ".weight_scale"].shape == (out_f, in_f // 16)
            for s in ("weight_global_scale", "input_global_scale"):
                assert sd[f"{p}.{s}"].dtype == torch.float32 and sd[f"{p}.{s}"].shape == (1,)
            # compressed-tensors' own decompression == torchao's dequantisation, bit for bit
            ours = nvfp4_fake_quantize_reference(w, 1.0 / sd[p + ".weight_global_scale"])
            theirs = _decompress(sd, p)
            assert theirs.dtype == torch.bfloat16
            assert torch.equal(theirs.view(torch.int16), ours.view(torch.int16))
        a = f"model.layers.{i}.self_attn"
        assert sd[f"{a}.q_proj.weight_global_scale"] == sd[f"{a}.k_proj.weight_global_scale"] == sd[f"{a}.v_proj.weight_global_scale"]
        assert sd[f"{a}.q_proj.input_global_scale"] == sd[f"{a}.k_proj.input_global_scale"] == sd[f"{a}.v_proj.input_global_scale"]
        mlp = f"model.layers.{i}.mlp"
        assert sd[f"{mlp}.gate_proj.weight_global_scale"] == sd[f"{mlp}.up_proj.weight_global_scale"]
        assert sd[f"{mlp}.gate_proj.input_global_scale"] == sd[f"{mlp}.up_proj.input_global_scale"]
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(sd[name], hf[name]) and sd[name].dtype == hf[name].dtype
    quant_keys = {k for k in sd if k.rsplit(".", 1)[-1] in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")}
    assert len(quant_keys) == 4 * 14 and len(sd) == len(hf) - 14 + 4 * 14


def test_export_of_converted_learner_reads_master_weights(nvfp4_tiny_qwen3):
    plain, tok = nvfp4_tiny_qwen3()
    scales = calibrate_input_global_scales(plain, tok, PROMPTS)
    expected = dict(iter_nvfp4_checkpoint_weights(plain, scales))
    converted, _ = nvfp4_tiny_qwen3()
    convert_to_nvfp4_learner(converted)
    got = dict(iter_nvfp4_checkpoint_weights(converted, scales))
    assert got.keys() == expected.keys()
    for k in got:
        assert torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8)) if got[k].dtype == torch.float8_e4m3fn else torch.equal(got[k], expected[k])
    # calibration through the converted (fake-quantised) model also covers every NVFP4 layer
    assert calibrate_input_global_scales(converted, tok, PROMPTS).keys() == scales.keys()


def test_export_follows_learner_selection(nvfp4_tiny_qwen3):
    model, tok = nvfp4_tiny_qwen3()
    selection = convert_to_nvfp4_learner(model, NVFP4Config(nvfp4_keep_last_blocks=1))
    assert selection.nvfp4_layers == tuple(f"model.layers.0.{m}" for m in LINEARS)
    sd = dict(iter_nvfp4_checkpoint_weights(model, calibrate_input_global_scales(model, tok, PROMPTS)))
    assert "model.layers.1.self_attn.q_proj.weight" in sd and "model.layers.1.self_attn.q_proj.weight_packed" not in sd


def test_export_of_peft_model_merges_lora(nvfp4_tiny_qwen3):
    from peft import LoraConfig, get_peft_model

    model, tok = nvfp4_tiny_qwen3()
    convert_to_nvfp4_learner(model)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    for mod in peft_model.modules():
        if hasattr(mod, "lora_B") and "default" in mod.lora_B:
            nn.init.normal_(mod.lora_B["default"].weight, std=0.05)
    scales = calibrate_input_global_scales(peft_model, tok, PROMPTS)
    assert "model.layers.0.self_attn.q_proj" in scales
    sd = dict(iter_nvfp4_checkpoint_weights(peft_model, scales))
    assert not any("lora" in k or "base_layer" in k or k.startswith("base_model") for k in sd)
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    merged = (q.base_layer.weight.float() + q.get_delta_weight("default").float()).to(torch.bfloat16)
    assert not torch.equal(merged, q.base_layer.weight)
    p = "model.layers.0.self_attn.q_proj"
    ours = nvfp4_fake_quantize_reference(merged, 1.0 / sd[p + ".weight_global_scale"])
    assert torch.equal(_decompress(sd, p).view(torch.int16), ours.view(torch.int16))


@pytest.mark.parametrize("learner_dtype,values_dtype",
                         [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_a_fused_lora_group_quantised_in_one_buffer_is_its_members_quantised_alone(nvfp4_tiny_qwen3, learner_dtype,
                                                                                   values_dtype):
    """LoRA on every linear: each NVFP4 fused group (q/k/v, gate/up) is merged and quantised in one buffer; every
    member's codes, scales and handed-over values equal those of the member merged and quantised alone, and the
    values are vLLM's decode of the codes."""
    from peft import LoraConfig, get_peft_model
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    from triage_trl.nvfp4.checkpoint_tensors import DequantisedWeights, iter_checkpoint_weights
    from triage_trl.nvfp4.modules import fused_group, iter_logical_linears, merged_weight
    from triage_trl.nvfp4.numerics import abs_max
    from triage_trl.nvfp4.quantize import nvfp4_quantize_packed
    from triage_trl.nvfp4.selection import resolve_nvfp4_layer_selection

    model, tok = nvfp4_tiny_qwen3(dtype=learner_dtype)
    selection = convert_to_nvfp4_learner(model)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(LINEARS)))
    generator = torch.Generator().manual_seed(5)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    scales = calibrate_input_global_scales(peft_model, tok, PROMPTS)
    values = DequantisedWeights(values_dtype)
    sd = dict(iter_checkpoint_weights(peft_model, selection=resolve_nvfp4_layer_selection(peft_model, selection),
                                      input_global_scales=scales, dequantised=values))
    linears = dict(iter_logical_linears(peft_model))
    groups: dict[str, list[str]] = {}
    for name in linears:
        if f"{name}.weight_packed" in sd:
            groups.setdefault(fused_group(name), []).append(name)
    fused_views = 0
    for members in groups.values():
        merged = {m: merged_weight(linears[m]) for m in members}
        global_scale = global_scale_from_amax(torch.stack([abs_max(w) for w in merged.values()]).amax())
        for m in members:
            packed, scale = nvfp4_quantize_packed(merged[m], 1.0 / global_scale)
            assert torch.equal(sd[f"{m}.weight_packed"], packed), m
            assert torch.equal(sd[f"{m}.weight_scale"].view(torch.uint8), scale.view(torch.uint8)), m
            decoded = dequantize_to_dtype(packed, scale, (1.0 / global_scale).reshape(1), values_dtype, 16,
                                          swizzle=False)
            assert torch.equal(values.by_name[m], decoded), m
            fused_views += sd[f"{m}.weight_packed"]._base is not None
    assert fused_views == 2 * (3 + 2)  # q/k/v and gate/up of both blocks came from one buffer each


def test_missing_scales_raise(nvfp4_tiny_qwen3):
    model, tok = nvfp4_tiny_qwen3()
    with pytest.raises(KeyError, match="calibrate_input_global_scales"):
        next(iter_nvfp4_checkpoint_weights(model, {}))


def test_saved_checkpoint_folder(nvfp4_tiny_qwen3, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    model, tok = nvfp4_tiny_qwen3()
    out = save_nvfp4_checkpoint(model, tok, tmp_path / "ckpt", calibrate_input_global_scales(model, tok, PROMPTS))
    assert (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists()
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized" and qc["quant_method"] == "compressed-tensors"
    assert qc["ignore"] == ["lm_head"]
    parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k not in ("version", "sparsity_config", "transform_config")})
    w = parsed.config_groups["group_0"].weights
    assert (w.num_bits, w.group_size, w.type) == (4, 16, "float")
    assert config["model_type"] == "qwen3"


def test_nan_weight_raises_naming_the_layer(nvfp4_tiny_qwen3):
    model, tok = nvfp4_tiny_qwen3()
    scales = calibrate_input_global_scales(model, tok, PROMPTS)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj holds NaN or inf"):
        dict(iter_nvfp4_checkpoint_weights(model, scales))


def test_four_over_six_export_decodes_to_the_learners_weights(nvfp4_tiny_qwen3):
    model, tok = nvfp4_tiny_qwen3()
    config = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4", nvfp4_four_over_six=True)
    selection = convert_to_nvfp4_learner(model, config)
    assert selection.four_over_six
    sd = dict(iter_nvfp4_checkpoint_weights(model, calibrate_input_global_scales(model, tok, PROMPTS)))
    plain, _ = nvfp4_tiny_qwen3()
    plain_sd = dict(iter_nvfp4_checkpoint_weights(plain, calibrate_input_global_scales(plain, tok, PROMPTS)))
    changed = 0
    for i in range(2):
        for m in LINEARS:
            p = f"model.layers.{i}.{m}"
            learner_w = model.get_submodule(p).fake_quantized_weight()
            assert torch.equal(_decompress(sd, p).view(torch.int16), learner_w.view(torch.int16)), p
            assert torch.equal(sd[p + ".weight_global_scale"], plain_sd[p + ".weight_global_scale"])  # same format
            changed += int(not torch.equal(sd[p + ".weight_scale"].view(torch.uint8), plain_sd[p + ".weight_scale"].view(torch.uint8)))
    assert changed == 14  # every layer has blocks that chose 4


def test_vllm_decodes_the_four_over_six_export_as_the_learner(nvfp4_tiny_qwen3):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    model, tok = nvfp4_tiny_qwen3()
    convert_to_nvfp4_learner(model, NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4",
                                                nvfp4_four_over_six=True))
    sd = dict(iter_nvfp4_checkpoint_weights(model, calibrate_input_global_scales(model, tok, PROMPTS)))
    p = "model.layers.1.mlp.down_proj"
    # vLLM's compressed-tensors scheme turns the stored divisor into its reciprocal, a multiplier
    w = dequantize_to_dtype(sd[p + ".weight_packed"], sd[p + ".weight_scale"], 1.0 / sd[p + ".weight_global_scale"],
                            torch.bfloat16, 16, swizzle=False)
    assert torch.equal(w, model.get_submodule(p).fake_quantized_weight())
