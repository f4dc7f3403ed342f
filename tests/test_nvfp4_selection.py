"""The one NVFP4 layer rule: computed once per model, the same object for the learner conversion, the calibration
and the export, for every learner/sampler precision pair; MoE routers never quantised; fused groups together."""

import json

import pytest
import torch
from torch import nn

from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.nvfp4.checkpoint_tensors import calibrate_input_global_scales, iter_nvfp4_checkpoint_weights, save_nvfp4_checkpoint
from triage_trl.nvfp4.learner import convert_to_nvfp4_learner
from triage_trl.nvfp4.selection import nvfp4_layer_selection, select_nvfp4_layers

PROMPTS = ["What is 3 + 4? Let me think step by step."]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_bf16_learner_nvfp4_sampler_exports_exactly_the_selected_layers(nvfp4_tiny_qwen3, tmp_path):
    # Regression: the sampler's export used its own rule and put all 14 linears in NVFP4 here.
    model, tok = nvfp4_tiny_qwen3()
    config = NVFP4Config(learner_precision="bf16", sampler_precision="nvfp4", nvfp4_keep_first_blocks=1)
    selection = nvfp4_layer_selection(model, config)
    assert selection.nvfp4_layers == tuple(f"model.layers.1.{m}" for m in LINEARS)
    scales = calibrate_input_global_scales(model, tok, PROMPTS)
    assert set(scales) == set(selection.nvfp4_layers)
    out = save_nvfp4_checkpoint(model, tok, tmp_path / "ckpt", scales)
    from safetensors.torch import load_file

    packed = {k.removesuffix(".weight_packed") for k in load_file(out / "model.safetensors") if k.endswith(".weight_packed")}
    assert packed == set(selection.nvfp4_layers)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == [f"model.layers.0.{m}" for m in LINEARS] + ["lm_head"] == list(selection.kept_layers)
    assert selection.choice("model.layers.0.mlp.up_proj").reason == "block 0 < nvfp4_keep_first_blocks=1"


def test_learner_conversion_and_export_share_one_selection_object(nvfp4_tiny_qwen3):
    model, tok = nvfp4_tiny_qwen3()
    config = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4", nvfp4_keep_last_blocks=1)
    selection = convert_to_nvfp4_learner(model, config)
    assert nvfp4_layer_selection(model) is selection and nvfp4_layer_selection(model, config) is selection
    sd = dict(iter_nvfp4_checkpoint_weights(model, calibrate_input_global_scales(model, tok, PROMPTS)))
    assert {k.removesuffix(".weight_packed") for k in sd if k.endswith(".weight_packed")} == set(selection.nvfp4_layers)
    other = NVFP4Config(nvfp4_keep_first_blocks=1)
    with pytest.raises(ValueError, match="already has an NVFP4 layer selection"):
        nvfp4_layer_selection(model, other)
    with pytest.raises(ValueError, match="differs from the one this model was converted with"):
        next(iter_nvfp4_checkpoint_weights(model, {}, selection=select_nvfp4_layers(model, other)))


def test_fused_groups_are_decided_together(nvfp4_tiny_qwen3):
    model, _ = nvfp4_tiny_qwen3()
    selection = select_nvfp4_layers(model, NVFP4Config(nvfp4_exclude_patterns=[r"k_proj$", r"layers\.1\.mlp\.up_proj"]))
    for i in range(2):
        for m in ("q_proj", "k_proj", "v_proj"):
            assert not selection.is_nvfp4(f"model.layers.{i}.self_attn.{m}")
        assert selection.is_nvfp4(f"model.layers.{i}.self_attn.o_proj")
    assert selection.choice("model.layers.0.self_attn.q_proj").reason == \
        "fused by vLLM with k_proj (matches nvfp4_exclude_patterns 'k_proj$')"
    assert not selection.is_nvfp4("model.layers.1.mlp.gate_proj") and selection.is_nvfp4("model.layers.0.mlp.gate_proj")
    assert nvfp4_layer_selection(model) is not selection  # select_ is pure: nothing was stored


class _MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(64, 64)
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(64, 16)  # router: 16 experts
        self.mlp.shared_expert_gate = nn.Linear(64, 16)
        self.mlp.experts = nn.ModuleList([nn.Module() for _ in range(2)])
        for e in self.mlp.experts:
            e.gate_proj, e.up_proj, e.down_proj = nn.Linear(64, 32), nn.Linear(64, 32), nn.Linear(32, 64)


