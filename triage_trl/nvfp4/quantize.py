"""NVFP4 quantise-dequantise on torchao's ``NVFP4Tensor`` numerics.

NVFP4 (NVIDIA, Blackwell): 4-bit E2M1 values, one FP8 E4M3 scale per 16 consecutive elements along
the last (reduction) dimension, and one FP32 per-tensor scale. A value is decoded as

    x = e2m1 * (per_tensor_scale * e4m3_block_scale)

Two implementations give bit-identical results:

* ``nvfp4_fake_quantize_reference``: torchao's own
  ``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=...).dequantize()``; 12-27 ns/element on CPU.
* ``nvfp4_fake_quantize``: the same arithmetic written as one ``torch.compile``'d elementwise
  kernel (1-2 ns/element); it falls back to the reference, with one logged warning, where
  ``torch.compile`` is unavailable. Bit-exactness is asserted in ``tests/test_nvfp4_quantize.py``.

Per-tensor scale convention (torchao, a *multiplier*): ``per_tensor_scale = amax / (448 * 6)``
(``per_tensor_amax_to_scale``). vLLM and compressed-tensors store the reciprocal, a *divisor*
``global_scale = 448 * 6 / amax``; see ``triage_trl.nvfp4.export``.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

F4_E2M1_MAX = 6.0
F8E4M3_MAX = 448.0
BLOCK_SIZE = 16
E4M3_EPS = torch.finfo(torch.float8_e4m3fn).tiny
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Non-negative E2M1 values, indexed by their 3-bit magnitude code (sign is bit 3)."""

__all__ = [
    "BLOCK_SIZE",
    "compile_available",
    "E2M1_GRID",
    "F4_E2M1_MAX",
    "F8E4M3_MAX",
    "dynamic_per_tensor_scale",
    "nvfp4_fake_quantize",
    "nvfp4_fake_quantize_reference",
    "nvfp4_quantize",
]


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"NVFP4 quantisation takes bfloat16 or float32 tensors, got {x.dtype}; cast first.")
    if x.dim() < 1 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"NVFP4 needs the last (reduction) dimension to be a multiple of {BLOCK_SIZE}, got shape "
            f"{tuple(x.shape)}; keep this layer in bf16."
        )


def dynamic_per_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """torchao's per-tensor scale (a multiplier) from ``x``'s absolute maximum.

    Returns a 0-dim float32 tensor ``amax(|x|) / (448 * 6)`` (torchao ``per_tensor_amax_to_scale``),
    or ``1.0`` when ``x`` is all zeros (where torchao would divide by zero; every block then
    decodes to 0 either way).
    """
    amax = x.detach().abs().amax().float()
    scale = amax / (F8E4M3_MAX * F4_E2M1_MAX)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def nvfp4_quantize(x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None):
    """Quantise ``x`` [..., K] to torchao's ``NVFP4Tensor`` (2-D view [prod(...), K], unswizzled).

    Args:
        x: bfloat16/float32 tensor whose last dimension K is a multiple of 16 (any layout).
        per_tensor_scale: 0-dim float32 multiplier; ``None`` uses ``dynamic_per_tensor_scale(x)``.

    Returns:
        ``NVFP4Tensor`` with ``qdata`` uint8 [M, K/2] (low nibble = even element, as
        compressed-tensors packs), ``scale`` float8_e4m3fn [M, K/16] and ``per_tensor_scale``.

    Raises:
        TypeError / ValueError: unsupported dtype, or K not a multiple of 16.
    """
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    _check_input(x)
    if per_tensor_scale is None:
        per_tensor_scale = dynamic_per_tensor_scale(x)
    x2d = x.detach().reshape(-1, x.shape[-1]).contiguous()
    return NVFP4Tensor.to_nvfp4(x2d, block_size=BLOCK_SIZE, per_tensor_scale=per_tensor_scale.float().reshape(()))


