"""A fast CPU NVFP4 W4A4 linear kernel for vLLM, with the numbers of vLLM's emulation kernel.

vLLM has no native NVFP4 GEMM on CPU. Its fallback, ``EmulationNvFp4LinearKernel``, recomputes the
whole dequantised weight from the packed E2M1 nibbles on *every* forward call and quantises the
activations with a chain of boolean-mask assignments; on this CPU it is 30-50x slower than bf16.

``FastCpuNvFp4LinearKernel`` computes the same W4A4 numbers:

    y = Q_dq(x; s_x) @ W_dq^T

with ``W_dq = e2m1(weight_packed) * fp8(weight_scale) * weight_global_scale`` (in the model dtype)
and ``Q_dq`` vLLM's NVFP4 activation quantise-dequantise (16-element blocks, FP8 E4M3 block scales,
the checkpoint's per-tensor ``input_global_scale``), but:

* the weights are dequantised **once per weight load**, in ``process_weights_after_loading``, with
  vLLM's ``dequantize_to_dtype`` numerics in one compiled pass (``nvfp4.quantize.nvfp4_dequantize_packed``, bit for
  bit), or taken as the direct sync hands them over (``direct_write.DEQUANTISED_ATTR``: the same bits, computed by
  the export's quantisation pass). vLLM re-runs that hook for every layer on
  ``model_runner.reload_weights(..., is_checkpoint_format=True)``, so an in-place weight sync
  refreshes the cache (the cache is a plain attribute of the layer, replaced by the hook, not a
  parameter or buffer that the layerwise reload would copy back or skip);
* the activation quantise-dequantise is one ``torch.compile``'d (fused) elementwise pass whose ops
  reproduce ``ref_nvfp4_quant_dequant`` bit for bit: the learner's own sampler-mode activation quantiser,
  ``triage_trl.nvfp4.numerics.quant_dequant_vllm``;
* the GEMM is one oneDNN matmul on a prepacked weight in the engine's dtype (the same primitive vLLM's CPU linear
  layers use; float32 on CPUs without bf16 instructions, ``triage_trl.runtime.engine_dtype``), or ``torch.matmul``
  where vLLM was built without oneDNN.

Numerics against ``EmulationNvFp4LinearKernel``: the dequantised weights and the quantised
activations are bit-identical; the only difference is the GEMM's accumulation order (oneDNN
prepacked vs ``torch.matmul``), i.e. at most one bf16 rounding of the output
(relative error <= 2**-8 per element; see ``tests/test_sampler_kernel.py``).

Source: vLLM 0.31 ``model_executor/kernels/linear/nvfp4/emulation.py`` and
``layers/quantization/utils/nvfp4_emulation_utils.py`` (the reference numerics), NVIDIA's NVFP4
format (E2M1 values, FP8 E4M3 scale per 16 elements, FP32 tensor scale).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel, NvFp4LinearLayerConfig

from ..nvfp4.numerics import BLOCK_SIZE
from .. import runtime
from ..nvfp4.quantize import nvfp4_dequantize_packed, nvfp4_fake_quantize_vllm
from .direct_write import DEQUANTISED_ATTR

logger = logging.getLogger(__name__)

__all__ = [
    "FastCpuNvFp4LinearKernel",
    "nvfp4_quant_dequant_activations",
    "register_fast_cpu_nvfp4_kernel",
]

def nvfp4_quant_dequant_activations(
    x: torch.Tensor, global_scale: torch.Tensor, *, compiled: bool = True
) -> torch.Tensor:
    """NVFP4 quantise-dequantise of activations, bit-identical to vLLM's ``ref_nvfp4_quant_dequant``.

    The learner's own activation quantiser in sampler mode (``nvfp4_fake_quantize_vllm``, built from
    ``triage_trl.nvfp4.numerics.quant_dequant_vllm``), restricted to vLLM's 2-D layout.

    Args:
        x: ``[m, k]`` activations (bf16/fp16/fp32), ``k`` a multiple of 16.
        global_scale: 0-d or 1-element fp32 tensor, the per-tensor scale in vLLM's *divisor*
            convention (``layer.input_global_scale_inv``, i.e. ``448 * 6 / amax``).
        compiled: run the ``torch.compile``'d fused pass (default) or the same ops eagerly.

    Returns:
        ``[m, k]`` tensor in ``x.dtype``: each 16-element block rounded to E2M1 values times its
        FP8 E4M3 block scale.

    Raises:
        ValueError: ``x`` is not 2-D or ``k`` is not a multiple of 16.
    """
    if x.ndim != 2 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"NVFP4 activations must be 2-D [tokens, k] with k a multiple of {BLOCK_SIZE}; "
            f"got shape {tuple(x.shape)}. Reshape to 2-D or keep this layer in bf16."
        )
    return nvfp4_fake_quantize_vllm(x, global_scale, compiled=compiled)


@dataclass
class _DequantisedWeight:
    """The layer's weights dequantised once per load, and the GEMM bound to them."""

    weight: torch.Tensor  # [out, in], model dtype
    gemm: Any  # callable (x2d) -> [tokens, out]
    gemm_name: str
    input_global_scale: torch.Tensor  # 0-d fp32, vLLM's divisor convention (layer.input_global_scale_inv)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def _make_gemm(weight: torch.Tensor):
    """The GEMM against ``weight`` [out, in] (bf16-exact dequantised values, held in the engine's dtype), as vLLM's
    CPU linear does it: vLLM's prepacked oneDNN matmul for a float32 engine (CPUs without bf16 instructions) and for
    a bf16 engine where this CPU multiplies bf16 natively (AVX512-BF16, AMX); for a bf16 engine elsewhere the product
    of the same bf16 operands formed in float32 and rounded to bf16 (same values up to accumulation order; torch's
    emulated bf16 GEMM is 10-500x slower there); ``torch.matmul`` where vLLM has no oneDNN."""
    from vllm import _custom_ops as ops

    if weight.dtype == torch.bfloat16 and not runtime.native_bf16_gemm("cpu"):
        weight32 = weight.float()
        return (lambda x2d: torch.matmul(x2d.float(), weight32.t()).to(weight.dtype)), "torch.matmul (float32)"
    if getattr(ops, "_supports_onednn", False):
        try:
            handler = ops.create_onednn_mm(weight.t(), 32)
        except RuntimeError as err:
            _warn_once(f"oneDNN has no {weight.dtype} matmul here ({err}); the NVFP4 kernel uses torch.matmul.")
        else:
            # The handler reads ``weight``'s memory; the dataclass keeps ``weight`` alive with it.
            return (lambda x2d: ops.onednn_mm(handler, x2d, None)), f"onednn_mm ({str(weight.dtype)[6:]})"
    return (lambda x2d: torch.matmul(x2d, weight.t())), "torch.matmul"


