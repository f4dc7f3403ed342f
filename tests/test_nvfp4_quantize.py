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


def test_one_graph_whatever_the_shape_or_grad_mode():
    """A square first input and then other shapes, with and without grad mode, reuse one compiled graph (each
    recompile costs about a second per process with a warm compile cache, several with a cold one)."""
    from torch._dynamo.utils import counters

    scale = torch.tensor(448 * 6 / 4.0)
    q.nvfp4_fake_quantize_vllm(torch.randn(128, 128), scale)  # compiled here unless an earlier test did
    graphs = counters["stats"]["unique_graphs"]
    for shape in ((48, 256), (3, 40, 64), (256, 32)):
        x = torch.randn(*shape)
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                out = q.nvfp4_fake_quantize_vllm(x, scale)
            assert torch.equal(out, q.nvfp4_fake_quantize_vllm(x, scale, compiled=False))
    assert counters["stats"]["unique_graphs"] == graphs and q.compile_available()  # compiled, not the eager fallback


def test_bad_inputs_raise_and_switch_nothing_off():
    with pytest.raises(ValueError, match="multiple of 16"):
        q.nvfp4_fake_quantize(torch.randn(4, 24))
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        q.nvfp4_fake_quantize(torch.randn(4, 16).half())
    assert q.compile_failures() == {}


def test_empty_input_returns_empty_and_keeps_the_compiled_path():
    for fn in (q.nvfp4_fake_quantize, q.nvfp4_fake_quantize_reference, lambda x: q.nvfp4_fake_quantize_vllm(x, torch.tensor(1.0))):
        out = fn(torch.zeros(0, 32))
        assert out.shape == (0, 32) and out.dtype == torch.float32
    assert q.compile_failures() == {} and q.compile_available()
    x = torch.randn(4, 32)
    assert torch.equal(q.nvfp4_fake_quantize(x), q.nvfp4_fake_quantize_reference(x))


def test_compiled_and_eager_paths_give_the_same_bits():
    x = (torch.randn(16, 64, generator=torch.Generator().manual_seed(5)) ** 3).bfloat16()
    assert torch.equal(_bits(q.nvfp4_fake_quantize(x, compiled=False)), _bits(q.nvfp4_fake_quantize(x)))
    gs = torch.tensor(448 * 6 / 3.0)
    assert torch.equal(_bits(q.nvfp4_fake_quantize_vllm(x, gs, compiled=False)), _bits(q.nvfp4_fake_quantize_vllm(x, gs)))


def test_only_a_real_compile_failure_switches_a_kernel_to_eager(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(q, "_compiled", {})
    monkeypatch.setattr(q, "_failed", {})
    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.raises(ValueError, match="multiple of 16"):  # bad input is refused before any kernel runs
        q.nvfp4_fake_quantize(torch.randn(2, 24))
    assert q.compile_failures() == {}
    x = torch.randn(3, 32)
    assert torch.equal(q.nvfp4_fake_quantize(x), q.nvfp4_fake_quantize_reference(x))  # eager result, same bits
    assert list(q.compile_failures()) == [("quant_dequant_torchao_dynamic", "cpu")]
    assert "no C++ compiler" in q.compile_failures()[("quant_dequant_torchao_dynamic", "cpu")]
    assert not q.compile_available("cpu") and q.compile_available("cuda")


def test_e2m1_rounding_is_torchaos_on_every_tie_and_between():
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, f4_unpacked_to_f32

    grid = torch.tensor(nx.E2M1_GRID)
    ties = (grid[1:] + grid[:-1]) / 2
    y = torch.cat([grid, ties, torch.linspace(0, 6, 10_001), torch.nextafter(ties, torch.tensor(0.0)),
                   torch.nextafter(ties, torch.tensor(7.0))])
    y = torch.cat([y, -y])
    torchao = f4_unpacked_to_f32(f32_to_f4_unpacked(y))
    assert torch.equal(_bits(nx.round_to_e2m1(y)), _bits(torchao))  # sign of zero included


def test_e2m1_codes_of_the_export_are_torchaos():
    x = (torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) ** 3).bfloat16()
    pts = torch.tensor(2.0**-9)
    values, block_scale = nx.quantize_torchao(x, pts)
    reference = q.nvfp4_quantize(x, pts)
    assert torch.equal(nx.encode_e2m1(values.reshape(x.shape)), reference.qdata.view(torch.uint8))
    assert torch.equal(block_scale.to(torch.float8_e4m3fn).view(torch.uint8), reference.scale.view(torch.uint8))


def test_e2m1_codes_are_torchaos_including_the_sign_of_zero():
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked

    grid = torch.tensor(nx.E2M1_GRID)
    values = torch.cat([grid, -grid]).repeat(8).reshape(8, 16)  # -0.0 included: code 8
    expected = f32_to_f4_unpacked(values).to(torch.int32)
    assert torch.equal(nx.e2m1_codes(values), expected)
    assert torch.equal(torch.compile(nx.e2m1_codes, dynamic=True)(values), expected)


