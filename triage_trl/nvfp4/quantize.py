"""The learner's NVFP4 fake-quantiser: ``triage_trl.nvfp4.numerics`` compiled into one fused pass.

* ``nvfp4_fake_quantize(x, per_tensor_scale)``: torchao's quantise-dequantise (``numerics.quant_dequant_torchao``),
  dynamic per-tensor scale when none is given; optionally "4 over 6" block scales.
* ``nvfp4_fake_quantize_vllm(x, global_scale)``: vLLM's activation quantise-dequantise with a static divisor
  (``numerics.quant_dequant_vllm``), what the sampler does to a layer's input.
* ``nvfp4_fake_quantize_reference``: torchao's own ``NVFP4Tensor.to_nvfp4(x).dequantize()`` (slow; the tests'
  reference for bit-exactness).
* ``nvfp4_quantize``: torchao's ``NVFP4Tensor`` (codes and block scales).

The compiled path is chosen per call (``compiled=True``, the default); the eager path computes the same bits about
10x slower. Inputs are checked before either runs, and an empty input returns an empty result, so only a real
``torch.compile`` failure (the eager path succeeding on the same input) switches a kernel to eager, for that device
type only, with one warning; ``compile_failures()`` lists them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
from torch.fx.experimental import _config as fx_shape_config
from . import numerics
from .numerics import BLOCK_SIZE, dynamic_per_tensor_scale

logger = logging.getLogger(__name__)

__all__ = [
    "compile_available",
    "compile_failures",
    "nvfp4_fake_quantize",
    "nvfp4_fake_quantize_reference",
    "nvfp4_fake_quantize_vllm",
    "nvfp4_dequantize_packed",
    "nvfp4_quantize",
    "nvfp4_quantize_packed",
]


def _check_input(x: torch.Tensor, dtypes=(torch.bfloat16, torch.float32)) -> None:
    if x.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"NVFP4 quantisation takes {names} tensors, got {x.dtype}; cast first.")
    if x.dim() < 1 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"NVFP4 needs the last (reduction) dimension to be a multiple of {BLOCK_SIZE}, got shape "
            f"{tuple(x.shape)}; keep this layer in bf16."
        )


def _scalar(scale: torch.Tensor, device) -> torch.Tensor:
    return scale.detach().float().reshape(()).to(device)


def nvfp4_quantize(x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None):
    """Quantise ``x`` [..., K] to torchao's ``NVFP4Tensor`` (2-D view [prod(...), K], unswizzled).

    Args:
        x: bfloat16/float32 tensor whose last dimension K is a multiple of 16 (any layout).
        per_tensor_scale: 0-dim float32 multiplier; ``None`` uses ``dynamic_per_tensor_scale(x)``.

    Returns:
        ``NVFP4Tensor`` with ``qdata`` uint8 [M, K/2] (low nibble = even element, as compressed-tensors packs),
        ``scale`` float8_e4m3fn [M, K/16] and ``per_tensor_scale``.

    Raises:
        TypeError / ValueError: unsupported dtype, or K not a multiple of 16.
    """
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    _check_input(x)
    if per_tensor_scale is None:
        per_tensor_scale = dynamic_per_tensor_scale(x)
    x2d = x.detach().reshape(-1, x.shape[-1]).contiguous()
    return NVFP4Tensor.to_nvfp4(x2d, block_size=BLOCK_SIZE, per_tensor_scale=_scalar(per_tensor_scale, x.device))


def nvfp4_fake_quantize_reference(x: torch.Tensor, per_tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """torchao's quantise-dequantise of ``x`` [..., K]: ``NVFP4Tensor.to_nvfp4(x).dequantize()``.

    Same shape and dtype as ``x``; no gradient. ``per_tensor_scale`` as in ``nvfp4_quantize``.
    """
    if x.numel() == 0:
        _check_input(x)
        return x.detach().clone()
    return nvfp4_quantize(x, per_tensor_scale).dequantize(x.dtype).reshape(x.shape)


_compiled: dict[Callable, Callable] = {}
# No duck shaping while a kernel traces (see _run_2d); one reusable patch (a new one per call costs 3x more).
_NO_DUCK_SHAPES = fx_shape_config.patch(use_duck_shape=False)
_failed: dict[tuple[str, str], str] = {}
_lock = threading.Lock()


def _run(fn: Callable, x: torch.Tensor, *args, compiled: bool) -> torch.Tensor:
    """``fn(x2d, *args)`` on a 2-D view of ``x``, compiled unless asked not to or compile failed here."""
    return _run_2d(fn, x.reshape(-1, x.shape[-1]), *args, compiled=compiled).reshape(x.shape)


def _run_2d(fn: Callable, x2d: torch.Tensor, *args, compiled: bool):
    """``fn(x2d, *args)``, compiled (one graph per dtype, whatever the shape) unless asked not to or compile failed
    here on this device type (then eager, with one warning)."""
    key = (fn.__name__, x2d.device.type)
    if not compiled or key in _failed:
        return fn(x2d, *args)
    with _lock:
        kernel = _compiled.get(fn) or _compiled.setdefault(fn, torch.compile(fn, dynamic=True))
    try:
        # One graph for every call: grad mode fixed (outputs carry no gradient), the view of a 3-D input passed as
        # a tensor of its own (dynamo guards a view's base), and no duck shaping (a square first input would
        # specialise the graph to rows == columns). Each recompile costs about a second per process with a warm
        # compile cache and several with a cold one (tests/test_nvfp4_quantize.py counts the graphs).
        with torch.no_grad(), _NO_DUCK_SHAPES:
            return kernel(x2d.detach(), *args)
    except Exception as err:  # noqa: BLE001 - decided below: the eager path on the same input tells
        out = fn(x2d, *args)  # bad input raises here, and nothing is switched off
        _failed[key] = f"{type(err).__name__}: {err}"
        logger.warning("torch.compile of %s failed on %s (%s); using the eager path (same bits, slower).",
                       fn.__name__, x2d.device.type, _failed[key])
        return out


def nvfp4_fake_quantize(
    x: torch.Tensor,
    per_tensor_scale: torch.Tensor | None = None,
    *,
    four_over_six: bool = False,
    compiled: bool = True,
) -> torch.Tensor:
    """NVFP4 quantise-dequantise of ``x`` [..., K] with torchao's rule, bit-identical to torchao.

    Args:
        x: bfloat16/float32 tensor, K a multiple of 16, any batch shape and layout (may be empty).
        per_tensor_scale: 0-dim float32 multiplier; ``None`` = dynamic ``amax(|x|) / 2688``.
        four_over_six: "4 over 6" block scales (``numerics.quantize_torchao``); off = torchao exactly.
        compiled: run the ``torch.compile``'d pass (default) or the same ops eagerly.

    Returns:
        Tensor of ``x``'s shape and dtype holding the decoded NVFP4 values (no gradient).

    Raises:
        TypeError / ValueError: unsupported dtype, or K not a multiple of 16.
    """
    _check_input(x)
    x = x.detach()
    if x.numel() == 0:
        return x.clone()
    if per_tensor_scale is None:
        return _run(numerics.quant_dequant_torchao_dynamic, x, four_over_six, compiled=compiled)
    return _run(numerics.quant_dequant_torchao, x, _scalar(per_tensor_scale, x.device), four_over_six,
                compiled=compiled)


def nvfp4_fake_quantize_vllm(x: torch.Tensor, global_scale: torch.Tensor, *, compiled: bool = True) -> torch.Tensor:
    """vLLM's NVFP4 activation quantise-dequantise of ``x`` [..., K] with a static divisor ``global_scale``
    (``numerics.quant_dequant_vllm``; 448 * 6 / amax). Same shape and dtype; raises as ``nvfp4_fake_quantize``
    (bfloat16, float16 and float32 accepted)."""
    _check_input(x, (torch.bfloat16, torch.float16, torch.float32))
    x = x.detach()
    if x.numel() == 0:
        return x.clone()
    return _run(numerics.quant_dequant_vllm, x, _scalar(global_scale, x.device), compiled=compiled)


def nvfp4_quantize_packed(
    weight: torch.Tensor, per_tensor_scale: torch.Tensor, *, four_over_six: bool = False, compiled: bool = True,
    values_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """A weight [out, in] in compressed-tensors' NVFP4 layout: one fused pass to 4-bit codes and E4M3 block
    scales, then ``numerics.pack_codes`` (torchao's ``pack_uint4`` layout; the export's, at every sync).

    Args:
        weight: bfloat16/float32 [out, in], ``in`` a multiple of 16.
        per_tensor_scale: 0-dim float32 multiplier (``1 / global_scale``).
        four_over_six: "4 over 6" block scales (``numerics.quantize_torchao``).
        compiled: the ``torch.compile``'d pass (default) or the same ops eagerly; the same bits.
        values_dtype: also return, from the same pass, the dequantised weight [out, in] in this dtype: what
            :func:`nvfp4_dequantize_packed` (vLLM's ``dequantize_to_dtype``) decodes from the result, bit for bit
            when ``per_tensor_scale`` is the reciprocal of a power of two (the export's global scales).

    Returns:
        ``(weight_packed, weight_scale)``: uint8 [out, in/2] and float8_e4m3fn [out, in/16], bit-identical to
        ``numerics.encode_e2m1(numerics.quantize_torchao(weight, ...))`` (torchao's quantisation and packing);
        ``(weight_packed, weight_scale, values)`` with ``values_dtype``.

    Raises:
        TypeError / ValueError: unsupported dtype, not 2-D, or ``in`` not a multiple of 16.
    """
    _check_input(weight)
    if weight.dim() != 2:
        raise ValueError(f"nvfp4_quantize_packed takes a 2-D weight [out, in], got shape {tuple(weight.shape)}.")
    scale = _scalar(per_tensor_scale, weight.device)
    if values_dtype is None:
        codes, block_scale = _run_2d(numerics.quantize_codes_torchao, weight.detach(), scale, four_over_six,
                                     compiled=compiled)
        return numerics.pack_codes(codes), block_scale
    codes, block_scale, values = _run_2d(numerics.quantize_codes_and_values_torchao, weight.detach(), scale,
                                         four_over_six, values_dtype, compiled=compiled)
    return numerics.pack_codes(codes), block_scale.to(torch.float8_e4m3fn), values


def nvfp4_dequantize_packed(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype,
    *, compiled: bool = True,
) -> torch.Tensor:
    """Dequantise compressed-tensors NVFP4 weights (uint8 [out, in/2], E4M3 [out, in/16], 0-dim float32 multiplier)
    to ``dtype`` [out, in] in one fused pass (unpacking included): vLLM's ``dequantize_to_dtype``
    (unswizzled), bit for bit (``numerics.decode_packed``)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed NVFP4 weights must be 2-D uint8, got {packed.dtype} {tuple(packed.shape)}.")
    if packed.numel() == 0:
        return torch.empty(packed.shape[0], 2 * packed.shape[1], dtype=dtype, device=packed.device)
    return _run_2d(numerics.decode_packed, packed, block_scale.view(torch.float8_e4m3fn),
                   _scalar(global_scale, packed.device), dtype, compiled=compiled)


def compile_failures() -> dict[tuple[str, str], str]:
    """``{(kernel, device type): error}`` for every kernel whose ``torch.compile`` failed in this process."""
    return dict(_failed)


def compile_available(device_type: str = "cpu") -> bool:
    """Whether no fake-quantiser kernel has failed to compile on ``device_type`` in this process."""
    return not any(dev == device_type for _, dev in _failed)
