"""The NVFP4 sampler's kernel choice on a GPU without W4A4 kernels (Hopper), simulated on CPU: vLLM's own selection
(``init_nvfp4_linear_kernel``) runs with sm90 kernel support patched in, under the engine arguments the sampler passes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from triage_trl.nvfp4.config import NVFP4Config
from triage_trl.sampler.kernel_choice import (
    check_sampler_kernel, resolve_sampler_kernel, sampler_kernel_engine_kwargs,
)

HOPPER_KERNELS = {"MarlinNvFp4LinearKernel", "EmulationNvFp4LinearKernel"}
MARLIN_REPORT = {"activations": "bf16 (weight-only NVFP4 kernel)",
                 "linear_kernels": "CompressedTensorsW4A4Fp4/MarlinNvFp4LinearKernel x14"}
EMULATION_REPORT = {"activations": "nvfp4 (static per-tensor scale)",
                    "linear_kernels": "CompressedTensorsW4A4Fp4/EmulationNvFp4LinearKernel x14"}


@pytest.mark.parametrize("choice, device, capability, kernel", [
    ("auto", "cpu", None, "w4a4"),
    ("auto", "cuda", 100, "w4a4"),
    ("auto", "cuda", 90, "w4a4_emulation"),
    ("w4a4_emulation", "cuda", 100, "w4a4_emulation"),
    ("weight_only", "cuda", 90, "weight_only"),
])
def test_resolved_kernel(choice, device, capability, kernel):
    assert resolve_sampler_kernel(choice, device, capability)[0] == kernel


def test_choices_a_platform_cannot_run_are_refused():
    with pytest.raises(ValueError, match="sm90.*weight-only Marlin.*w4a4_emulation"):
        resolve_sampler_kernel("w4a4", "cuda", 90)
    with pytest.raises(ValueError, match="needs a GPU"):
        resolve_sampler_kernel("weight_only", "cpu")


@pytest.fixture
def hopper(monkeypatch):
    """vLLM's kernel registry as on an sm90 GPU: only weight-only kernels and the W4A4 emulation are supported."""
    import vllm.model_executor.kernels.linear as linear
    from vllm.platforms import PlatformEnum

    monkeypatch.setattr(linear.current_platform, "_enum", PlatformEnum.CUDA)
    monkeypatch.setattr(linear.current_platform, "get_device_capability",
                        lambda device_id=0: SimpleNamespace(to_int=lambda: 90))
    for kernel in linear._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA]:
        ok = kernel.__name__ in HOPPER_KERNELS
        monkeypatch.setattr(kernel, "is_supported",
                            classmethod(lambda cls, cc=None, ok=ok: (ok, None if ok else "needs sm100")))
    return linear


def _vllm_pick(linear, engine_kwargs) -> str:
    from vllm.config import KernelConfig, VllmConfig, set_current_vllm_config

    kernel_config = KernelConfig(**engine_kwargs.get("kernel_config", {}))
    with set_current_vllm_config(VllmConfig(kernel_config=kernel_config)):
        return type(linear.init_nvfp4_linear_kernel()).__name__


def test_vllm_alone_falls_back_to_weight_only_on_hopper(hopper):
    assert _vllm_pick(hopper, {}) == "MarlinNvFp4LinearKernel"  # the defect: W4A16 sampler, W4A4 learner
    with pytest.raises(RuntimeError, match="weight-only NVFP4 kernel while the learner quantises"):
        check_sampler_kernel("w4a4", MARLIN_REPORT)


def test_auto_forces_w4a4_emulation_on_hopper(hopper):
    from triage_trl.sampler.vllm_generation import TriageVLLMGeneration

    sampler = SimpleNamespace(sampler_precision="nvfp4", nvfp4_config=NVFP4Config(), sampler_kernel=None)
    monkey_platform = hopper.current_platform
    monkey_platform.is_cpu = lambda: False  # the sampler reads the same platform object as vLLM's selection
    try:
        kwargs = TriageVLLMGeneration._choose_nvfp4_kernel(sampler)
    finally:
        del monkey_platform.is_cpu
    assert sampler.sampler_kernel[0] == "w4a4_emulation"
    assert kwargs == {"kernel_config": {"linear_backend_per_quant": {"nvfp4_w4a4": "emulation"}}}
    assert _vllm_pick(hopper, kwargs) == "EmulationNvFp4LinearKernel"
    check_sampler_kernel("w4a4_emulation", EMULATION_REPORT)  # W4A4 on both engines: accepted
    assert NVFP4Config().quantizes_activations


def test_weight_only_makes_both_engines_w4a16(hopper):
    kwargs = sampler_kernel_engine_kwargs("weight_only", "cuda")
    assert _vllm_pick(hopper, kwargs) == "MarlinNvFp4LinearKernel"
    check_sampler_kernel("weight_only", MARLIN_REPORT)
    with pytest.raises(RuntimeError, match="vLLM quantises them"):
        check_sampler_kernel("weight_only", EMULATION_REPORT)
    config = NVFP4Config(learner_precision="nvfp4", sampler_precision="nvfp4", nvfp4_sampler_kernel="weight_only")
    assert not config.quantizes_activations


def test_weight_only_learner_layer_leaves_activations_unquantised():
    from triage_trl.nvfp4.emulated import NVFP4EmulatedLinear
    from triage_trl.nvfp4.quantize import nvfp4_fake_quantize_reference

    torch.manual_seed(0)
    layer = NVFP4EmulatedLinear.from_linear(torch.nn.Linear(64, 32, bias=False), name="l", compiled=False,
                                            compute_dtype=torch.float32, quantize_input=False)
    x = torch.randn(3, 7, 64)
    w_dq = nvfp4_fake_quantize_reference(layer.weight.detach())
    torch.testing.assert_close(layer(x), F.linear(x, w_dq), rtol=0, atol=1e-6)
    assert "W4A16" in layer.extra_repr()
    layer.quantize_input = True
    assert not torch.allclose(layer(x), F.linear(x, w_dq), atol=1e-3)


def test_cpu_engine_arguments_pick_the_projects_kernels():
    assert sampler_kernel_engine_kwargs("w4a4", "cpu") == {"nvfp4_cpu_kernel": "fast"}
    assert sampler_kernel_engine_kwargs("w4a4_emulation", "cpu") == {"nvfp4_cpu_kernel": "emulation"}
    assert sampler_kernel_engine_kwargs("w4a4", "cuda") == {}
