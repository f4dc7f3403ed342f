"""NVFP4 MoE learner: the tiny Qwen3-MoE builder, the layer rule on 3-D experts and routers (conversion report,
parameter counts), the emulated W4A4 experts' numerics, straight-through gradients to the 3-D master weights, and
an expert that receives no token."""

import pytest
import torch
import torch.nn.functional as F

from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.nvfp4.experts import NVFP4EmulatedExperts, experts_forward, native_nvfp4_experts_available
from triage_trl.nvfp4.learner import (
    convert_to_nvfp4_learner,
    invalidate_nvfp4_weight_caches,
    learner_execution_paths,
    learner_execution_summary,
)
from triage_trl.nvfp4.numerics import global_scale_from_amax
from triage_trl.nvfp4.quantize import compile_available, nvfp4_fake_quantize, nvfp4_fake_quantize_reference
from triage_trl.nvfp4.selection import select_nvfp4_layers

EXPERTS_NVFP4 = NVFP4Config(nvfp4_moe_experts="nvfp4", nvfp4_emulation_dtype="fp32")
# Tiny Qwen3-MoE: 2 blocks, hidden 128, 4 experts of intermediate 64, top-2, vocab 448 (untied).
EXPERT_PARAMS = 2 * 4 * (2 * 64 * 128 + 128 * 64)  # 196608
ATTENTION_PARAMS = 2 * (128 * 128 + 64 * 128 + 64 * 128 + 128 * 128)  # q, k, v, o: 98304
ROUTER_PARAMS = 2 * 4 * 128  # 1024


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from triage_trl.testing import save_tiny_qwen3_moe

    path = save_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))

    def load(dtype=torch.float32):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)

    load.path = path
    return load


def test_tiny_moe_layout(tiny_moe):
    model = tiny_moe()
    block = model.model.layers[0].mlp
    assert type(block.gate).__name__ == "Qwen3MoeTopKRouter" and block.gate.top_k == 2
    assert tuple(block.experts.gate_up_proj.shape) == (4, 128, 128)
    assert tuple(block.experts.down_proj.shape) == (4, 128, 64)
    assert model.lm_head.weight.shape == (448, 128)


def test_conversion_report_counts_expert_parameters(tiny_moe):
    model = tiny_moe()
    selection = convert_to_nvfp4_learner(model, EXPERTS_NVFP4, native=False)
    assert selection.summary() == {"nvfp4/layers_nvfp4": 12, "nvfp4/layers_bf16": 3,
                                   "nvfp4/params_nvfp4_experts": EXPERT_PARAMS, "nvfp4/params_bf16_experts": 0}
    assert selection.parameter_counts() == {
        "nvfp4/params_nvfp4_linear": ATTENTION_PARAMS, "nvfp4/params_nvfp4_experts": EXPERT_PARAMS,
        "nvfp4/params_bf16_router": ROUTER_PARAMS, "nvfp4/params_bf16_linear": 448 * 128,
    }
    assert selection.choice("model.layers.1.mlp.gate").reason == "MoE router/gate"
    assert selection.choice("model.layers.0.mlp.experts.down_proj").kind == "experts"
    assert selection.checkpoint_ignore == ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head")
    paths = learner_execution_paths(model)
    assert paths["model.layers.1.mlp.experts.gate_up_proj"] == "emulated"
    assert learner_execution_summary(model) == {"nvfp4/native": 0, "nvfp4/emulated": 12, "nvfp4/kept_bf16": 1}
    assert isinstance(model.model.layers[1].mlp.experts, NVFP4EmulatedExperts)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())  # names unchanged


