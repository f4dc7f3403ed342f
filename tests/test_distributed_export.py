"""The export one decoder block at a time (``triage_trl.models.blocks``, ``triage_trl.nvfp4.checkpoint_tensors``) and what the
ranks agree on (``triage_trl.sampler.ranks``), in one process.

Every model the sampler sees (plain, tied embeddings, an NVFP4-converted learner with blocks kept in bf16, PEFT LoRA
with trained adapters) exports each tensor once, under its Hugging Face name; the NVFP4 values themselves are checked
against compressed-tensors' decoder in ``tests/test_nvfp4_export.py``. Sharded (FSDP2) and partitioned (ZeRO-3)
models export bit for bit what the same plain model exports: two processes, ``tests/test_distributed_sharded.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from triage_trl.models.blocks import export_units, parameters_materialized
from triage_trl.nvfp4.calibration import calibrate_input_global_scales
from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.nvfp4.checkpoint_tensors import iter_checkpoint_weights, iter_nvfp4_checkpoint_weights
from triage_trl.nvfp4.numerics import global_scale_from_amax
from triage_trl.nvfp4.selection import select_nvfp4_layers
from triage_trl.sampler.ranks import all_ranks_agree, reduce_input_global_scales

PROMPTS = ["What is 3 + 4? Let me think step by step.", "Compute 12 - 5."]


def tiny_model(tie: bool = False, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


class ByteTokenizer:
    """Token ids = bytes mod 128 (enough to calibrate a 128-token vocabulary)."""

    def __call__(self, text, return_tensors=None, truncation=False, max_length=None):
        ids = [b % 128 for b in text.encode()][: max_length or None]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


def nvfp4_export(model):
    scales = calibrate_input_global_scales(model, ByteTokenizer(), PROMPTS)
    return list(iter_nvfp4_checkpoint_weights(model, scales))


@pytest.mark.parametrize("tie", [False, True])
def test_nvfp4_export_names_every_tensor_once(tie):
    names = [n for n, _ in nvfp4_export(tiny_model(tie=tie))]
    assert len(names) == len(set(names))
    assert names.count("model.embed_tokens.weight") == 1
    assert ("lm_head.weight" in names) is (not tie)  # a tied lm_head goes once, as the embedding
    assert sum(n.endswith(".weight_packed") for n in names) == 3 * 7  # every decoder linear of 3 blocks
    per_linear = {".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale"}
    packed = [n.removesuffix(".weight_packed") for n in names if n.endswith(".weight_packed")]
    assert all(f"{p}{suffix}" in names for p in packed for suffix in per_linear)


def test_nvfp4_export_of_a_converted_learner_keeps_its_bf16_blocks():
    from triage_trl.nvfp4.learner import convert_to_nvfp4_learner

    model = tiny_model()
    convert_to_nvfp4_learner(model, NVFP4Config(nvfp4_keep_first_blocks=1), native=False)
    names = dict(nvfp4_export(model))
    assert "model.layers.0.self_attn.q_proj.weight" in names  # kept in bf16 by the learner's rule
    assert "model.layers.1.self_attn.q_proj.weight_packed" in names


def test_nvfp4_export_merges_trained_lora_adapters():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    names = [n for n, _ in nvfp4_export(model)]
    assert not any("lora" in n or "base_layer" in n for n in names)
    assert "model.layers.0.self_attn.q_proj.weight_packed" in names


def test_bf16_blockwise_export_is_the_state_dict_with_merged_lora():
    from peft import LoraConfig, get_peft_model

    base = tiny_model()
    expected = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    lora = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    for module_name, module in model.named_modules():
        if module_name.endswith("q_proj") and hasattr(module, "get_delta_weight"):
            hf = module_name.removeprefix("base_model.model.")
            lora[f"{hf}.weight"] = module.get_delta_weight("default").float()
    ours = dict(iter_checkpoint_weights(model))
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        want = (expected[name].float() + lora[name]).to(expected[name].dtype) if name in lora else expected[name]
        assert torch.equal(tensor, want), name


def test_export_units_are_the_blocks_then_the_rest():
    units = export_units(tiny_model(tie=True))
    assert [u.prefix for u in units] == ["model.layers.0", "model.layers.1", "model.layers.2", ""]
    rest = [n for n, _ in units[-1].named_tensors()]
    assert rest == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert len(units[-1].parameters()) == 2  # the tied embedding counts once


def test_quantised_linear_without_a_scale_is_refused():
    model = tiny_model()
    with pytest.raises(KeyError, match="calibrate"):
        next(iter_checkpoint_weights(model, selection=select_nvfp4_layers(model), input_global_scales={}))


def test_parameters_materialized_sees_meta_tensors():
    model = tiny_model()
    assert parameters_materialized(model)
    with torch.device("meta"):
        meta = tiny_model()
    assert not parameters_materialized(meta)


class TwoRankAccelerator:
    """Stands in for two processes: ``gather`` concatenates this rank's tensor with the other rank's."""

    num_processes = 2
    device = torch.device("cpu")

    def __init__(self, other):
        self.other = other

    def gather(self, tensor):
        other = self.other(tensor)
        return torch.cat([tensor.reshape(-1), other.reshape(-1)])

    def reduce(self, tensor, reduction="sum"):
        return tensor + self.other(tensor)


def test_activation_scales_reduce_to_the_largest_amax_of_any_rank():
    amax_rank0 = {"a": 1.5, "b": 42.0, "c": 3.0}
    amax_rank1 = {"a": 3.0, "b": 10.5, "c": 3.0}
    scales0 = {n: global_scale_from_amax(torch.tensor(v)) for n, v in amax_rank0.items()}
    scales1 = {n: global_scale_from_amax(torch.tensor(v)) for n, v in amax_rank1.items()}
    other = torch.stack([scales1[n] for n in sorted(scales1)])
    accel = TwoRankAccelerator(lambda t: other if t.numel() == 3 else t)
    reduced = reduce_input_global_scales(scales0, accel)
    for name in amax_rank0:
        want = global_scale_from_amax(torch.tensor(max(amax_rank0[name], amax_rank1[name])))
        assert torch.equal(reduced[name], want), name
    assert [float(reduced[n]) for n in "abc"] == [512.0, 64.0, 512.0]  # 448 * 6 / max amax, down to a power of 2


def test_ranks_that_calibrated_different_layers_are_refused():
    accel = TwoRankAccelerator(lambda t: t + 1 if t.numel() == 1 else t)
    with pytest.raises(ValueError, match="different numbers"):
        reduce_input_global_scales({"a": torch.tensor(1.0)}, accel)


def test_one_process_agrees_with_itself_and_two_ranks_need_both():
    one = SimpleNamespace(num_processes=1)
    assert all_ranks_agree(True, one) and not all_ranks_agree(False, one)
    assert all_ranks_agree(True, TwoRankAccelerator(lambda t: torch.ones_like(t)))
    assert not all_ranks_agree(True, TwoRankAccelerator(lambda t: torch.zeros_like(t)))
