"""NVFP4 quantiser: E2M1 grid, block/tensor scales by hand, and the compiled fast path's bit-exactness
against torchao's ``NVFP4Tensor.to_nvfp4(...).dequantize()``."""

import pytest
import torch

from triage_trl.nvfp4 import numerics as nx
from triage_trl.nvfp4 import quantize as q



def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def test_e2m1_grid_codes_and_packing():
    grid = torch.tensor(nx.E2M1_GRID)
    x = torch.cat([grid, -grid]).reshape(1, 16)  # amax 6 -> block scale 1 with per-tensor scale 1
    qt = q.nvfp4_quantize(x, torch.tensor(1.0))
    # codes 0..15 in element order, element 2j in the low nibble (compressed-tensors' packing)
    expected = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    assert torch.equal(qt.qdata.view(torch.uint8), expected.reshape(1, 8))
    assert qt.scale.float().item() == 1.0
    assert torch.equal(qt.dequantize(torch.float32), x)


def test_e2m1_rounding_ties_to_even():
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.2, 0.3, 2.6, 4.9, 5.1, -0.75, -5.0, 0.0]])
    expected = torch.tensor([[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, 0.5, 3.0, 4.0, 6.0, -1.0, -4.0, 0.0]])
    one = torch.tensor(1.0)
    assert torch.equal(q.nvfp4_fake_quantize_reference(x, one), expected)
    assert torch.equal(q.nvfp4_fake_quantize(x, one), expected)


def test_block_and_tensor_scales_by_hand():
    # Row 0: block 0 holds the tensor amax 2688 -> per-tensor scale 2688 / (448 * 6) = 1 and block
    # scale 2688 / 6 = 448 (E4M3 max). Block 1 has amax 1 -> 1/6 rounds to E4M3 0.171875 (=11/64);
    # 1 / 0.171875 = 5.82 -> 6, 0.5 / 0.171875 = 2.91 -> 3.
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0
    x[0, 16] = 1.0
    x[0, 17] = 0.5
    assert nx.dynamic_per_tensor_scale(x).item() == 1.0
    qt = q.nvfp4_quantize(x)
    assert qt.per_tensor_scale.item() == 1.0
    assert qt.scale.float().tolist() == [[448.0, 0.171875]]
    deq = qt.dequantize(torch.float32)
    assert deq[0, 0].item() == 2688.0
    assert deq[0, 16].item() == 6 * 0.171875
    assert deq[0, 17].item() == 3 * 0.171875
    assert torch.equal(q.nvfp4_fake_quantize(x), deq)


def test_given_per_tensor_scale_scales_block_scales():
    # per-tensor scale 2**-4: block amax 3 -> block scale 0.5 / 2**-4 = 8 (exact in E4M3).
    x = torch.linspace(-3, 3, 16).reshape(1, 16)
    qt = q.nvfp4_quantize(x, torch.tensor(2.0**-4))
    assert qt.scale.float().item() == 8.0
    assert torch.equal(qt.dequantize(torch.float32)[0, [0, -1]], torch.tensor([-3.0, 3.0]))


def test_all_zero_tensor_decodes_to_zero():
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    assert nx.dynamic_per_tensor_scale(x).item() == 1.0
    assert torch.equal(q.nvfp4_fake_quantize(x), x)
    assert torch.equal(q.nvfp4_fake_quantize_reference(x), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(8, 64), (3, 5, 32), (2, 3, 4, 48)])
def test_fast_path_bit_exact_vs_torchao(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    # heavy-tailed values with per-column spread, some all-zero blocks
    x = (torch.randn(shape, generator=g) ** 3 * torch.rand(shape[-1], generator=g) * 5).to(dtype)
    x.reshape(-1, shape[-1])[0, :16] = 0
    ref = q.nvfp4_fake_quantize_reference(x)
    fast = q.nvfp4_fake_quantize(x)
    assert fast.shape == x.shape and fast.dtype == dtype
    assert torch.equal(_bits(fast), _bits(ref))
    pts = nx.dynamic_per_tensor_scale(x) * 1.37
    assert torch.equal(_bits(q.nvfp4_fake_quantize(x, pts)), _bits(q.nvfp4_fake_quantize_reference(x, pts)))


def test_fast_path_non_contiguous_input():
    x = torch.randn(64, 48, dtype=torch.bfloat16).t()  # [48, 64], non-contiguous
    assert not x.is_contiguous()
    assert torch.equal(_bits(q.nvfp4_fake_quantize(x)), _bits(q.nvfp4_fake_quantize_reference(x.contiguous())))


def test_fast_path_is_compiled_here():
    q.nvfp4_fake_quantize(torch.randn(4, 16))
    assert q.compile_available(), "torch.compile failed on this machine; the fast path fell back"


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="multiple of 16"):
        q.nvfp4_fake_quantize(torch.randn(4, 24))
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        q.nvfp4_fake_quantize(torch.randn(4, 16).half())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU twin is test_fast_path_bit_exact_vs_torchao")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_fast_path_bit_exact_vs_torchao_and_cpu(dtype):
    x = (torch.randn(256, 512, generator=torch.Generator().manual_seed(3)) ** 3).to(dtype)
    cpu = q.nvfp4_fake_quantize(x)
    fast = q.nvfp4_fake_quantize(x.cuda())
    assert fast.is_cuda
    assert torch.equal(_bits(fast), _bits(q.nvfp4_fake_quantize_reference(x.cuda())))
    assert torch.equal(_bits(fast.cpu()), _bits(cpu))
