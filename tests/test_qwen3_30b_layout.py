"""Qwen3-30B-A3B checked without weights: the model built from its configuration on the meta device, the NVFP4
layer selection of the shipped recipes, the parameter counts per precision and kind, and the checkpoint's expert
names and compressed-tensors ignore list as vLLM reads them."""

from pathlib import Path

import pytest
import torch
import yaml

from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.nvfp4.checkpoint_experts import expert_checkpoint_tensor_names
from triage_trl.nvfp4.checkpoint_tensors import nvfp4_quantization_config
from triage_trl.nvfp4.selection import select_nvfp4_layers

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

# Qwen/Qwen3-30B-A3B config.json (the values that shape the weights).
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, hidden_act="silu",
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
)
LAYERS = 48
ATTENTION = LAYERS * (4096 * 2048 + 512 * 2048 + 512 * 2048 + 2048 * 4096)  # q, k, v, o: 905_969_664
EXPERTS_PER_LAYER = 128 * (2 * 768 * 2048 + 2048 * 768)  # 603_979_776
EXPERTS = LAYERS * EXPERTS_PER_LAYER  # 28_991_029_248
ROUTERS = LAYERS * 128 * 2048  # 12_582_912
LM_HEAD = 151936 * 2048  # 311_164_928


@pytest.fixture(scope="module")
def qwen3_30b():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_30B_A3B))
    return model


def _recipe_config(name: str) -> NVFP4Config:
    values = yaml.safe_load((RECIPES / name).read_text())
    return NVFP4Config(**{k: v for k, v in values.items() if k in NVFP4Config.__dataclass_fields__})


def test_model_size(qwen3_30b):
    total = sum(p.numel() for p in qwen3_30b.parameters())
    assert total == 30_532_122_624
    assert ATTENTION + EXPERTS + ROUTERS + 2 * LM_HEAD + LAYERS * (2 * 2048 + 2 * 128) + 2048 == total


def test_recipe_selection_with_an_nvfp4_moe_kernel(qwen3_30b):
    config = _recipe_config("qwen3_30b_a3b_nvfp4_triage.yaml")
    assert config.learner_precision == config.sampler_precision == "nvfp4" and config.nvfp4_moe_experts == "auto"
    config.nvfp4_moe_experts = "nvfp4"  # what "auto" resolves to where vLLM has an NVFP4 MoE kernel (GPUs)
    selection = select_nvfp4_layers(qwen3_30b, config)
    assert selection.parameter_counts() == {
        "nvfp4/params_nvfp4_linear": ATTENTION, "nvfp4/params_nvfp4_experts": EXPERTS,
        "nvfp4/params_bf16_router": ROUTERS, "nvfp4/params_bf16_linear": LM_HEAD,
    }
    assert selection.summary()["nvfp4/layers_nvfp4"] == LAYERS * 6  # q, k, v, o, gate_up, down
    ignore = nvfp4_quantization_config(qwen3_30b, selection=selection).ignore
    assert ignore == [f"model.layers.{i}.mlp.gate" for i in range(LAYERS)] + ["lm_head"]
    names = expert_checkpoint_tensor_names("model.layers.7.mlp.experts.gate_up_proj", 128, nvfp4=True)
    assert len(names) == 128 * 2 * 4
    assert names[:5] == ["model.layers.7.mlp.experts.0.gate_proj.weight_packed",
                         "model.layers.7.mlp.experts.0.gate_proj.weight_scale",
                         "model.layers.7.mlp.experts.0.gate_proj.weight_global_scale",
                         "model.layers.7.mlp.experts.0.gate_proj.input_global_scale",
                         "model.layers.7.mlp.experts.0.up_proj.weight_packed"]
    assert expert_checkpoint_tensor_names("model.layers.7.mlp.experts.down_proj", 128, nvfp4=True)[-1] == \
        "model.layers.7.mlp.experts.127.down_proj.input_global_scale"


def test_paper_recipe_keeps_attention_and_edge_blocks(qwen3_30b):
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    config = NVFP4Config(nvfp4_recipe="paper", nvfp4_moe_experts="nvfp4")
    selection = select_nvfp4_layers(qwen3_30b, config)
    kept_blocks = 2 + 8  # ceil(4%) and ceil(15%) of 48
    assert selection.parameter_counts() == {
        "nvfp4/params_bf16_linear": ATTENTION + LM_HEAD, "nvfp4/params_bf16_router": ROUTERS,
        "nvfp4/params_bf16_experts": kept_blocks * EXPERTS_PER_LAYER,
        "nvfp4/params_nvfp4_experts": (LAYERS - kept_blocks) * EXPERTS_PER_LAYER,
    }
    ignore = nvfp4_quantization_config(qwen3_30b, selection=selection).ignore
    for block, kept in ((0, True), (1, True), (2, False), (39, False), (40, True), (47, True)):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert should_ignore_layer(f"model.layers.{block}.mlp.experts.5.{proj}", ignore) is kept
        assert should_ignore_layer(f"model.layers.{block}.mlp.gate", ignore)
        assert should_ignore_layer(f"model.layers.{block}.self_attn.q_proj", ignore)


def test_auto_follows_this_vllm(qwen3_30b):
    from triage_trl.nvfp4.experts import sampler_nvfp4_moe_support

    selection = select_nvfp4_layers(qwen3_30b, _recipe_config("qwen3_30b_a3b_nvfp4_triage.yaml"))
    if sampler_nvfp4_moe_support()[0]:  # vLLM on a GPU: experts in NVFP4
        assert selection.parameter_counts()["nvfp4/params_nvfp4_experts"] == EXPERTS
        return
    assert selection.parameter_counts() == {  # vLLM's CPU build: experts in bf16, attention in NVFP4
        "nvfp4/params_nvfp4_linear": ATTENTION, "nvfp4/params_bf16_experts": EXPERTS,
        "nvfp4/params_bf16_router": ROUTERS, "nvfp4/params_bf16_linear": LM_HEAD,
    }
    reason = selection.choice("model.layers.20.mlp.experts.gate_up_proj").reason
    assert reason.startswith("nvfp4_moe_experts='auto': vLLM's cpu build has no NVFP4 MoE kernel")
    ignore = nvfp4_quantization_config(qwen3_30b, selection=selection).ignore
    assert len(ignore) == 2 * LAYERS + 1  # per block: the router and one pattern for the experts; lm_head


def test_recipes_state_their_accelerate_config():
    for precision in ("bf16", "nvfp4_naive", "nvfp4_triage"):
        text = (RECIPES / f"qwen3_30b_a3b_{precision}.yaml").read_text()
        assert "--config_file accelerate_configs/fsdp2.yaml" in text
        assert "nvfp4_moe_experts: auto" in text
