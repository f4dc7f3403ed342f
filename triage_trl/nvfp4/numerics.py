"""NVFP4 numerics, the one place: constants, E2M1 and E4M3 rounding, per-tensor scale rules, and the two
quantisers (torchao's, vLLM's) written from them as pure elementwise functions.

NVFP4 (NVIDIA, Blackwell) stores a value as a 4-bit E2M1 code ``q`` (``E2M1_GRID``), one FP8 E4M3 scale ``s``
per 16 consecutive elements along the last (reduction) dimension, and one FP32 scale per tensor. The per-tensor
scale has two conventions:

* **multiplier** (torchao's ``per_tensor_scale``): ``x = q * (s * per_tensor_scale)``;
* **divisor** (vLLM's and compressed-tensors' ``global_scale``): ``x = q * s / global_scale``.

``global_scale = 1 / per_tensor_scale``. We round every global scale this package computes *down to a power of
two* (``global_scale_from_amax``): then ``1 / global_scale`` is exact and both conventions decode the same bits,
and the largest block scale still lands in (224, 448], so no E4M3 precision is lost.

Two quantiser rules, one per engine, bit-identical to their library:

* ``quantize_torchao`` / ``quant_dequant_torchao``: torchao's ``nvfp4_quantize`` (two-level branch) and
  ``NVFP4Tensor.dequantize``: block scale ``amax(block) / 6 / per_tensor_scale`` clamped to the normal E4M3 range
  ``[2**-6, 448]``. Used for every weight (learner and export) and for the learner's dynamic activations.
  Optionally "4 over 6": per block, the block maximum maps to 4 instead of 6 when that gives the smaller squared
  error (the stored format is unchanged).
* ``quant_dequant_vllm``: vLLM's ``ref_nvfp4_quant_dequant`` (what its NVFP4 kernels do to activations with the
  checkpoint's static ``input_global_scale``): block scale ``global_scale * (amax(block) * (1/6))`` clamped to
  ``[0, 448]`` (E4M3 subnormals and zero allowed). Used by the sampler's CPU kernel and by the learner's
  activations when it mirrors the sampler.

Sources: torchao 0.18 ``prototype/mx_formats`` (``constants.py``, ``nvfp4_tensor.py``, ``kernels.py``); vLLM 0.31
``layers/quantization/utils/nvfp4_emulation_utils.py``; compressed-tensors 0.17 ``generate_gparam``. Everything
here is elementwise or a block reduction, so ``torch.compile`` fuses each quantiser into one pass.
"""

from __future__ import annotations

import sys

import torch
from torchao.prototype.mx_formats.constants import F4_E2M1_MAX, F8E4M3_MAX
from torchao.prototype.mx_formats.nvfp4_tensor import E4M3_EPS, per_tensor_amax_to_scale

__all__ = [
    "BLOCK_SIZE",
    "E2M1_GRID",
    "E4M3_EPS",
    "F4_E2M1_MAX",
    "F8E4M3_MAX",
    "FP4_RANGE",
    "abs_max",
    "check_finite",
    "decode_codes",
    "decode_packed",
    "dynamic_per_tensor_scale",
    "encode_e2m1",
    "global_scale_from_amax",
    "pack_codes",
    "per_tensor_scale_from_amax",
    "quant_dequant_torchao",
    "quant_dequant_vllm",
    "e2m1_codes",
    "quantize_codes_and_values_torchao",
    "quantize_codes_torchao",
    "quantize_torchao",
    "round_to_e2m1",
    "round_to_e4m3",
]

BLOCK_SIZE = 16
"""Elements per E4M3 block scale (NVFP4's fixed block size; torchao asserts it)."""
FP4_RANGE = F8E4M3_MAX * F4_E2M1_MAX
"""448 * 6 = 2688: the largest magnitude one NVFP4 tensor scale maps its amax to."""
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Non-negative E2M1 values, indexed by their 3-bit magnitude code (sign is bit 3)."""
_FOUR = 4.0  # the alternative block-maximum target of "4 over 6"


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round ``|y| <= 6`` to the nearest E2M1 value, ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2,
    2.5->2, 3.5->4, 5->4), keeping the sign (also of zero) as torchao's bit cast does; vLLM's ``cast_to_fp4`` has
    the same ties. A chain of selects, so inductor vectorises it."""
    a = torch.abs(y)
    r = torch.where(a > 5.0, 6.0, 4.0)
    r = torch.where(a < 3.5, 3.0, r)
    r = torch.where(a <= 2.5, 2.0, r)
    r = torch.where(a < 1.75, 1.5, r)
    r = torch.where(a <= 1.25, 1.0, r)
    r = torch.where(a < 0.75, 0.5, r)
    r = torch.where(a <= 0.25, 0.0, r)
    return torch.copysign(r, y)