def nvfp4_fake_quantize_reference(x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """torchao's quantise-dequantise of ``x`` [..., K]: ``NVFP4Tensor.to_nvfp4(x).dequantize()``.

    Same shape and dtype as ``x``; no gradient. ``per_tensor_scale`` as in ``nvfp4_quantize``.
    """
    return nvfp4_quantize(x, per_tensor_scale).dequantize(x.dtype).reshape(x.shape)


def _round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    # Round-to-nearest-even onto the E2M1 grid for |y| <= 6 (ties: 0.25->0, 0.75->1, 1.25->1,
    # 1.75->2, 2.5->2, 3.5->4, 5->4), keeping the sign of zero as torchao's bit cast does.
    a = y.abs()
    q = (
        0.5 * (a > 0.25).float()
        + 0.5 * (a >= 0.75).float()
        + 0.5 * (a > 1.25).float()
        + 0.5 * (a >= 1.75).float()
        + (a > 2.5).float()
        + (a >= 3.5).float()
        + 2.0 * (a > 5.0).float()
    )
    return torch.copysign(q, y)


def _fake_quantize_eager(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> torch.Tensor:
    # Mirrors torchao.prototype.mx_formats.nvfp4_tensor.nvfp4_quantize (two-level scaling branch)
    # followed by NVFP4Tensor.dequantize, operation for operation, in float32.
    shape, dtype = x.shape, x.dtype
    xb = x.float().reshape(-1, shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    block_scale = torch.amax(torch.abs(xb), dim=-1) / F4_E2M1_MAX
    scale_fp8 = torch.clamp(block_scale / per_tensor_scale, min=E4M3_EPS, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
    scale_fp32 = scale_fp8.to(torch.float32)
    reciprocal = (1.0 / per_tensor_scale) / scale_fp32
    y = torch.clamp(xb * reciprocal.unsqueeze(-1), -F4_E2M1_MAX, F4_E2M1_MAX)
    out = _round_to_e2m1(y) * (per_tensor_scale * scale_fp32).unsqueeze(-1)
    return out.reshape(shape).to(dtype)


def _fake_quantize_dynamic_eager(x: torch.Tensor) -> torch.Tensor:
    # The amax reduction and the quantise-dequantise in one compiled graph.
    return _fake_quantize_eager(x, dynamic_per_tensor_scale(x))


_compiled: dict[str, object] = {}
_compile_failed = False


def _compiled_kernel(dynamic_scale: bool):
    key = "dynamic" if dynamic_scale else "static"
    if key not in _compiled:
        fn = _fake_quantize_dynamic_eager if dynamic_scale else _fake_quantize_eager
        _compiled[key] = torch.compile(fn, dynamic=True)
    return _compiled[key]


def nvfp4_fake_quantize(x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fast NVFP4 quantise-dequantise of ``x`` [..., K], bit-identical to torchao's.

    Args:
        x: bfloat16/float32 tensor, K a multiple of 16, any batch shape and layout.
        per_tensor_scale: 0-dim float32 multiplier; ``None`` = dynamic ``amax(|x|) / 2688``.

    Returns:
        Tensor of ``x``'s shape and dtype holding the decoded NVFP4 values (no gradient).

    Runs a ``torch.compile``'d kernel (dynamic shapes); set ``TRIAGE_NVFP4_NO_COMPILE=1`` or run
    where compile fails to use ``nvfp4_fake_quantize_reference`` instead (same bits, ~10x slower).
    """
    global _compile_failed
    _check_input(x)
    x = x.detach()
    if per_tensor_scale is not None:
        per_tensor_scale = per_tensor_scale.detach().float().reshape(()).to(x.device)
    if _compile_failed or os.environ.get("TRIAGE_NVFP4_NO_COMPILE") == "1":
        return nvfp4_fake_quantize_reference(x, per_tensor_scale)
    x2d = x.reshape(-1, x.shape[-1])  # one compiled graph per dtype, whatever the batch shape
    try:
        if per_tensor_scale is None:
            return _compiled_kernel(True)(x2d).reshape(x.shape)
        return _compiled_kernel(False)(x2d, per_tensor_scale).reshape(x.shape)
    except Exception as err:  # compile toolchain missing or backend error
        _compile_failed = True
        logger.warning("torch.compile of the NVFP4 fake-quantiser failed (%s); using torchao's eager path.", err)
        return nvfp4_fake_quantize_reference(x, per_tensor_scale)


def compile_available() -> bool:
    """False once ``torch.compile`` of the fast path has failed (or is disabled by env)."""
    return not _compile_failed and os.environ.get("TRIAGE_NVFP4_NO_COMPILE") != "1"
