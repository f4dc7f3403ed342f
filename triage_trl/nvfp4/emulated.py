"""The learner's NVFP4 W4A4 linear layer, emulated: ``NVFP4EmulatedLinear`` (fake-quantised operands, a
straight-through backward), with torchao's dynamic recipe or the vLLM sampler's static one."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import runtime
from .numerics import abs_max, check_finite, global_scale_from_amax, per_tensor_scale_from_amax
from .quantize import nvfp4_fake_quantize, nvfp4_fake_quantize_vllm

__all__ = ["NVFP4EmulatedLinear", "NVFP4WeightGeneration"]


class NVFP4WeightGeneration:
    """A counter of weight updates, shared by the emulated layers of one model: advancing it (``advance()``)
    invalidates every cached fake-quantised weight of those layers; each recomputes at its next forward."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0

    def advance(self) -> int:
        """Mark the weights as changed; returns the new generation."""
        self.value += 1
        return self.value


class _EmulatedW4A4Matmul(torch.autograd.Function):
    """``y = Q(x) @ Q(W)^T + b`` forward; straight-through backward with the dequantised operands:
    ``dx = dy @ Q(W)``, ``dW = dy^T @ Q(x)``, ``db = sum(dy)`` (the STE of torchao's QAT).

    The GEMMs run in ``compute_dtype`` (``None``: the input's dtype); results return in the input's
    and the weight's dtypes."""

    @staticmethod
    def forward(ctx, x, weight, weight_dq, bias, input_global_scale, compute_dtype, compiled, quantize_input=True,
                weight_is_operand=False):
        dtype = compute_dtype or x.dtype
        if not quantize_input:  # weight-only (W4A16): what vLLM's weight-only NVFP4 kernels compute
            x_dq = x.detach()
        elif input_global_scale is None:  # torchao's dynamic recipe
            x_dq = nvfp4_fake_quantize(x, compiled=compiled)
        else:  # the sampler's static scale, quantised as vLLM does
            x_dq = nvfp4_fake_quantize_vllm(x, input_global_scale, compiled=compiled)
        # Operands rounded to the compute dtype; a bf16 product is formed in float32 where the CPU has no native bf16
        # GEMM (the same values up to accumulation order, 10-500x faster there), then rounded back to bf16.
        gemm_dtype = _gemm_dtype(dtype, x.device.type)
        x_dq = x_dq.to(dtype).to(gemm_dtype)
        # weight_is_operand: the layer's cached GEMM operand (NVFP4EmulatedLinear.gemm_weight), rounded and cast already
        w = weight_dq if weight_is_operand else weight_dq.to(dtype).to(gemm_dtype)
        ctx.save_for_backward(x_dq, w)
        ctx.weight_dtype, ctx.input_dtype, ctx.compute_dtype = weight.dtype, x.dtype, dtype
        out = F.linear(x_dq, w, None if bias is None else bias.to(dtype).to(gemm_dtype))
        return out.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x_dq, w = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        dtype = ctx.compute_dtype  # as in forward: operands and products rounded to it, formed in w.dtype
        g = grad_out.to(dtype).to(w.dtype)
        if ctx.needs_input_grad[0]:
            grad_x = (g @ w).to(dtype).to(ctx.input_dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[3]:
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_w = (g2.t() @ x_dq.reshape(-1, x_dq.shape[-1])).to(dtype).to(ctx.weight_dtype)
            if ctx.needs_input_grad[3]:
                grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, None, grad_b, None, None, None, None, None


def _gemm_dtype(compute_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype the emulated GEMM holds its operands in: the compute dtype, or float32 for bf16 where this device
    has no native bf16 GEMM (the operands are rounded to bf16 first either way)."""
    if compute_dtype != torch.bfloat16 or runtime.native_bf16_gemm(device_type):
        return compute_dtype
    return torch.float32


@dataclass(frozen=True)
class EmulationOptions:
    """How the emulated NVFP4 layers compute, read once from an ``NVFP4Config`` (:meth:`from_config`) and given to
    ``NVFP4EmulatedLinear.from_linear`` and ``NVFP4EmulatedExperts.from_experts`` (``**options.layer_kwargs(...)``).

    Attributes:
        compute_dtype: GEMM dtype (``None``: the input's).
        compiled: use the compiled fake-quantisers (``nvfp4_fake_quantize``); the same bits either way.
        cache_weights: keep the fake-quantised weight until the model's weight generation advances.
        four_over_six: "4 over 6" weight block scales, as the export's (``numerics.quantize_torchao``).
        quantize_input: quantise the input (W4A4); ``False`` is W4A16 (linears only; experts always run W4A4).
    """

    compute_dtype: torch.dtype | None = None
    compiled: bool = True
    cache_weights: bool = True
    four_over_six: bool = False
    quantize_input: bool = True

    @classmethod
    def from_config(cls, config, device_type: str = "cpu") -> EmulationOptions:
        """The options of ``config`` (an ``NVFP4Config``) for a layer on ``device_type``
        (``resolved_nvfp4_emulation_dtype``: ``"bf16"`` or ``"fp32"``)."""
        return cls(compute_dtype=_COMPUTE_DTYPES[config.resolved_nvfp4_emulation_dtype(device_type)],
                   compiled=config.nvfp4_compile, cache_weights=config.nvfp4_weight_cache,
                   four_over_six=config.nvfp4_four_over_six, quantize_input=config.quantizes_activations)

    def layer_kwargs(self, *, experts: bool = False) -> dict:
        """The keyword arguments of ``from_linear`` (``experts=False``) or ``from_experts`` (no ``quantize_input``)."""
        kwargs = {"compute_dtype": self.compute_dtype, "compiled": self.compiled, "cache_weights": self.cache_weights,
                  "four_over_six": self.four_over_six}
        return kwargs if experts else {**kwargs, "quantize_input": self.quantize_input}


_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class NVFP4EmulatedLinear(nn.Linear):
    """``nn.Linear`` computing NVFP4 W4A4 by fake quantisation, with high-precision master weights.

    Forward: ``y = dequant(Q(x)) @ dequant(Q(W))^T + b`` where ``Q`` is torchao's NVFP4 quantiser
    (``triage_trl.nvfp4.quantize``; 16-element blocks along the input features, E4M3 block scales,
    FP32 per-tensor scale ``amax / 2688``, dynamic per call for the activations ``x`` [..., in],
    per weight version for ``W`` [out, in]). Backward: straight-through to ``x`` and ``W``.

    Relation to torchao's native sm100 path (``triage_trl.nvfp4.native``): with dynamic scales the activations follow
    the same rule (1x16 blocks, dynamic per-tensor scale; not compared bit for bit with the Triton kernel), but the
    native kernels quantise the weight with one scale per 2-D 16x16 block (this layer, like the vLLM checkpoint, one
    per 1x16 row block), accumulate FP4 products inside the tensor core, and run the backward GEMMs in NVFP4 with
    Hadamard transforms and stochastic rounding, whereas this backward uses the dequantised forward operands and
    full-precision gradients. The two recipes are close, not bit-identical; the sync probe measures the
    learner-sampler gap either way.

    Scales (``nvfp4_learner_scales`` of ``convert_to_nvfp4_learner``'s config): ``"dynamic"`` as above (torchao's
    recipe);
    ``"sampler"`` mirrors the vLLM sampler's NVFP4 checkpoint (``triage_trl.nvfp4.checkpoint_tensors``): the weight's
    per-tensor scale is the export's power-of-two scale of its vLLM-fused group (q/k/v, gate/up:
    ``weight_scale_group``, the group's layers, whose weights are read at each quantisation), and the activations
    use the sampler's static calibrated scale
    (``input_global_scale``, set by ``set_sampler_input_scales``; dynamic until first set), quantised with vLLM's
    rule (``numerics.quant_dequant_vllm``). Given the same input, this layer and the sampler's then compute the
    same operands bit for bit; the residual learner-sampler mismatch is the engines' own (GEMM order, attention,
    norms).

    ``compute_dtype`` (``None``: the input's dtype) is the GEMM dtype; ``torch.bfloat16`` is what
    vLLM's NVFP4 emulation does (dequantise to bf16, bf16 GEMM with fp32 accumulation) and is exact
    for the dequantised operands when the per-tensor scales are powers of two.

    Weight cache: the fake-quantised weight is kept until the layer's ``weight_generation`` counter (one per model,
    ``NVFP4WeightGeneration``) advances: whoever changes the weights advances it (``invalidate_nvfp4_weight_caches``,
    from an optimizer-step hook or ``NVFP4WeightCacheCallback``). Tensor versions and addresses are not used:
    DeepSpeed's ``.data.copy_`` and FSDP2's in-place refill change neither. ``cache_weights=False`` re-quantises at
    every forward and keeps no copy (FSDP2: a cached full copy per layer and rank would defeat the sharding).

    PEFT LoRA can wrap this module (it is an ``nn.Linear``); adapters then run unquantised next to it.
    """

    nvfp4_learner_path = "emulated"

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        name: str = "",
        compute_dtype: torch.dtype | None = None,
        compiled: bool = True,
        cache_weights: bool = True,
        generation: NVFP4WeightGeneration | None = None,
        four_over_six: bool = False,
        quantize_input: bool = True,
    ) -> NVFP4EmulatedLinear:
        """Wrap ``linear``'s own ``weight``/``bias`` Parameters (shared, not copied).

        Args:
            name: the Hugging Face module name, used in errors.
            compute_dtype: GEMM dtype (``None``: the input's).
            compiled: use the compiled fake-quantisers (``nvfp4_fake_quantize``); the same bits either way.
            cache_weights: keep the fake-quantised weight until ``generation`` advances (see the class docstring).
            generation: the model's ``NVFP4WeightGeneration`` (``None``: a new one for this layer alone).
            four_over_six: "4 over 6" weight block scales, as the export's (``numerics.quantize_torchao``).
            quantize_input: quantise the input (W4A4, default); ``False`` leaves it in high precision (W4A16, the
                recipe of vLLM's weight-only NVFP4 kernels).
        """
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.nvfp4_name = name
        new.compute_dtype = compute_dtype
        new.compiled = compiled
        new.cache_weights = cache_weights
        new.four_over_six = four_over_six
        new.quantize_input = quantize_input
        new.weight_generation = generation if generation is not None else NVFP4WeightGeneration()
        new.weight_scale_group = None
        new.input_global_scale = None
        new._weight_cache_key = None
        new._weight_dq = None
        new._gemm_weight = None  # (key, tensor): _weight_dq as the forward's GEMM takes it
        return new

    def _weight_amax(self, weight: torch.Tensor) -> torch.Tensor:
        amax = abs_max(weight)
        check_finite(amax, f"The weight of NVFP4 learner layer {self.nvfp4_name or self} (or of its fused group)")
        return amax

    def weight_per_tensor_scale(self) -> torch.Tensor:
        """The weight's per-tensor scale (a multiplier), 0-dim float32: torchao's dynamic ``amax / 2688``; with a
        ``weight_scale_group``, ``1 / global_scale_from_amax(max amax over the group)`` (the export's).

        Raises:
            ValueError: the weight (or a fused sibling's) holds NaN or inf; the message names the layer.
        """
        if self.weight_scale_group is None:
            return per_tensor_scale_from_amax(self._weight_amax(self.weight))
        # The siblings' `weight` is read now, not kept from conversion: FSDP2 replaces the Parameter objects at
        # fully_shard and sets the unsharded ones for each forward.
        amax = torch.stack([self._weight_amax(m.weight) for m in self.weight_scale_group]).amax()
        return 1.0 / global_scale_from_amax(amax)

    def fake_quantized_weight(self) -> torch.Tensor:
        """``dequant(Q(W))`` [out, in] in the weight's dtype; cached per weight generation (and dtype, device)."""
        if not self.cache_weights:
            self._weight_dq = self._gemm_weight = None
            return self._quantize_weight()
        key = (self.weight_generation.value, self.weight.dtype, self.weight.device)
        if self._weight_dq is None or self._weight_cache_key != key:
            if torch.is_inference_mode_enabled():  # an inference tensor cached here would break the next backward
                return self._quantize_weight()
            self._weight_dq = self._quantize_weight()
            self._weight_cache_key = key
        return self._weight_dq

    def _quantize_weight(self) -> torch.Tensor:
        return nvfp4_fake_quantize(self.weight.detach(), self.weight_per_tensor_scale(),
                                   four_over_six=self.four_over_six, compiled=self.compiled)

    def gemm_weight(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The weight operand of the forward's GEMM for input ``x``: ``(weight, is_operand)``. With the weight cache
        on (and outside ``torch.inference_mode``), :meth:`fake_quantized_weight` rounded to the compute dtype and
        held in the GEMM's dtype, cached with it per weight generation (recast at every forward, an fp32 master's
        weight cost about 0.1 ms a layer: SmolLM2's [1536, 576], 2-core EPYC, 69 times a forward in the demo), and
        ``True``; otherwise the fake-quantised weight as it is, which the forward casts, and ``False``."""
        dtype = self.compute_dtype or x.dtype
        gemm_dtype = _gemm_dtype(dtype, x.device.type)
        if not self.cache_weights or torch.is_inference_mode_enabled():
            return self.fake_quantized_weight(), False
        key = (self.weight_generation.value, self.weight.dtype, self.weight.device, dtype, gemm_dtype)
        if self._gemm_weight is not None and self._gemm_weight[0] == key:
            return self._gemm_weight[1], True
        weight_dq = self.fake_quantized_weight()
        if weight_dq.dtype == dtype == gemm_dtype:  # the cached weight is the operand: no second copy
            return weight_dq, True
        self._gemm_weight = (key, weight_dq.to(dtype).to(gemm_dtype))
        return self._gemm_weight[1], True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, is_operand = self.gemm_weight(x)
        return _EmulatedW4A4Matmul.apply(
            x, self.weight, weight, self.bias, self.input_global_scale, self.compute_dtype, self.compiled,
            self.quantize_input, is_operand,
        )

    def extra_repr(self) -> str:
        scales = "sampler" if self.weight_scale_group is not None else "dynamic"
        rule = ", 4 over 6" if self.four_over_six else ""
        kind = "W4A4" if self.quantize_input else "W4A16"
        return super().extra_repr() + f", nvfp4=emulated {kind}, scales={scales}{rule}"
