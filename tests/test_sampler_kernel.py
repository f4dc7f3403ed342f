"""FastCpuNvFp4LinearKernel against vLLM's EmulationNvFp4LinearKernel (CPU, no engine)."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.kernels.linear import EmulationNvFp4LinearKernel  # noqa: E402
from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig  # noqa: E402
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (  # noqa: E402
    ref_nvfp4_quant_dequant,
)
from vllm.platforms import current_platform  # noqa: E402

from nvfp4_bounds import gemm_rounding_bound  # noqa: E402
from triage_trl.nvfp4.numerics import round_to_e4m3  # noqa: E402
from triage_trl.sampler.cpu_kernel import FastCpuNvFp4LinearKernel, nvfp4_quant_dequant_activations  # noqa: E402

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="the fast NVFP4 kernel is the CPU platform's")


def _random_nvfp4_layer(out_features: int, in_features: int, seed: int, dtype=torch.bfloat16) -> torch.nn.Module:
    """A module carrying what vLLM's compressed-tensors NVFP4 scheme leaves on a layer after loading."""
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    packed = torch.randint(0, 256, (out_features, in_features // 2), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out_features, in_features // 16, generator=g) * 400 + 0.01).to(torch.float8_e4m3fn)
    layer.weight = torch.nn.Parameter(packed, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scales, requires_grad=False)
    layer.weight_global_scale = torch.nn.Parameter(torch.tensor(1 / 2048.0), requires_grad=False)
    layer.input_global_scale_inv = torch.nn.Parameter(torch.tensor(448 * 6 / 5.0), requires_grad=False)
    layer.params_dtype = dtype
    return layer


def _activations(shape, seed, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 3
    x = x.to(dtype)
    flat = x.view(-1, shape[-1])
    flat[0, :16] = 0  # an all-zero block
    if flat.shape[0] > 1:
        flat[1, 3] = 50.0  # a block clipped by the static global scale
    return x


def _assert_within_gemm_rounding(y1, y2, x_dq, w_dq):
    diff = (y1.float() - y2.float()).abs()
    bound = gemm_rounding_bound(x_dq, w_dq, y1, y2)
    assert bool((diff <= bound).all()), f"max excess {(diff - bound).max().item():.3g}"


def test_integer_e4m3_rounding_equals_torch_fp8_cast():
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite value >= 0
    midpoints = (codes[1:] + codes[:-1]) / 2  # the round-to-nearest-even ties
    g = torch.Generator().manual_seed(0)
    s = torch.cat([codes, midpoints, torch.rand(200_000, generator=g) * 448, torch.rand(100_000, generator=g) * 2**-5])
    assert torch.equal(round_to_e4m3(s), s.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("m,k", [(1, 16), (7, 128), (33, 576), (300, 1536)])
@pytest.mark.parametrize("compiled", [False, True])
def test_activation_quant_dequant_bit_identical_to_vllm(m, k, compiled):
    x = _activations((m, k), seed=m + k)
    gs = torch.tensor(448 * 6 / 4.0)
    ref = ref_nvfp4_quant_dequant(x, gs, 16)
    out = nvfp4_quant_dequant_activations(x, gs, compiled=compiled)
    assert out.dtype == x.dtype
    assert torch.equal(out, ref)


def test_activation_quant_dequant_ties_follow_vllm():
    # Scaled values exactly on E2M1 rounding boundaries; block amax 6 and global scale 448 make the block scale 448,
    # so scaled = x * 1 in the quantiser's frame.
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0, 0.1, 4.2, 1.0, 0.0])
    x = (edges / 448.0 * 448.0).reshape(1, 16).to(torch.float32)
    gs = torch.tensor(448.0)
    ref = ref_nvfp4_quant_dequant(x, gs, 16)
    assert torch.equal(nvfp4_quant_dequant_activations(x, gs), ref)
    assert torch.equal(nvfp4_quant_dequant_activations(x, gs, compiled=False), ref)


def test_activation_quant_dequant_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quant_dequant_activations(torch.zeros(2, 24), torch.tensor(1.0))
    with pytest.raises(ValueError, match="2-D"):
        nvfp4_quant_dequant_activations(torch.zeros(2, 2, 16), torch.tensor(1.0))


@pytest.mark.parametrize("out_features,in_features", [(64, 128), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("x_shape", [(1,), (5,), (37,), (2, 9)])
def test_fast_kernel_matches_emulation_kernel(out_features, in_features, x_shape):
    """Same W4A4 numbers: weights and activations bit-identical (asserted), the GEMM may round differently: the two
    bf16 GEMMs accumulate in fp32 in different orders and round once to bf16 (``gemm_rounding_bound``)."""
    layer = _random_nvfp4_layer(out_features, in_features, seed=out_features)
    bias = torch.randn(out_features).to(torch.bfloat16)
    fast = FastCpuNvFp4LinearKernel(NvFp4LinearLayerConfig())
    emu = EmulationNvFp4LinearKernel(NvFp4LinearLayerConfig())
    fast.process_weights_after_loading(layer)
    emu.process_weights_after_loading(layer)
    x = _activations((*x_shape, in_features), seed=len(x_shape) + in_features)
    out_fast = fast.apply_weights(layer, x)
    out_emu = emu.apply_weights(layer, x.reshape(-1, in_features)).reshape(*x_shape, out_features)
    assert torch.equal(fast.apply_weights(layer, x, bias), out_fast + bias)
    assert out_fast.shape == out_emu.shape == (*x_shape, out_features)
    assert out_fast.dtype == torch.bfloat16
    x2d = x.reshape(-1, in_features)
    x_dq, w_dq = ref_nvfp4_quant_dequant(x2d, layer.input_global_scale_inv, 16), layer.nvfp4_dequantised.weight
    assert torch.equal(nvfp4_quant_dequant_activations(x2d, layer.input_global_scale_inv), x_dq)
    _assert_within_gemm_rounding(out_fast.reshape(-1, out_features), out_emu.reshape(-1, out_features), x_dq, w_dq)


def test_fast_kernel_refreshes_cache_when_weights_are_processed_again():
    layer = _random_nvfp4_layer(64, 128, seed=1)
    kernel = FastCpuNvFp4LinearKernel(NvFp4LinearLayerConfig())
    kernel.process_weights_after_loading(layer)
    x = _activations((4, 128), seed=2)
    before = kernel.apply_weights(layer, x)
    layer.weight.data.copy_(torch.randint(0, 256, layer.weight.shape, dtype=torch.uint8))
    assert torch.equal(kernel.apply_weights(layer, x), before)  # the cache is per weight load ...
    kernel.process_weights_after_loading(layer)  # ... which vLLM's reload_weights re-runs
    after = kernel.apply_weights(layer, x)
    emu = EmulationNvFp4LinearKernel(NvFp4LinearLayerConfig())
    expected = emu.apply_weights(layer, x)
    assert not torch.equal(after, before)
    x_dq = ref_nvfp4_quant_dequant(x, layer.input_global_scale_inv, 16)
    _assert_within_gemm_rounding(after, expected, x_dq, layer.nvfp4_dequantised.weight)


def test_fast_kernel_refuses_mismatched_activation_dtype():
    layer = _random_nvfp4_layer(32, 64, seed=3)
    kernel = FastCpuNvFp4LinearKernel(NvFp4LinearLayerConfig())
    kernel.process_weights_after_loading(layer)
    with pytest.raises(TypeError, match="dtype"):
        kernel.apply_weights(layer, torch.zeros(2, 64, dtype=torch.float32))