class FastCpuNvFp4LinearKernel(NvFp4LinearKernel):
    """NVFP4 W4A4 on CPU: cached dequantised weights, fused activation fake-quant, one bf16 GEMM.

    Registered for ``PlatformEnum.CPU`` by :func:`register_fast_cpu_nvfp4_kernel`. Reads the
    attributes vLLM's compressed-tensors NVFP4 scheme leaves on the layer after loading:
    ``weight`` (packed uint8 ``[out, in/2]``), ``weight_scale`` (fp8 ``[out, in/16]``),
    ``weight_global_scale`` (fp32 multiplier) and ``input_global_scale_inv`` (fp32 divisor).
    """

    #: counts weight loads (one per layer per load, decoded here or handed over by the direct sync); tests read it
    dequantisations = 0

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False, "FastCpuNvFp4LinearKernel runs on the vLLM CPU platform only"
        return True, None

    @classmethod
    def can_implement(cls, config: NvFp4LinearLayerConfig) -> tuple[bool, str | None]:
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        dtype = getattr(layer, "params_dtype", None)
        if dtype is None:
            raise ValueError(
                f"{type(layer).__name__} has no `params_dtype`; FastCpuNvFp4LinearKernel needs the "
                "model dtype to dequantise NVFP4 weights into. Use vLLM's linear layers."
            )
        packed = layer.weight.data.view(torch.uint8)
        # The direct sync hands over the values its export computed with the codes (direct_write: no decode twice)
        weight = layer.__dict__.pop(DEQUANTISED_ATTR, None)
        if weight is None or weight.dtype != dtype or weight.shape != (packed.shape[0], 2 * packed.shape[1]):
            weight = nvfp4_dequantize_packed(packed, layer.weight_scale.data, layer.weight_global_scale.data, dtype)
        gemm, gemm_name = _make_gemm(weight)
        # A plain attribute (not a parameter/buffer): vLLM's layerwise reload re-runs this hook on
        # the same module object, which replaces it with the new weights.
        layer.nvfp4_dequantised = _DequantisedWeight(
            weight=weight,
            gemm=gemm,
            gemm_name=gemm_name,
            input_global_scale=layer.input_global_scale_inv.data.detach().reshape(()).to(torch.float32).clone(),
        )
        type(self).dequantisations += 1

    def apply_weights(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cache: _DequantisedWeight = layer.nvfp4_dequantised
        if x.dtype != cache.weight.dtype:
            raise TypeError(
                f"FastCpuNvFp4LinearKernel: activations are {x.dtype} but the weights were "
                f"dequantised to {cache.weight.dtype}; run vLLM with dtype={cache.weight.dtype}."
            )
        lead = x.shape[:-1]
        x_dq = nvfp4_quant_dequant_activations(x.reshape(-1, x.shape[-1]), cache.input_global_scale)
        out = cache.gemm(x_dq)
        out = out.reshape(*lead, out.shape[-1])
        if bias is not None:
            out = out + bias
        return out


_registered: set[type] = set()  # kernels this module registered with vLLM in this process


def _register_cpu_nvfp4_kernel(kernel: type) -> None:
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.platforms import PlatformEnum

    if kernel not in _registered:
        register_linear_kernel(kernel, PlatformEnum.CPU, "nvfp4")
        _registered.add(kernel)


def register_fast_cpu_nvfp4_kernel() -> type[FastCpuNvFp4LinearKernel]:
    """Make vLLM pick :class:`FastCpuNvFp4LinearKernel` for NVFP4 linear layers on CPU.

    Registers it once per process through vLLM's public ``register_linear_kernel(kernel, PlatformEnum.CPU,
    "nvfp4")``. vLLM registers no CPU NVFP4 kernel of its own and picks the first supported one registered, so this
    one runs unless another was registered earlier in the process (``register_emulation_nvfp4_kernel``); the
    sampler's kernel report names the kernel that runs. Must run in the process that builds the model (in-process
    ``vllm.LLM``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) before the engine starts.

    Returns:
        The registered kernel class.
    """
    _register_cpu_nvfp4_kernel(FastCpuNvFp4LinearKernel)
    return FastCpuNvFp4LinearKernel


def register_emulation_nvfp4_kernel() -> None:
    """Register vLLM's own ``EmulationNvFp4LinearKernel`` for CPU (reference / benchmark only), once per process.

    vLLM picks the first registered kernel: to run the emulation kernel, call this before
    :func:`register_fast_cpu_nvfp4_kernel` in that process, or disable the fast one with vLLM's documented switch
    ``VLLM_DISABLED_KERNELS=FastCpuNvFp4LinearKernel``.
    """
    from vllm.model_executor.kernels.linear import EmulationNvFp4LinearKernel

    _register_cpu_nvfp4_kernel(EmulationNvFp4LinearKernel)
