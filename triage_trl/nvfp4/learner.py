"""The learner's NVFP4 W4A4 linear layers: torchao's native training path, or an exact emulation.

``convert_to_nvfp4_learner(model)`` swaps a transformers model's decoder linears in place:

* **native** (sm100+ GPU, torchao ``NVFP4TrainingConfig`` through ``quantize_`` with a filter):
  torchao's ``NVFP4Linear``; all three GEMMs run in NVFP4 (backward with random Hadamard
  transforms and stochastic rounding). torchao requires in/out features divisible by 128 (and the
  token count M divisible by 128 at run time); other layers fall back to the emulation.
* **emulated** (CPU, Hopper, anything else): ``NVFP4EmulatedLinear``, below.

Selection: linears inside the decoder blocks (``...layers.<i>...``) only, never embeddings or
``lm_head``; optionally keep the first/last N blocks in bf16 and skip names matching
``exclude_patterns`` (MoE router gates by default). A layer whose in/out features are not
multiples of 16 stays in bf16 (one warning lists them all).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .modules import base_linear, block_index, fused_group, hf_model, is_lora_layer, iter_logical_linears
from .numerics import BLOCK_SIZE, check_finite, global_scale_from_amax, per_tensor_scale_from_amax
from .quantize import nvfp4_fake_quantize, nvfp4_fake_quantize_vllm

logger = logging.getLogger(__name__)

__all__ = [
    "NVFP4ConversionReport",
    "NVFP4EmulatedLinear",
    "LayerDecision",
    "convert_to_nvfp4_learner",
    "native_nvfp4_available",
    "set_sampler_input_scales",
]
LEARNER_SCALES = ("dynamic", "sampler")

NATIVE_MULTIPLE = 128  # torchao nvfp4_mm_triton: M, K, N divisible by 128


class _EmulatedW4A4Matmul(torch.autograd.Function):
    """``y = Q(x) @ Q(W)^T + b`` forward; straight-through backward with the dequantised operands:
    ``dx = dy @ Q(W)``, ``dW = dy^T @ Q(x)``, ``db = sum(dy)`` (the STE of torchao's QAT).

    The GEMMs run in ``compute_dtype`` (``None``: the input's dtype); results return in the input's
    and the weight's dtypes."""

    @staticmethod
    def forward(ctx, x, weight, weight_dq, bias, input_global_scale, compute_dtype, compiled):
        dtype = compute_dtype or x.dtype
        if input_global_scale is None:  # torchao's dynamic recipe
            x_dq = nvfp4_fake_quantize(x, compiled=compiled)
        else:  # the sampler's static scale, quantised as vLLM does
            x_dq = nvfp4_fake_quantize_vllm(x, input_global_scale, compiled=compiled)
        x_dq = x_dq.to(dtype)
        w = weight_dq.to(dtype)
        ctx.save_for_backward(x_dq, w)
        ctx.weight_dtype, ctx.input_dtype = weight.dtype, x.dtype
        out = F.linear(x_dq, w, None if bias is None else bias.to(dtype))
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x_dq, w = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        g = grad_out.to(w.dtype)
        if ctx.needs_input_grad[0]:
            grad_x = (g @ w).to(ctx.input_dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[3]:
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_w = (g2.t() @ x_dq.reshape(-1, x_dq.shape[-1])).to(ctx.weight_dtype)
            if ctx.needs_input_grad[3]:
                grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, None, grad_b, None, None, None


class NVFP4EmulatedLinear(nn.Linear):
    """``nn.Linear`` computing NVFP4 W4A4 by fake quantisation, with high-precision master weights.

    Forward: ``y = dequant(Q(x)) @ dequant(Q(W))^T + b`` where ``Q`` is torchao's NVFP4 quantiser
    (``triage_trl.nvfp4.quantize``; 16-element blocks along the input features, E4M3 block scales,
    FP32 per-tensor scale ``amax / 2688``, dynamic per call for the activations ``x`` [..., in],
    per weight version for ``W`` [out, in]). Backward: straight-through to ``x`` and ``W``.

    Matches the native sm100 kernel: the E2M1 codes, block scales and tensor scales of the
    forward operands (torchao's quantiser, bit for bit), hence every product. Differs: the
    matmul accumulates in the compute dtype's BLAS order (the native kernel accumulates FP4
    products in FP32 inside the tensor core, then scales) so outputs differ by rounding; torchao's
    native path quantises the weight with its 2-D Triton kernel and the activations after its own
    amax kernel; and its backward GEMMs run in NVFP4 with Hadamard transforms and stochastic
    rounding, whereas this backward uses the dequantised forward operands and full-precision
    gradients.

    Scales (``scales`` of ``convert_to_nvfp4_learner``): ``"dynamic"`` as above (torchao's recipe);
    ``"sampler"`` mirrors the vLLM sampler's NVFP4 checkpoint (``triage_trl.nvfp4.export``): the weight's
    per-tensor scale is the export's power-of-two scale of its vLLM-fused group (q/k/v, gate/up:
    ``weight_scale_group``), and the activations use the sampler's static calibrated scale
    (``input_global_scale``, set by ``set_sampler_input_scales``; dynamic until first set). The
    residual learner-sampler mismatch is then the engines' own (GEMM order, attention, norms).

    ``compute_dtype`` (``None``: the input's dtype) is the GEMM dtype; ``torch.bfloat16`` is what
    vLLM's NVFP4 emulation does (dequantise to bf16, bf16 GEMM with fp32 accumulation) and is exact
    for the dequantised operands when the per-tensor scales are powers of two.

    The weight's fake-quantised copy is cached and recomputed only when the weight changes
    (``weight._version`` / storage, i.e. after an optimizer step). PEFT LoRA can wrap this module
    (it is an ``nn.Linear``); adapters then run unquantised next to it.
    """

    nvfp4_learner_path = "emulated"

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, name: str = "", compute_dtype: torch.dtype | None = None, compiled: bool = True
    ) -> NVFP4EmulatedLinear:
        """Wrap ``linear``'s own ``weight``/``bias`` Parameters (shared, not copied). ``name`` (the Hugging Face
        module name) is used in errors; ``compiled`` chooses the compiled fake-quantiser (``nvfp4_fake_quantize``)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.nvfp4_name = name
        new.compute_dtype = compute_dtype
        new.compiled = compiled
        new.weight_scale_group = None
        new.input_global_scale = None
        new._weight_cache_key = None
        new._weight_dq = None
        return new

    def _weight_amax(self, weight: torch.Tensor) -> torch.Tensor:
        amax = weight.detach().abs().amax().float()
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
        amax = torch.stack([self._weight_amax(w) for w in self.weight_scale_group]).amax()
        return 1.0 / global_scale_from_amax(amax)

    def fake_quantized_weight(self) -> torch.Tensor:
        """``dequant(Q(W))`` [out, in] in the weight's dtype, cached per weight (and scale group) version."""
        group = self.weight_scale_group or (self.weight,)
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device, tuple(w.shape)) for w in group)  # has self.weight
        if self._weight_dq is None or self._weight_cache_key != key:
            self._weight_dq = nvfp4_fake_quantize(
                self.weight.detach(), self.weight_per_tensor_scale(), compiled=self.compiled
            )
            self._weight_cache_key = key
        return self._weight_dq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _EmulatedW4A4Matmul.apply(
            x, self.weight, self.fake_quantized_weight(), self.bias, self.input_global_scale, self.compute_dtype,
            self.compiled,
        )

    def extra_repr(self) -> str:
        scales = "sampler" if self.weight_scale_group is not None else "dynamic"
        return super().extra_repr() + f", nvfp4=emulated W4A4, scales={scales}"