def round_to_e4m3(s: torch.Tensor) -> torch.Tensor:
    """``s.to(float8_e4m3fn).float()`` for float32 ``0 <= s <= 448``, in integer ops that vectorise.

    Round-to-nearest-even to 3 mantissa bits on the float32 bit pattern in the normal E4M3 range (>= 2**-6), to
    multiples of 2**-9 below it (E4M3 subnormals). Inductor lowers a real fp8 cast to one scalar conversion per
    element; this keeps a fused pass vectorised. Bit-identical (tested on every E4M3 value and midpoint).
    """
    bits = s.view(torch.int32)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF).view(torch.float32)
    subnormal = torch.round(s * 512.0) * (1 / 512.0)
    return torch.where(s < 2.0**-6, subnormal, normal)


def check_finite(amax: torch.Tensor, what: str) -> None:
    """Raise if a tensor's absolute maximum is NaN or inf (a scale computed from it would be silently wrong).

    Raises:
        ValueError: naming ``what`` (e.g. the layer), with the value found.
    """
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(
            f"{what} holds NaN or inf (amax {amax.detach().float().cpu().tolist()}): NVFP4 scales cannot be computed "
            "from it. Find where the non-finite values come from (learning rate, loss scale, a bad checkpoint)."
        )


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """``x.abs().amax()`` of a floating or signed tensor as 0-dim float32, from one ``torch.aminmax`` pass (no ``|x|``
    temporary; NaN propagates): ``max(-min, max)`` is exact."""
    low, high = torch.aminmax(x.detach())
    return torch.maximum(-low, high).float()


def per_tensor_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """torchao's per-tensor scale (a multiplier) of a tensor with absolute maximum ``amax``: ``amax / 2688``
    (``per_tensor_amax_to_scale``), 0-dim float32; 1.0 when amax is 0 (every block decodes to 0)."""
    scale = per_tensor_amax_to_scale(amax.reshape(()))
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def dynamic_per_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """``per_tensor_scale_from_amax(amax(|x|))``: torchao's dynamic recipe."""
    return per_tensor_scale_from_amax(abs_max(x))