def test_selection_keeps_both_projections_of_an_experts_module_together(tiny_moe):
    config = NVFP4Config(nvfp4_moe_experts="nvfp4", nvfp4_exclude_patterns=[r"layers\.0\.mlp\.experts\.down_proj"])
    selection = select_nvfp4_layers(tiny_moe(), config)
    assert not selection.is_nvfp4("model.layers.0.mlp.experts.gate_up_proj")
    assert "fused by vLLM with down_proj" in selection.choice("model.layers.0.mlp.experts.gate_up_proj").reason
    assert selection.is_nvfp4("model.layers.1.mlp.experts.gate_up_proj")
    ignored = [n for n in selection.checkpoint_ignore if ".experts" in n]
    assert ignored == [r"re:^model\.layers\.0\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"]
    from vllm.model_executor.layers.quantization.utils.config_utils import is_equal_or_regex_match

    assert is_equal_or_regex_match("model.layers.0.mlp.experts.3.up_proj", ignored[0])
    assert not is_equal_or_regex_match("model.layers.10.mlp.experts.3.up_proj", ignored[0])


def test_experts_bf16_setting_keeps_every_expert(tiny_moe):
    config = NVFP4Config(nvfp4_moe_experts="bf16")
    selection = select_nvfp4_layers(tiny_moe(), config)
    assert selection.summary()["nvfp4/params_bf16_experts"] == EXPERT_PARAMS
    assert selection.choice("model.layers.0.mlp.experts.down_proj").reason == "nvfp4_moe_experts='bf16'"
    with pytest.raises(ValueError, match="nvfp4_moe_experts"):
        NVFP4Config(nvfp4_moe_experts="fp8").validate_nvfp4()


def _experts(tiny_moe, weight_scales="dynamic"):
    model = tiny_moe()
    config = NVFP4Config(nvfp4_moe_experts="nvfp4", nvfp4_emulation_dtype="fp32", learner_precision="nvfp4",
                         sampler_precision="nvfp4", nvfp4_learner_scales=weight_scales)
    convert_to_nvfp4_learner(model, config, native=False)
    return model.model.layers[0].mlp.experts


# Expert 3 receives no token.
ROUTING = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1], [0, 1]])


def _ste(x):  # straight-through fake quantisation, the reference for the emulated experts
    return x + (nvfp4_fake_quantize_reference(x) - x).detach()


def test_experts_forward_and_straight_through_gradients(tiny_moe):
    experts = _experts(tiny_moe)
    torch.manual_seed(1)
    x = torch.randn(5, 128, requires_grad=True)
    weights = torch.softmax(torch.randn(5, 2), dim=-1)
    out = experts(x, ROUTING, weights)
    (out * torch.linspace(-1, 1, 128)).sum().backward()

    w13 = experts.gate_up_proj.detach().clone().requires_grad_()
    w2 = experts.down_proj.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    q13 = torch.stack([nvfp4_fake_quantize_reference(w) for w in w13.detach()])
    q2 = torch.stack([nvfp4_fake_quantize_reference(w) for w in w2.detach()])
    masters = {"gate_up_proj": (w13, q13), "down_proj": (w2, q2)}

    def project(proj, e, h):  # Q(h) @ Q(W)^T with the straight-through estimator on both operands
        w, q = masters[proj]
        return F.linear(_ste(h), w[e] + (q[e] - w[e]).detach())

    expected = experts_forward(experts, ref_x, ROUTING, weights, project)
    (expected * torch.linspace(-1, 1, 128)).sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts.gate_up_proj.grad, w13.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(experts.down_proj.grad, w2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-5)
    assert experts.gate_up_proj.grad[3].abs().sum() == 0 and experts.down_proj.grad[3].abs().sum() == 0
    assert all(experts.gate_up_proj.grad[e].abs().sum() > 0 for e in range(3))


def test_expert_without_tokens_returns_empty_and_keeps_the_compiled_path(tiny_moe):
    experts = _experts(tiny_moe)
    experts.compiled = True
    empty = experts.expert_forward("gate_up_proj", 3, torch.zeros(0, 128))
    assert empty.shape == (0, 128)
    assert experts.expert_forward("down_proj", 3, torch.zeros(0, 64)).shape == (0, 128)
    assert nvfp4_fake_quantize(torch.zeros(0, 32)).shape == (0, 32)
    assert compile_available("cpu")
    out = experts(torch.randn(5, 128), ROUTING, torch.full((5, 2), 0.5))
    assert out.shape == (5, 128) and torch.isfinite(out).all()


