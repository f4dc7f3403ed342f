"""The compute dtype both engines choose from the CPU's instruction set (``triage_trl.runtime.engine_dtype``): bf16
where bf16 GEMMs run natively, float32 where they would be emulated (AVX2 only). The ISA probe is patched, so both
paths are checked on every CPU kind."""

from __future__ import annotations

import pytest
import torch

from triage_trl import runtime


@pytest.fixture(params=[False, True], ids=["avx2-only", "native-bf16"])
def native_bf16(request, monkeypatch):
    """A patched ISA probe (``runtime.native_bf16_gemm``): ``False`` as on an AVX2-only CPU, ``True`` as with
    AVX512-BF16 or AMX."""
    monkeypatch.setattr(runtime, "native_bf16_gemm", lambda device_type="cpu": request.param)
    return request.param


def test_engine_dtype_follows_the_isa_probe(native_bf16):
    expected = torch.bfloat16 if native_bf16 else torch.float32
    assert runtime.engine_dtype("cpu") is expected
    assert runtime.compute_dtype_reason("cpu").startswith("bfloat16" if native_bf16 else "float32")
    assert runtime.engine_dtype("cuda") is torch.bfloat16  # the probe is never asked for a GPU


def test_learner_nvfp4_gemms_follow_the_isa_probe(native_bf16):
    from triage_trl.nvfp4.config import NVFP4Config

    assert NVFP4Config().resolved_nvfp4_emulation_dtype("cpu") == ("bf16" if native_bf16 else "fp32")
    assert NVFP4Config(nvfp4_emulation_dtype="bf16").resolved_nvfp4_emulation_dtype("cpu") == "bf16"  # explicit wins


def test_emulated_layer_never_runs_an_emulated_bf16_gemm(native_bf16, monkeypatch):
    """With bf16 operands on a CPU without bf16 instructions the layer multiplies in float32 (the same bf16-exact
    operands) and rounds to bf16; with native bf16 the GEMM runs in bf16."""
    from triage_trl.nvfp4 import emulated

    seen = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(emulated.F, "linear", lambda x, w, b=None: seen.append(x.dtype) or linear(x, w, b))
    layer = emulated.NVFP4EmulatedLinear.from_linear(torch.nn.Linear(32, 16, bias=False), compute_dtype=torch.bfloat16,
                                                     compiled=False)
    out = layer(torch.randn(4, 32))
    assert seen == [torch.bfloat16 if native_bf16 else torch.float32]
    assert out.dtype is torch.float32 and torch.isfinite(out).all()


def test_sampler_dtype_and_gemm_follow_the_isa_probe(native_bf16):
    pytest.importorskip("vllm")
    from triage_trl.sampler import cpu_kernel
    from triage_trl.sampler.vllm_engine import sampler_dtype

    assert sampler_dtype() is (torch.bfloat16 if native_bf16 else torch.float32)
    weight = torch.randn(24, 32)
    for dtype in (torch.float32, torch.bfloat16):
        gemm, name = cpu_kernel._make_gemm(weight.to(dtype))
        x = torch.randn(3, 32).to(dtype)
        if dtype is torch.bfloat16 and not native_bf16:
            assert name == "torch.matmul (float32)"  # bf16 operands, product formed in float32
        else:
            assert name.startswith(("onednn_mm", "torch.matmul")) and name != "torch.matmul (float32)"
        assert gemm(x).dtype is dtype
        torch.testing.assert_close(gemm(x).float(), x.float() @ weight.to(dtype).float().t(), rtol=2**-7, atol=1e-4)


def test_sampler_tensors_cast_only_to_the_engine_dtype():
    from triage_trl.sampler.vllm_engine import sampler_tensors

    w32, packed = torch.randn(4, 4), torch.zeros(4, 2, dtype=torch.uint8)
    pairs = [("a.weight", w32), ("b.weight_packed", packed), ("c.weight_global_scale", torch.ones(1))]
    as_fp32 = dict(sampler_tensors(pairs, torch.float32))
    assert as_fp32["a.weight"].data_ptr() == w32.data_ptr()  # a float32 engine takes float32 weights without a copy
    as_bf16 = dict(sampler_tensors(pairs, torch.bfloat16))
    assert as_bf16["a.weight"].dtype is torch.bfloat16 and as_bf16["c.weight_global_scale"].dtype is torch.float32
    assert as_bf16["b.weight_packed"] is packed


def test_a_bf16_learner_on_a_cpu_without_bf16_instructions_is_warned_about(native_bf16, caplog):
    import logging

    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="triage_trl"):
        line = runtime.check_learner_dtype(model, "cpu")
    assert line.startswith("Compute dtype on cpu: " + ("bfloat16" if native_bf16 else "float32"))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == (0 if native_bf16 else 1)
    caplog.clear()
    runtime.check_learner_dtype(torch.nn.Linear(4, 4), "cpu")  # float32: nothing to warn about
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