def global_scale_from_amax(amax: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """The global scale (a divisor) of a tensor with absolute maximum ``amax``: compressed-tensors'
    ``generate_gparam`` (``448 * 6 / amax``) rounded down to a power of two; 0-dim float32, 1.0 when amax is 0.

    Used for weights and activations alike (see the module docstring for why a power of two).

    Raises:
        ValueError: ``amax`` is NaN or inf (``check_finite``; ``what`` names the tensor).
    """
    from compressed_tensors.quantization.utils import generate_gparam

    amax = amax.detach().float().reshape(())
    check_finite(amax, what)
    ideal = generate_gparam(torch.zeros_like(amax), amax).reshape(())
    _, exponent = torch.frexp(ideal)  # ideal = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(ideal), exponent - 1)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)


def _quantize_blocks(xb: torch.Tensor, per_tensor_scale: torch.Tensor, target: float):
    # torchao nvfp4_quantize (two-level branch), operation for operation, with the block maximum mapped to `target`.
    block_scale = torch.amax(torch.abs(xb), dim=-1) / target
    scale = round_to_e4m3(torch.clamp(block_scale / per_tensor_scale, min=E4M3_EPS, max=F8E4M3_MAX))
    reciprocal = (1.0 / per_tensor_scale) / scale
    y = torch.clamp(xb * reciprocal.unsqueeze(-1), -F4_E2M1_MAX, F4_E2M1_MAX)
    return round_to_e2m1(y), scale


def quantize_torchao(
    x: torch.Tensor, per_tensor_scale: torch.Tensor, four_over_six: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's NVFP4 quantisation of ``x`` [..., K] (K a multiple of 16) with a given multiplier.

    Args:
        x: bfloat16/float32.
        per_tensor_scale: 0-dim float32 multiplier (``1 / global_scale``).
        four_over_six: per block, map the block maximum to 4 instead of 6 where that decodes with the smaller
            squared error (Cook et al. 2025, "Four Over Six"); off = torchao exactly.

    Returns:
        ``(q, scale)``: E2M1 values as float32 [..., K/16, 16] (on ``E2M1_GRID``, signed) and the E4M3 block
        scales as float32 [..., K/16]; ``x ~= q * (scale * per_tensor_scale)``.
    """
    xb = _blocks(x)
    q, scale = _quantize_blocks(xb, per_tensor_scale, F4_E2M1_MAX)
    if not four_over_six:
        return q, scale
    q4, scale4 = _quantize_blocks(xb, per_tensor_scale, _FOUR)
    err6 = torch.sum(torch.square(q * (scale * per_tensor_scale).unsqueeze(-1) - xb), dim=-1)
    err4 = torch.sum(torch.square(q4 * (scale4 * per_tensor_scale).unsqueeze(-1) - xb), dim=-1)
    pick4 = err4 < err6
    return torch.where(pick4.unsqueeze(-1), q4, q), torch.where(pick4, scale4, scale)


def quant_dequant_torchao(
    x: torch.Tensor, per_tensor_scale: torch.Tensor, four_over_six: bool = False
) -> torch.Tensor:
    """``NVFP4Tensor.to_nvfp4(x, per_tensor_scale).dequantize()`` for ``x`` [..., K]: same shape and dtype."""
    q, scale = quantize_torchao(x, per_tensor_scale, four_over_six)
    return (q * (per_tensor_scale * scale).unsqueeze(-1)).reshape(x.shape).to(x.dtype)


def quant_dequant_torchao_dynamic(x: torch.Tensor, four_over_six: bool = False) -> torch.Tensor:
    """``quant_dequant_torchao`` with torchao's dynamic per-tensor scale (``dynamic_per_tensor_scale(x)``)."""
    return quant_dequant_torchao(x, dynamic_per_tensor_scale(x), four_over_six)


def encode_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 values ``q`` [..., K] (on the signed ``E2M1_GRID``, as ``quantize_torchao`` returns) into
    compressed-tensors' / torchao's byte layout: uint8 [..., K/2], element 2j in the low nibble, sign in bit 3
    (torchao ``f32_to_f4_unpacked`` and ``pack_uint4``)."""
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, pack_uint4

    return pack_uint4(f32_to_f4_unpacked(q.float().contiguous()))


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes (int32, 0-15) of E2M1 values ``q`` (on the signed ``E2M1_GRID``, as ``quantize_torchao``
    returns): the magnitude's index into ``E2M1_GRID`` (0, .5, 1, 1.5, 2 -> 2|q|; 3, 4, 6 -> 5, 6, 7), and the
    float's sign bit as bit 3 (so -0.0 -> 8, as torchao's ``f32_to_f4_unpacked``).

    The sign comes from the float32 bit pattern by integer shifts, not ``torch.signbit``: inductor lowers
    ``signbit`` and uint8 arithmetic to scalar loops on CPU (measured 4x slower for the whole export)."""
    a = torch.abs(q)
    magnitude = torch.where(a <= 2.0, a * 2.0, torch.where(a <= 3.0, 5.0, torch.where(a <= 4.0, 6.0, 7.0)))
    return magnitude.to(torch.int32) | ((q.float().view(torch.int32) >> 28) & 8)


def quantize_codes_torchao(
    x: torch.Tensor, per_tensor_scale: torch.Tensor, four_over_six: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_torchao`` of a 2-D ``x`` [M, K] as 4-bit codes: ``(codes, scale)``, uint8 [M, K]
    (:func:`e2m1_codes`, one code per byte) and the E4M3 block scales as float8_e4m3fn [M, K/16] (exact: they are
    E4M3 values already). One elementwise pass (compiled by ``triage_trl.nvfp4.quantize.nvfp4_quantize_packed``,
    which packs the codes with :func:`pack_codes` outside the compiled pass: inside it the stride-2 reads run
    element by element on CPU)."""
    q, scale = quantize_torchao(x, per_tensor_scale, four_over_six)
    return e2m1_codes(q.reshape(x.shape)).to(torch.uint8), scale.to(torch.float8_e4m3fn)


def quantize_codes_and_values_torchao(
    x: torch.Tensor, per_tensor_scale: torch.Tensor, four_over_six: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_codes_torchao` and, from the same pass, the values those codes decode to: ``(codes, scale,
    values)``, the block scales as float32 [M, K/16] (E4M3 values; an fp8 output beside the ``dtype`` one makes
    inductor's CPU loop scalar, 4x slower), ``values`` [M, K] in ``dtype`` computed as :func:`decode_codes` does
    (``e2m1 * (block_scale * per_tensor_scale)``, then rounded to ``dtype``): bit for bit what vLLM's
    ``dequantize_to_dtype`` makes of the packed weight when ``per_tensor_scale`` is ``1 / global_scale`` of a
    power-of-two global scale (the export's)."""
    q, scale = quantize_torchao(x, per_tensor_scale, four_over_six)
    values = (q * (scale * per_tensor_scale).unsqueeze(-1)).reshape(x.shape).to(dtype)
    return e2m1_codes(q.reshape(x.shape)).to(torch.uint8), scale, values


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: uint8 [..., K] (values 0-15) -> uint8 [..., K/2], element 2j in the low nibble,
    bit for bit torchao's ``pack_uint4``. On a little-endian machine each pair is read as one int16 ``v`` (low byte
    the even element): the low byte of ``v`` is the even code and the low byte of ``v >> 4`` the odd code shifted
    into the high nibble, so ``uint8(v) | uint8(v >> 4)`` packs them (integer casts to uint8 keep the low byte), in
    contiguous passes instead of ``pack_uint4``'s strided ones (about 6x faster on CPU); elsewhere ``pack_uint4``."""
    if sys.byteorder != "little" or codes.shape[-1] % 2:
        from torchao.prototype.mx_formats.kernels import pack_uint4

        return pack_uint4(codes)
    pairs = codes.contiguous().view(torch.int16)
    return pairs.to(torch.uint8).bitwise_or_((pairs >> 4).to(torch.uint8))


def decode_codes(codes: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Dequantise compressed-tensors NVFP4 weights from their int32 codes [M, K] (torchao's ``unpack_uint4`` of the
    packed uint8 [M, K/2]): ``e2m1(code) * (block_scale * global_scale)``, float32 [M, K], vLLM's
    ``dequantize_to_dtype`` (unswizzled) op for op; ``block_scale`` float32 [M, K/16] (the E4M3 scales converted),
    ``global_scale`` the 0-dim float32 multiplier (``1 / divisor``). One elementwise pass (compiled by
    ``triage_trl.nvfp4.quantize.nvfp4_dequantize_packed``)."""
    m = (codes & 0x07).float()
    value = torch.where(m <= 4.0, m * 0.5, torch.where(m <= 5.0, 3.0, torch.where(m <= 6.0, 4.0, 6.0)))
    value = torch.where((codes & 0x08) != 0, -value, value)
    blocks = value.reshape(codes.shape[0], -1, BLOCK_SIZE) * (block_scale * global_scale).unsqueeze(-1)
    return blocks.reshape(codes.shape[0], -1)


def decode_packed(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """:func:`decode_codes` of packed NVFP4 bytes, in ``dtype``: ``packed`` uint8 [M, K/2] (element 2j in the low
    nibble, torchao's ``pack_uint4``), ``block_scale`` float8_e4m3fn (or float32) [M, K/16], ``global_scale`` as
    there; [M, K] in ``dtype``, rounded once from the float32 values as vLLM's ``dequantize_to_dtype`` does.
    Unpacking inside the compiled pass writes the [M, K] codes never (1.7x faster than ``unpack_uint4`` first, on a
    2-core AVX2 EPYC); the bytes are widened to int32 as they are read (uint8 arithmetic compiles to scalar loops
    on CPU) and the result is rounded to ``dtype`` in the same pass."""
    wide = packed.to(torch.int32)
    codes = torch.stack([wide & 0x0F, wide >> 4], dim=-1).reshape(packed.shape[0], -1)
    return decode_codes(codes, block_scale.float(), global_scale).to(dtype)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    # vLLM's `get_reciprocal`: 1/x with 0 mapped to (almost) 0.
    return 1.0 / (x + (x == 0) * 1e8)


def quant_dequant_vllm(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """vLLM's NVFP4 activation quantise-dequantise (``ref_nvfp4_quant_dequant``) of ``x`` [..., K].

    Args:
        x: bfloat16/float16/float32, K a multiple of 16.
        global_scale: 0-dim float32 divisor (``input_global_scale``, ``448 * 6 / amax``).

    Returns:
        Same shape and dtype as ``x``, bit-identical to vLLM's CPU reference.
    """
    blocks = _blocks(x)
    vec_max = torch.amax(torch.abs(blocks), dim=-1, keepdim=True)
    # vLLM clamps to [-448, 448]; the block amax and the global scale are >= 0, so only the upper bound acts.
    scale = round_to_e4m3(torch.clamp(global_scale * (vec_max * (1 / F4_E2M1_MAX)), min=0.0, max=F8E4M3_MAX))
    output_scale = _reciprocal(scale * _reciprocal(global_scale))
    y = torch.clamp(blocks * output_scale, -F4_E2M1_MAX, F4_E2M1_MAX)
    return (round_to_e2m1(y) * (scale / global_scale)).reshape(x.shape).to(x.dtype)