def test_sampler_weight_scales_are_per_expert_and_shared_by_gate_and_up(tiny_moe):
    experts = _experts(tiny_moe, "sampler")
    with torch.no_grad():
        experts.gate_up_proj[1, :64] *= 0.01  # gate rows of expert 1 much smaller than its up rows
    scales = experts.weight_per_tensor_scales("gate_up_proj")
    for e in range(4):
        expected = 1.0 / global_scale_from_amax(experts.gate_up_proj[e].detach().abs().amax())
        assert scales[e] == expected
        assert torch.log2(scales[e]) == torch.round(torch.log2(scales[e]))  # a power of two
    invalidate_nvfp4_weight_caches(experts)
    w = experts.gate_up_proj.detach()
    q = experts.fake_quantized_weights()["gate_up_proj"]
    assert torch.equal(q[1], nvfp4_fake_quantize(w[1], scales[1]))  # one scale for gate and up rows


def test_native_experts_refused_with_reason():
    ok, why = native_nvfp4_experts_available()
    assert not ok and "NVFP4" in why


def _decode(codes, block_scale, global_scale):
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4

    q = f4_unpacked_to_f32(unpack_uint4(codes)).reshape(codes.shape[0], -1, 16)
    return (q * (block_scale.float() / global_scale).unsqueeze(-1)).reshape(codes.shape[0], -1)


def test_export_writes_experts_per_expert_as_the_learner_quantises_them(tiny_moe):
    from triage_trl.nvfp4.checkpoint_experts import expert_checkpoint_tensor_names
    from triage_trl.nvfp4.checkpoint_tensors import iter_checkpoint_weights, nvfp4_quantization_config
    from triage_trl.nvfp4.learner import set_sampler_input_scales

    model = tiny_moe()
    selection = convert_to_nvfp4_learner(model, NVFP4Config(
        nvfp4_moe_experts="nvfp4", nvfp4_emulation_dtype="fp32", learner_precision="nvfp4", sampler_precision="nvfp4"),
        native=False)
    scales = {name: torch.tensor(2.0 ** (5 + i % 3)) for i, name in enumerate(selection.nvfp4_layers)}
    set_sampler_input_scales(model, scales)
    tensors = dict(iter_checkpoint_weights(model, selection=selection, input_global_scales=scales))
    experts = model.model.layers[0].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        names = expert_checkpoint_tensor_names(f"model.layers.0.mlp.experts.{proj}", 4, nvfp4=True)
        assert set(names) <= set(tensors)
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in tensors)  # no 3-D names
    learner = experts.fake_quantized_weights()
    for e in range(4):
        p = f"model.layers.0.mlp.experts.{e}"
        gate, up = (_decode(tensors[f"{p}.{leaf}.weight_packed"], tensors[f"{p}.{leaf}.weight_scale"],
                            tensors[f"{p}.{leaf}.weight_global_scale"]) for leaf in ("gate_proj", "up_proj"))
        assert tensors[f"{p}.gate_proj.weight_global_scale"] == tensors[f"{p}.up_proj.weight_global_scale"]
        assert torch.equal(torch.cat([gate, up]), learner["gate_up_proj"][e])
        down = _decode(tensors[f"{p}.down_proj.weight_packed"], tensors[f"{p}.down_proj.weight_scale"],
                       tensors[f"{p}.down_proj.weight_global_scale"])
        assert torch.equal(down, learner["down_proj"][e])
        assert tensors[f"{p}.down_proj.input_global_scale"] == scales["model.layers.0.mlp.experts.down_proj"]
        assert tensors[f"{p}.down_proj.input_global_scale"] == experts.input_global_scales["down_proj"]
    assert nvfp4_quantization_config(model, selection=selection).ignore == list(selection.checkpoint_ignore)
