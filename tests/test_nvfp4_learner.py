"""NVFP4 learner: the emulated W4A4 linear's exact numerics and gradients, layer selection and the
conversion report, the native-path error without sm100, and PEFT LoRA on top."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.nvfp4.learner import (
    NVFP4EmulatedLinear,
    convert_to_nvfp4_learner,
    invalidate_nvfp4_weight_caches,
    learner_execution_summary,
    native_nvfp4_available,
    register_nvfp4_cache_invalidation,
)
from triage_trl.nvfp4.quantize import nvfp4_fake_quantize, nvfp4_fake_quantize_reference

SAMPLER_SCALES = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4", nvfp4_emulation_dtype="fp32")


def _layer(in_f=64, out_f=48, bias=True, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return NVFP4EmulatedLinear.from_linear(nn.Linear(in_f, out_f, bias=bias).to(dtype))


@pytest.mark.parametrize(
    "shape", [(5, 64), (2, 7, 64), (3, 1, 64)], ids=["2d", "3d-batch2", "3d-batch3-seq1"]
)
def test_emulated_forward_equals_dequant_matmul_exactly(shape):
    layer = _layer()
    x = torch.randn(shape, dtype=torch.bfloat16)
    expected = F.linear(nvfp4_fake_quantize_reference(x), nvfp4_fake_quantize_reference(layer.weight.detach()), layer.bias)
    assert torch.equal(layer(x), expected)


def test_emulated_forward_non_contiguous_input():
    layer = _layer()
    x = torch.randn(64, 6, dtype=torch.bfloat16).t()  # [6, 64], non-contiguous
    expected = F.linear(nvfp4_fake_quantize_reference(x.contiguous()), nvfp4_fake_quantize_reference(layer.weight.detach()), layer.bias)
    assert torch.equal(layer(x), expected)


def test_emulated_gradients_straight_through():
    layer = _layer(dtype=torch.float32)
    x = torch.randn(2, 5, 64, requires_grad=True)
    g = torch.randn(2, 5, 48)
    layer(x).backward(g)
    x_dq = nvfp4_fake_quantize_reference(x.detach())
    w_dq = nvfp4_fake_quantize_reference(layer.weight.detach())
    # the straight-through products, computed by the same ops in the same order: exact
    assert torch.equal(x.grad, g @ w_dq)
    assert torch.equal(layer.weight.grad, g.reshape(-1, 48).t() @ x_dq.reshape(-1, 64))
    assert torch.equal(layer.bias.grad, g.reshape(-1, 48).sum(0))
    assert layer.weight.grad.dtype == torch.float32


def test_frozen_weight_gets_no_grad():
    layer = _layer(bias=False)
    layer.weight.requires_grad_(False)
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and x.grad is not None and x.grad.shape == x.shape


def _count_weight_quantisations(monkeypatch):
    """Count the weight re-quantisations of emulated layers (weights are quantised with an explicit scale)."""
    from triage_trl.nvfp4 import emulated

    calls = []
    real = emulated.nvfp4_fake_quantize

    def counting(x, per_tensor_scale=None, **kwargs):
        if per_tensor_scale is not None:
            calls.append(tuple(x.shape))
        return real(x, per_tensor_scale, **kwargs)

    monkeypatch.setattr(emulated, "nvfp4_fake_quantize", counting)
    return calls


def _fresh_output(layer, x):
    return F.linear(nvfp4_fake_quantize_reference(x), nvfp4_fake_quantize_reference(layer.weight.detach()), layer.bias)


def test_weight_cache_is_reused_until_invalidated(monkeypatch):
    calls = _count_weight_quantisations(monkeypatch)
    layer, x = _layer(dtype=torch.float32), torch.randn(4, 64)
    layer(x)
    layer(x)  # a second micro-batch of the same step: the cached weight
    assert calls == [(48, 64)]
    assert invalidate_nvfp4_weight_caches(layer) == 1
    layer(x)
    layer(x)
    assert calls == [(48, 64)] * 2


def test_a_frozen_nvfp4_base_keeps_its_cached_weight_across_optimizer_steps(monkeypatch):
    """LoRA on a frozen NVFP4 base: an optimizer step changes only the adapters, so the step hook leaves the cached
    fake-quantised base weight alone; a trainable weight is re-quantised after each step."""
    calls = _count_weight_quantisations(monkeypatch)
    layer, x = _layer(dtype=torch.float32), torch.randn(4, 64)
    layer.weight.requires_grad_(False)
    layer(x)
    assert invalidate_nvfp4_weight_caches(layer, trainable_only=True) == 0
    layer(x)
    assert calls == [(48, 64)]
    layer.weight.requires_grad_(True)
    assert invalidate_nvfp4_weight_caches(layer, trainable_only=True) == 1
    layer(x)
    assert calls == [(48, 64)] * 2


def test_fp32_master_with_bf16_compute_caches_the_gemm_operand_and_drops_it_with_the_weight_cache(monkeypatch):
    """An fp32 master computing in bf16: the forward multiplies the fake-quantised weight rounded to bf16 (held in
    the GEMM's dtype), cast once per weight generation and not again in the forward; the values are those of the
    cast. Under ``torch.inference_mode`` nothing is cached (an inference tensor would break the next backward)."""
    from triage_trl.nvfp4 import emulated

    torch.manual_seed(0)
    layer = NVFP4EmulatedLinear.from_linear(nn.Linear(64, 48, bias=False), compute_dtype=torch.bfloat16)
    x = torch.randn(4, 64)
    gemm = emulated._gemm_dtype(torch.bfloat16, "cpu")
    first, ready = layer.gemm_weight(x)
    assert ready and first.dtype == gemm and layer.gemm_weight(x)[0] is first
    assert torch.equal(first, layer.fake_quantized_weight().to(torch.bfloat16).to(gemm))
    seen = []
    real_linear = emulated.F.linear
    monkeypatch.setattr(emulated.F, "linear", lambda a, w, b=None: seen.append(w) or real_linear(a, w, b))
    expected = F.linear(nvfp4_fake_quantize(x).to(torch.bfloat16).to(gemm), first).to(torch.bfloat16).float()
    assert torch.equal(layer(x), expected) and seen[-1] is first  # the cached operand itself, not a recast copy
    with torch.no_grad():
        layer.weight.mul_(2.0)
    invalidate_nvfp4_weight_caches(layer)
    with torch.inference_mode():
        fresh, ready = layer.gemm_weight(x)
        stale = layer._weight_cache_key[0] != layer.weight_generation.value  # nothing refilled in here
        assert not ready and stale and layer._gemm_weight[1] is first and not torch.equal(fresh, first.float())
    second, _ = layer.gemm_weight(x)
    assert second is not first and torch.equal(second, layer.fake_quantized_weight().to(torch.bfloat16).to(gemm))
    x.requires_grad_(True)
    layer(x).sum().backward()  # the cache built outside inference mode trains
    assert x.grad is not None and not torch.equal(second, first)


def test_deepspeed_style_data_copy_is_fresh_after_invalidation():
    layer, x = _layer(dtype=torch.float32), torch.randn(4, 64)
    before = layer(x)
    version = layer.weight._version
    layer.weight.data.copy_(torch.randn_like(layer.weight))  # DeepSpeed writes updated parameters like this
    assert layer.weight._version == version  # no version bump: a version-keyed cache would stay stale
    assert torch.equal(layer(x), before)  # the cache holds until told
    invalidate_nvfp4_weight_caches(layer)
    after = layer(x)
    assert not torch.equal(after, before) and torch.equal(after, _fresh_output(layer, x))


def test_fsdp2_style_in_place_refill_is_fresh_after_invalidation():
    layer, x = _layer(dtype=torch.float32), torch.randn(4, 64)
    before = layer(x)
    storage, version = layer.weight.untyped_storage(), layer.weight._version
    nbytes = storage.nbytes()
    storage.resize_(0)  # FSDP2 frees the unsharded parameter after the forward ...
    storage.resize_(nbytes)  # ... and all-gathers into a fresh allocation before the next one
    storage.copy_(torch.randn_like(layer.weight).untyped_storage())
    assert layer.weight._version == version
    invalidate_nvfp4_weight_caches(layer)
    after = layer(x)
    assert not torch.equal(after, before) and torch.equal(after, _fresh_output(layer, x))


def test_optimizer_hook_and_trainer_callback_invalidate_after_a_step():
    from triage_trl.nvfp4.callbacks import NVFP4WeightCacheCallback

    layer, x = _layer(dtype=torch.float32), torch.randn(4, 64)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    handle = register_nvfp4_cache_invalidation(opt, layer)
    first = layer.fake_quantized_weight()
    layer(x).sum().backward()
    opt.step()
    assert torch.equal(layer(x), _fresh_output(layer, x)) and layer.fake_quantized_weight() is not first
    handle.remove()
    generation = layer.weight_generation.value
    NVFP4WeightCacheCallback().on_optimizer_step(None, None, None, model=layer)
    assert layer.weight_generation.value == generation + 1


def test_disabled_weight_cache_keeps_no_copy_and_requantises_every_forward(monkeypatch):
    calls = _count_weight_quantisations(monkeypatch)
    torch.manual_seed(0)
    layer = NVFP4EmulatedLinear.from_linear(nn.Linear(64, 48), cache_weights=False)
    x = torch.randn(4, 64)
    layer(x)
    layer.weight.data.copy_(torch.randn_like(layer.weight))
    assert torch.equal(layer(x), _fresh_output(layer, x))  # fresh without any invalidation
    assert len(calls) == 2 and layer._weight_dq is None


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from triage_trl.testing import save_tiny_qwen3

    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-nvfp4-learner"), num_hidden_layers=3)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def test_convert_selects_decoder_linears_only(tiny_model_dir):
    model = _load(tiny_model_dir)
    weight_ids = {n: id(p) for n, p in model.named_parameters()}
    config = NVFP4Config(nvfp4_keep_first_blocks=1, nvfp4_keep_last_blocks=1, nvfp4_exclude_patterns=["down_proj"])
    selection = convert_to_nvfp4_learner(model, config)
    assert selection.summary() == {"nvfp4/layers_nvfp4": 6, "nvfp4/layers_bf16": 7 * 2 + 1 + 1}
    assert learner_execution_summary(model) == {"nvfp4/native": 0, "nvfp4/emulated": 6, "nvfp4/kept_bf16": 16}
    assert selection.nvfp4_layers == tuple(
        f"model.layers.1.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")
    )
    assert selection.choice("lm_head").reason == "outside the decoder blocks"
    assert selection.choice("model.layers.1.mlp.down_proj").reason == "matches nvfp4_exclude_patterns 'down_proj'"
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.up_proj) is nn.Linear
    assert isinstance(model.model.layers[1].mlp.up_proj, NVFP4EmulatedLinear)
    assert {n: id(p) for n, p in model.named_parameters()} == weight_ids  # master weights shared
    assert str(selection).startswith("NVFP4 layers (nvfp4_recipe='all', nvfp4_keep_first_blocks=1,")
    assert "6 NVFP4, 16 bf16" in str(selection)


def test_convert_keeps_misaligned_layers_with_one_warning(caplog):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(32, 24)
            self.b = nn.Linear(20, 32)
            self.c = nn.Linear(32, 32)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block()])

    model = Tiny()
    with caplog.at_level(logging.WARNING, logger="triage_trl.nvfp4.selection"):
        selection = convert_to_nvfp4_learner(model)
    assert [r for r in caplog.records if "not multiples of 16" in r.getMessage()].__len__() == 1
    assert selection.choice("layers.0.a").reason == "32x24 not multiples of 16"
    assert not selection.is_nvfp4("layers.0.b") and selection.is_nvfp4("layers.0.c")
    assert type(model.layers[0].a) is nn.Linear and isinstance(model.layers[0].c, NVFP4EmulatedLinear)


@pytest.mark.skipif(native_nvfp4_available()[0], reason="this machine has an sm100 GPU; the error is for machines without")
def test_native_without_sm100_raises_naming_emulation(tiny_model_dir):
    model = _load(tiny_model_dir)
    with pytest.raises(ValueError, match=r"native=False.*'auto'.*emulated"):
        convert_to_nvfp4_learner(model, native=True)
    assert all(type(m) is not NVFP4EmulatedLinear for m in model.modules())  # untouched
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        convert_to_nvfp4_learner(model, native="yes")


def test_converted_model_runs_and_differs_from_bf16(tiny_model_dir):
    model = _load(tiny_model_dir)
    ids = torch.arange(1, 25).reshape(2, 12)
    with torch.no_grad():
        bf16_logits = model(input_ids=ids).logits
    convert_to_nvfp4_learner(model)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits, bf16_logits)


def test_peft_lora_over_converted_model_trains_a_step(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model = _load(tiny_model_dir)
    convert_to_nvfp4_learner(model)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, NVFP4EmulatedLinear)
    assert type(q_proj.lora_A["default"]) is nn.Linear  # adapters stay high precision (peft keeps them fp32)
    base_before = q_proj.base_layer.weight.detach().clone()
    lora_b_before = q_proj.lora_B["default"].weight.detach().clone()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.arange(2, 26).reshape(2, 12)
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert q_proj.lora_B["default"].weight.grad.abs().sum() > 0
    assert q_proj.base_layer.weight.grad is None  # frozen base
    opt.step()
    assert not torch.equal(q_proj.lora_B["default"].weight, lora_b_before)
    assert torch.equal(q_proj.base_layer.weight, base_before)
    assert torch.isfinite(peft_model(input_ids=ids, labels=ids).loss)


def test_convert_under_existing_peft_wrapper(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(_load(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj"]))
    assert convert_to_nvfp4_learner(peft_model).is_nvfp4("model.layers.0.self_attn.q_proj")
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, NVFP4EmulatedLinear)
    ids = torch.arange(2, 14).reshape(1, 12)
    assert torch.isfinite(peft_model(input_ids=ids, labels=ids).loss)


# ------------------------------------------------------------------ sampler-matched scales, bf16 GEMMs


def test_bf16_gemm_equals_bf16_matmul_of_dequantised_operands():
    layer = _layer(dtype=torch.float32)
    layer.compute_dtype = torch.bfloat16
    x = torch.randn(2, 5, 64, requires_grad=True)
    x_dq = nvfp4_fake_quantize_reference(x.detach()).bfloat16()
    w_dq = nvfp4_fake_quantize_reference(layer.weight.detach()).bfloat16()
    y = layer(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, F.linear(x_dq, w_dq, layer.bias.detach().bfloat16()).float())
    g = torch.randn(2, 5, 48)
    y.backward(g)
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert torch.equal(x.grad, (g.bfloat16() @ w_dq).float())
    assert torch.equal(layer.weight.grad, (g.bfloat16().reshape(-1, 48).t() @ x_dq.reshape(-1, 64)).float())


def test_sampler_scales_match_the_export_and_the_static_activation_scale(tiny_model_dir):
    from triage_trl.nvfp4.checkpoint_tensors import iter_nvfp4_checkpoint_weights
    from triage_trl.nvfp4.learner import set_sampler_input_scales
    from triage_trl.nvfp4.quantize import nvfp4_fake_quantize, nvfp4_fake_quantize_vllm

    model = _load(tiny_model_dir).float()
    convert_to_nvfp4_learner(model, SAMPLER_SCALES)
    attn = model.model.layers[1].self_attn
    scales = {name: torch.tensor(100.0 + i) for i, (name, m) in enumerate(model.named_modules())
              if isinstance(m, NVFP4EmulatedLinear)}
    assert set_sampler_input_scales(model, scales) == 21  # 3 blocks x (q, k, v, o, gate, up, down)
    exported = dict(iter_nvfp4_checkpoint_weights(model, {n: s for n, s in scales.items()}))
    prefix = "model.layers.1.self_attn."
    # q/k/v share the export's power-of-two weight global scale, and decode to the exported weights.
    global_scale = exported[prefix + "q_proj.weight_global_scale"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        layer = getattr(attn, proj)
        assert torch.equal(exported[prefix + proj + ".weight_global_scale"], global_scale)
        assert torch.equal(layer.weight_per_tensor_scale().reshape(1), 1.0 / global_scale)
        assert torch.equal(layer.fake_quantized_weight(),
                           nvfp4_fake_quantize_reference(layer.weight.detach(), 1.0 / global_scale))
    # Activations use the static scale given (a divisor) with the sampler's (vLLM's) rule, not their own amax.
    q = attn.q_proj
    x = torch.randn(3, q.in_features)
    expected = F.linear(nvfp4_fake_quantize_vllm(x, q.input_global_scale), q.fake_quantized_weight(), q.bias)
    assert torch.equal(q(x), expected)
    assert not torch.equal(q(x), F.linear(nvfp4_fake_quantize(x), q.fake_quantized_weight(), q.bias))


def test_set_sampler_input_scales_names_a_missing_layer(tiny_model_dir):
    from triage_trl.nvfp4.learner import set_sampler_input_scales

    model = _load(tiny_model_dir)
    convert_to_nvfp4_learner(model, SAMPLER_SCALES)
    with pytest.raises(KeyError, match="calibrate_input_global_scales"):
        set_sampler_input_scales(model, {})
    with pytest.raises(ValueError, match="nvfp4_learner_scales='static' is invalid"):
        convert_to_nvfp4_learner(_load(tiny_model_dir), NVFP4Config(nvfp4_learner_scales="static"))


def test_nan_weight_raises_naming_the_layer(tiny_model_dir):
    for config in (None, SAMPLER_SCALES):
        model = _load(tiny_model_dir)
        convert_to_nvfp4_learner(model, config)
        with torch.no_grad():
            model.model.layers[2].self_attn.k_proj.weight[0, 0] = float("inf")
        with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.(q|k)_proj.*NaN or inf"):
            model(input_ids=torch.arange(1, 9).reshape(1, 8))


def test_converted_model_shares_one_weight_generation(tiny_model_dir):
    model = _load(tiny_model_dir)
    convert_to_nvfp4_learner(model, NVFP4Config(nvfp4_weight_cache=False))
    layers = [m for m in model.modules() if isinstance(m, NVFP4EmulatedLinear)]
    assert len(layers) == 14 * 3 // 2 and len({id(m.weight_generation) for m in layers}) == 1
    assert not any(m.cache_weights for m in layers)
    assert invalidate_nvfp4_weight_caches(model) == 21 and layers[0].weight_generation.value == 1


def test_fused_group_scale_reads_the_siblings_current_weights(tiny_model_dir):
    """FSDP2's ``fully_shard`` replaces every Parameter object (and sets the unsharded ones for each forward): the
    shared q/k/v weight scale must follow the sibling's weight the module holds now, not the object of conversion."""
    from triage_trl.nvfp4.numerics import global_scale_from_amax

    model = _load(tiny_model_dir).float()
    convert_to_nvfp4_learner(model, SAMPLER_SCALES)
    attn = model.model.layers[0].self_attn
    before = attn.q_proj.weight_per_tensor_scale()
    bigger = 8 * max(m.weight.detach().abs().amax() for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    k = attn.k_proj.weight.detach()
    attn.k_proj.weight = nn.Parameter(k * (bigger / k.abs().amax()))  # a new object, as fully_shard sets
    after = attn.q_proj.weight_per_tensor_scale()
    assert torch.equal(after, 1.0 / global_scale_from_amax(bigger.float()))
    assert after.item() >= 4 * before.item()  # power-of-two scales: at least two binades up


def test_emulation_options_are_read_once_from_the_config():
    from triage_trl.nvfp4.config import NVFP4Config
    from triage_trl.nvfp4.emulated import EmulationOptions

    config = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4", nvfp4_emulation_dtype="fp32",
                         nvfp4_compile=False, nvfp4_sampler_kernel="weight_only")
    options = EmulationOptions.from_config(config, "cpu")
    assert options == EmulationOptions(compute_dtype=torch.float32, compiled=False, cache_weights=True,
                                       four_over_six=False, quantize_input=False)
    layer = NVFP4EmulatedLinear.from_linear(nn.Linear(32, 16), **options.layer_kwargs())
    assert (layer.compute_dtype, layer.compiled, layer.quantize_input) == (torch.float32, False, False)
    assert "quantize_input" not in options.layer_kwargs(experts=True)


def test_the_trainer_pushes_the_sampler_scales_once_per_calibration(tiny_model_dir):
    """After a sync the learner gets the sampler's scales when they are new (the first calibration, a
    recalibration: a new dict), and no walk over the model happens for a sync that did not recalibrate."""
    from types import SimpleNamespace

    from triage_trl.trainer.grpo_trainer import TriageGRPOTrainer

    model = _load(tiny_model_dir).float()
    convert_to_nvfp4_learner(model, SAMPLER_SCALES)
    q = model.model.layers[0].self_attn.q_proj
    names = [n for n, m in model.named_modules() if isinstance(m, NVFP4EmulatedLinear)]
    gen = SimpleNamespace(input_global_scales=None)
    fake = SimpleNamespace(model=model, nvfp4_learner_report={}, vllm_generation=gen, _pushed_scales=None,
                           args=SimpleNamespace(resolved_nvfp4_learner_scales="sampler"))
    push = TriageGRPOTrainer._push_sampler_scales
    push(fake)  # not calibrated yet: nothing to push
    assert fake._pushed_scales is None
    gen.input_global_scales = {n: torch.tensor(100.0) for n in names}
    push(fake)
    assert float(q.input_global_scale) == 100.0 and fake._pushed_scales == (gen.input_global_scales, q.weight.device)
    q.input_global_scale = torch.tensor(7.0)  # a push would overwrite this: the same dict pushes nothing
    push(fake)
    assert float(q.input_global_scale) == 7.0
    gen.input_global_scales = {n: torch.tensor(200.0) for n in names}  # a recalibration
    push(fake)
    assert float(q.input_global_scale) == 200.0
    q.input_global_scale = torch.tensor(7.0)
    fake._pushed_scales = (gen.input_global_scales, torch.device("meta"))  # as if the model moved since the push
    push(fake)
    assert float(q.input_global_scale) == 200.0 and fake._pushed_scales[1] == q.weight.device


def test_is_moe_experts_reads_the_registered_3d_projections():
    from triage_trl.nvfp4.experts import is_moe_experts

    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 4))
    assert not is_moe_experts(experts)  # down_proj missing
    experts.down_proj = nn.Parameter(torch.zeros(2, 4, 4))
    assert is_moe_experts(experts)
    flat = nn.Module()
    flat.gate_up_proj, flat.down_proj = nn.Parameter(torch.zeros(8, 4)), nn.Parameter(torch.zeros(4, 4))
    assert not is_moe_experts(flat) and not is_moe_experts(nn.Linear(4, 4))