def test_routers_and_gates_are_never_quantised():
    model = nn.Module()
    model.layers = nn.ModuleList([_MoEBlock()])
    model.router = nn.Linear(64, 16)  # outside the blocks as well
    selection = select_nvfp4_layers(model, NVFP4Config(nvfp4_exclude_patterns=[]))
    assert selection.choice("layers.0.mlp.gate").reason == "MoE router/gate"
    assert selection.choice("layers.0.mlp.shared_expert_gate").reason == "MoE router/gate"
    assert selection.choice("router").reason == "outside the decoder blocks"
    assert selection.is_nvfp4("layers.0.self_attn.q_proj")
    for e in range(2):
        for m in ("gate_proj", "up_proj", "down_proj"):
            assert selection.is_nvfp4(f"layers.0.mlp.experts.{e}.{m}")
    with pytest.raises(KeyError, match="not a linear layer"):
        selection.choice("layers.0.mlp.experts")


def test_invalid_settings_raise_naming_the_field(nvfp4_tiny_qwen3):
    model, _ = nvfp4_tiny_qwen3()
    with pytest.raises(ValueError, match="nvfp4_exclude_patterns: '\\(' is not a valid regular expression"):
        select_nvfp4_layers(model, NVFP4Config(nvfp4_exclude_patterns=["("]))
    with pytest.raises(ValueError, match="nvfp4_recipe='most' is invalid"):
        select_nvfp4_layers(model, NVFP4Config(nvfp4_recipe="most"))


# ------------------------------------------------------------------ recipes, through the one rule


def test_recipe_no_qkv_keeps_attention_inputs(nvfp4_tiny_qwen3):
    model, _ = nvfp4_tiny_qwen3()
    selection = select_nvfp4_layers(model, NVFP4Config(nvfp4_recipe="no_qkv"))
    assert selection.nvfp4_layers == tuple(
        f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    )
    assert selection.choice("model.layers.1.self_attn.v_proj").reason == "nvfp4_recipe='no_qkv': attention q/k/v"


@pytest.fixture(scope="module")
def seven_block_dir(tmp_path_factory):
    from triage_trl.testing import save_tiny_qwen3

    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-7-blocks"), num_hidden_layers=7)


def test_recipe_paper_keeps_attention_and_the_boundary_blocks(seven_block_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(seven_block_dir, dtype=torch.bfloat16)
    mlp = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    # 7 blocks: the first ceil(0.04 * 7) = 1 and the last ceil(0.15 * 7) = 2 stay in bf16, and attention everywhere
    selection = select_nvfp4_layers(model, NVFP4Config(nvfp4_recipe="paper"))
    assert selection.nvfp4_layers == tuple(f"model.layers.{i}.{m}" for i in range(1, 5) for m in mlp)
    assert selection.choice("model.layers.2.self_attn.o_proj").reason == "nvfp4_recipe='paper': attention"
    assert selection.choice("model.layers.0.mlp.up_proj").reason == "nvfp4_recipe='paper': one of the first 1 blocks"
    assert selection.choice("model.layers.5.mlp.up_proj").reason == "nvfp4_recipe='paper': one of the last 2 blocks"
    # the free-form settings apply on top of the preset
    on_top = NVFP4Config(nvfp4_recipe="paper", nvfp4_keep_last_blocks=3, nvfp4_exclude_patterns=["down_proj"])
    assert select_nvfp4_layers(model, on_top).nvfp4_layers == tuple(
        f"model.layers.{i}.{m}" for i in range(1, 4) for m in mlp[:2])


def test_recipes_recognise_other_attention_layouts():
    from triage_trl.nvfp4.recipes import paper_kept_blocks, recipe_keeps

    for name in ("gpt_neox.layers.3.attention.query_key_value", "model.layers.3.self_attn.qkv_proj",
                 "model.layers.3.self_attn.kv_b_proj", "transformer.blocks.3.attn.Wqkv"):
        assert recipe_keeps("no_qkv", name, 3, 48) == "attention q/k/v"
    for name in ("gpt_neox.layers.3.attention.dense", "model.layers.3.self_attn.o_proj"):
        assert recipe_keeps("no_qkv", name, 3, 48) == "" and recipe_keeps("paper", name, 3, 48) == "attention"
    assert recipe_keeps("no_qkv", "model.layers.3.mlp.experts.5.down_proj", 3, 48) == ""
    assert paper_kept_blocks(48) == (2, 8) and paper_kept_blocks(30) == (2, 5) and paper_kept_blocks(36) == (2, 6)
    assert recipe_keeps("paper", "model.layers.40.mlp.experts.5.down_proj", 40, 48) == "one of the last 8 blocks"
    assert recipe_keeps("paper", "model.layers.20.mlp.experts.5.down_proj", 20, 48) == ""