def test_scale_rules_are_torchaos_and_compressed_tensors():
    from compressed_tensors.quantization.utils import generate_gparam
    from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

    for amax in (1e-30, 0.013, 0.5, 1.0, 3.7, 2688.0, 1e4, 3e30):
        a = torch.tensor(amax)
        assert torch.equal(nx.per_tensor_scale_from_amax(a), per_tensor_amax_to_scale(a))
        ideal = generate_gparam(torch.zeros(1), a.reshape(1)).item()
        assert ideal == (2688.0 / a).item()  # compressed-tensors' divisor, the float32 division
        g = nx.global_scale_from_amax(a).item()
        assert g <= ideal < 2 * g and torch.frexp(torch.tensor(g)).mantissa.item() == 0.5
    assert nx.per_tensor_scale_from_amax(torch.tensor(0.0)).item() == 1.0
    assert nx.global_scale_from_amax(torch.tensor(0.0)).item() == 1.0
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="layer 7 holds NaN or inf"):
            nx.global_scale_from_amax(torch.tensor(bad), "layer 7")


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


def test_four_over_six_picks_the_block_scale_with_less_error():
    pts = torch.tensor(1.0)
    # block 0: 5 sits between 4 and 6 on the plain grid (error 1); mapping the max to 4 (scale 1.5) gives 4.5
    # block 1: 1 is exact with scale 1; with scale 1.5 it would round to 0.75
    x = torch.tensor([[6.0] + [5.0] * 15 + [6.0] + [1.0] * 15])
    plain = torch.tensor([[6.0] + [4.0] * 15 + [6.0] + [1.0] * 15])
    chosen = torch.tensor([[6.0] + [4.5] * 15 + [6.0] + [1.0] * 15])
    assert torch.equal(q.nvfp4_fake_quantize(x, pts), plain)
    assert torch.equal(q.nvfp4_fake_quantize(x, pts, four_over_six=True), chosen)
    values, scale = nx.quantize_torchao(x, pts, four_over_six=True)
    assert scale.tolist() == [[1.5, 1.0]] and values.abs().max().item() == 6.0


def test_four_over_six_never_increases_a_blocks_error():
    # float32: the decoded values are compared exactly as the rule compares them (no output rounding)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)) ** 3
    pts = nx.dynamic_per_tensor_scale(x)
    err = {flag: (q.nvfp4_fake_quantize(x, pts, four_over_six=flag) - x).reshape(64, 16, 16).square().sum(-1)
           for flag in (False, True)}
    assert bool((err[True] <= err[False]).all()) and err[True].sum() < err[False].sum()
    assert torch.equal(_bits(q.nvfp4_fake_quantize(x, pts, four_over_six=True, compiled=False)),
                       _bits(q.nvfp4_fake_quantize(x, pts, four_over_six=True)))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_quantize_packed_and_dequantize_packed_are_the_export_and_vllm_bit_for_bit(compiled, four_over_six):
    """The sync's one-pass quantise-and-pack equals torchao's quantisation packed by torchao's helpers, and the
    sampler kernel's one-pass dequantiser equals vLLM's ``dequantize_to_dtype`` (float32 and bf16), on heavy-tailed
    weights with zero and negative-tiny blocks (signed zero codes)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    from triage_trl.nvfp4.quantize import nvfp4_dequantize_packed, nvfp4_quantize_packed

    w = torch.randn(96, 80, generator=torch.Generator().manual_seed(11)) ** 3
    w[0, :16], w[1, :16] = 0.0, -1e-9
    global_scale = nx.global_scale_from_amax(w.abs().amax())
    q, block_scale = nx.quantize_torchao(w, 1.0 / global_scale, four_over_six)
    packed, scale = nvfp4_quantize_packed(w, 1.0 / global_scale, four_over_six=four_over_six, compiled=compiled)
    assert torch.equal(packed, nx.encode_e2m1(q.reshape(w.shape)))
    assert torch.equal(scale.view(torch.uint8), block_scale.to(torch.float8_e4m3fn).view(torch.uint8))
    multiplier = (1.0 / global_scale).reshape(1)
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        reference = dequantize_to_dtype(packed, scale, multiplier, dtype, 16, swizzle=False)
        ours = nvfp4_dequantize_packed(packed, scale, multiplier, dtype, compiled=compiled)
        assert torch.equal(ours.view(bits), reference.view(bits)), dtype
    # the direct sync's values, from the quantisation pass itself: what vLLM decodes, and the same codes (several
    # heavy-tailed weights: the "4 over 6" choice between two block scales must fall alike in both compiled passes)
    for seed, shape in ((11, (96, 80)), (12, (256, 576)), (13, (40, 1536))):
        w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) ** 3
        w[0, :16] = 0.0
        per_tensor = 1.0 / nx.global_scale_from_amax(w.abs().amax())
        packed, scale = nvfp4_quantize_packed(w, per_tensor, four_over_six=four_over_six, compiled=compiled)
        for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
            reference = dequantize_to_dtype(packed, scale, per_tensor.reshape(1), dtype, 16, swizzle=False)
            packed2, scale2, values = nvfp4_quantize_packed(w, per_tensor, four_over_six=four_over_six,
                                                            compiled=compiled, values_dtype=dtype)
            assert torch.equal(values.view(bits), reference.view(bits)), (seed, dtype)
            assert torch.equal(packed2, packed) and torch.equal(scale2.view(torch.uint8), scale.view(torch.uint8))


def test_pack_codes_is_torchaos_pack_uint4():
    """Two codes a byte, element 2j in the low nibble: torchao's layout on every pair of codes and on a batch of
    rows of another width."""
    from torchao.prototype.mx_formats.kernels import pack_uint4

    codes = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8).reshape(4, 128)
    assert torch.equal(nx.pack_codes(codes), pack_uint4(codes))
    rows = torch.randint(0, 16, (2, 3, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(nx.pack_codes(rows), pack_uint4(rows))