def set_sampler_input_scales(model: nn.Module, input_global_scales: dict[str, torch.Tensor]) -> int:
    """Give the emulated NVFP4 layers of ``model`` the sampler's static activation scales.

    Args:
        model: converted by ``convert_to_nvfp4_learner(..., scales="sampler")`` (or wrapped by peft).
        input_global_scales: ``{hf_linear_name: 0-dim float32}`` in vLLM's divisor convention
            (``448 * 6 / amax``), as ``calibrate_input_global_scales`` returns and the sampler uses.

    Returns:
        How many layers received a scale.

    Raises:
        KeyError: an emulated layer with sampler scales has no entry (calibrate on this model).
    """
    count = 0
    for name, module in iter_logical_linears(model):
        lin = base_linear(module)
        if not isinstance(lin, NVFP4EmulatedLinear) or lin.weight_scale_group is None:
            continue
        if name not in input_global_scales:
            raise KeyError(f"No sampler input scale for {name}: calibrate_input_global_scales on this model first.")
        lin.input_global_scale = input_global_scales[name].detach().float().reshape(()).to(lin.weight.device)
        count += 1
    return count


@dataclass
class LayerDecision:
    """How one linear runs in the learner: ``path`` is native, emulated or kept-bf16."""

    path: str
    reason: str = ""


@dataclass
class NVFP4ConversionReport:
    """Per-layer outcome of ``convert_to_nvfp4_learner``, keyed by Hugging Face module name."""

    layers: dict[str, LayerDecision] = field(default_factory=dict)

    def names(self, path: str) -> list[str]:
        """Layer names that took ``path`` ("native", "emulated" or "kept-bf16")."""
        return [n for n, d in self.layers.items() if d.path == path]

    def summary(self) -> dict[str, int]:
        """Counts for the trainer's logs: ``{"nvfp4/native": n, "nvfp4/emulated": n,
        "nvfp4/kept_bf16": n}``."""
        return {
            "nvfp4/native": len(self.names("native")),
            "nvfp4/emulated": len(self.names("emulated")),
            "nvfp4/kept_bf16": len(self.names("kept-bf16")),
        }

    def __str__(self) -> str:
        lines = [", ".join(f"{k}={v}" for k, v in self.summary().items())]
        for name, d in self.layers.items():
            lines.append(f"  {name}: {d.path}" + (f" ({d.reason})" if d.reason else ""))
        return "\n".join(lines)


def native_nvfp4_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether torchao's native NVFP4 training path can run on ``device`` (default: current CUDA).

    Returns ``(ok, reason)``; needs a CUDA device of compute capability >= 10.0 (sm100) and
    ``torchao.prototype.moe_training.nvfp4_training``.
    """
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False, f"model is on {dev.type}, not CUDA"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 10:
        return False, f"GPU is sm{major}{minor}; torchao's NVFP4 training kernels need sm100+"
    try:
        from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means no native path
        return False, f"torchao NVFP4 training unavailable ({err})"
    return True, ""


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _owner_of_base(root: nn.Module, name: str, module: nn.Module) -> tuple[nn.Module, str]:
    """(parent, attribute) holding the innermost base linear of logical linear ``name``."""
    if not is_lora_layer(module):
        parent_name, _, child = name.rpartition(".")
        return (root.get_submodule(parent_name) if parent_name else root), child
    while is_lora_layer(module.base_layer):
        module = module.base_layer
    return module, "base_layer"


def convert_to_nvfp4_learner(
    model: nn.Module,
    *,
    keep_first_blocks: int = 0,
    keep_last_blocks: int = 0,
    exclude_patterns: Sequence[str] = (r"mlp.gate$", "router"),
    native: bool | str = "auto",
    scales: str = "dynamic",
    compute_dtype: torch.dtype | None = None,
    compiled: bool = True,
) -> NVFP4ConversionReport:
    """Put NVFP4 W4A4 linears into a transformers model's decoder blocks, in place.

    Args:
        model: a transformers model (or a ``peft`` model around one); parameters are kept (the
            new modules share them), so optimizers built before still apply.
        keep_first_blocks / keep_last_blocks: leave that many leading/trailing decoder blocks
            (``config.num_hidden_layers``) in bf16.
        exclude_patterns: regexes (``re.search`` on the Hugging Face module name) of linears to
            keep in bf16, e.g. MoE router gates.
        native: ``"auto"`` uses torchao's native path where the GPU (sm100+) and shapes allow,
            else emulation; ``True`` requires native; ``False`` always emulates.
        scales: ``"dynamic"`` (torchao's recipe: per-tensor scales from each operand's amax) or
            ``"sampler"`` (the emulated layers mirror the vLLM sampler's checkpoint: power-of-two weight
            scales shared within vLLM-fused groups, static activation scales from
            ``set_sampler_input_scales``); see ``NVFP4EmulatedLinear``. Native layers use torchao's.
        compute_dtype: GEMM dtype of the emulated layers (``None``: the input's dtype).
        compiled: run the emulated layers' fake-quantisers compiled (``torch.compile``) or eagerly (same bits).

    Returns:
        ``NVFP4ConversionReport`` with each linear's path and reason.

    Raises:
        ValueError: ``native=True`` where native NVFP4 training is unavailable (use
            ``native=False`` or ``"auto"`` for the emulated W4A4 path); ``native`` not one of
            True/False/"auto"; negative keep counts; ``scales`` not in ``LEARNER_SCALES``.
    """
    if native not in (True, False, "auto"):
        raise ValueError(f"native must be True, False or 'auto', got {native!r}.")
    if scales not in LEARNER_SCALES:
        raise ValueError(f"scales must be one of {LEARNER_SCALES}, got {scales!r}.")
    if keep_first_blocks < 0 or keep_last_blocks < 0:
        raise ValueError("keep_first_blocks and keep_last_blocks must be >= 0.")
    root = hf_model(model)
    param = next(root.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    native_ok, native_why = (False, "native=False") if native is False else native_nvfp4_available(device)
    if native is True and not native_ok:
        raise ValueError(
            f"native NVFP4 training is unavailable here ({native_why}). Use native=False (or "
            "native='auto') for the emulated W4A4 path, which runs on any device."
        )

    linears = list(iter_logical_linears(model))
    n_blocks = getattr(getattr(root, "config", None), "num_hidden_layers", None)
    if n_blocks is None:
        indices = [block_index(n) for n, _ in linears if block_index(n) is not None]
        n_blocks = max(indices) + 1 if indices else 0
    report = NVFP4ConversionReport()
    misaligned = []
    native_names = []
    for name, module in linears:
        lin = base_linear(module)
        idx = block_index(name)
        existing = getattr(lin, "nvfp4_learner_path", None)
        if existing is not None:
            report.layers[name] = LayerDecision(existing, "already converted")
        elif idx is None:
            report.layers[name] = LayerDecision("kept-bf16", "outside the decoder blocks")
        elif idx < keep_first_blocks:
            report.layers[name] = LayerDecision("kept-bf16", f"block {idx} < keep_first_blocks")
        elif idx >= n_blocks - keep_last_blocks:
            report.layers[name] = LayerDecision("kept-bf16", f"block {idx} in keep_last_blocks")
        elif any(re.search(p, name) for p in exclude_patterns):
            report.layers[name] = LayerDecision("kept-bf16", "matches exclude_patterns")
        elif lin.in_features % BLOCK_SIZE or lin.out_features % BLOCK_SIZE:
            report.layers[name] = LayerDecision(
                "kept-bf16", f"{lin.in_features}x{lin.out_features} not multiples of {BLOCK_SIZE}"
            )
            misaligned.append(name)
        elif native_ok and lin.in_features % NATIVE_MULTIPLE == 0 and lin.out_features % NATIVE_MULTIPLE == 0:
            report.layers[name] = LayerDecision("native")
            native_names.append(name)
        else:
            why = native_why if not native_ok else f"in/out not multiples of {NATIVE_MULTIPLE} for torchao"
            report.layers[name] = LayerDecision("emulated", why)
            parent, attr = _owner_of_base(root, name, module)
            setattr(parent, attr, NVFP4EmulatedLinear.from_linear(
                lin, name=name, compute_dtype=compute_dtype, compiled=compiled))
    if misaligned:
        logger.warning(
            "NVFP4 learner: %d linear layer(s) have dimensions that are not multiples of %d and stay "
            "in bf16: %s",
            len(misaligned), BLOCK_SIZE, ", ".join(misaligned),
        )
    if native_names:
        _apply_native(root, linears, set(native_names))
    if scales == "sampler":
        _share_weight_scales_in_fused_groups(model)
    return report


def _share_weight_scales_in_fused_groups(model: nn.Module) -> None:
    """Point every emulated layer at the weights of its vLLM-fused group (the export's scale rule)."""
    groups: dict[str, list[NVFP4EmulatedLinear]] = {}
    for name, module in iter_logical_linears(model):
        lin = base_linear(module)
        if isinstance(lin, NVFP4EmulatedLinear):
            groups.setdefault(fused_group(name), []).append(lin)
    for members in groups.values():
        weights = tuple(m.weight for m in members)
        for m in members:
            m.weight_scale_group = weights


def _apply_native(root: nn.Module, linears, names: set[str]) -> None:
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig
    from torchao.quantization import quantize_

    targets = {id(base_linear(m)) for n, m in linears if n in names}
    quantize_(root, NVFP4TrainingConfig(), filter_fn=lambda mod, _fqn: id(mod) in targets)
    for name, module in iter_logical_linears(root):
        if name in names:
            base_linear(module).nvfp4_learner_path = "native"
