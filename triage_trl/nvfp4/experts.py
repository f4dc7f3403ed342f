"""MoE experts in NVFP4: finding transformers 5's 3-D expert weights and routers, the platform rule for experts, and
the learner's emulated W4A4 experts (``NVFP4EmulatedExperts``).

transformers 5 holds a Qwen3-MoE block's experts as two 3-D parameters of one module (``mlp.experts``):
``gate_up_proj`` [E, 2I, H] (gate rows then up rows) and ``down_proj`` [E, H, I]; its router (``mlp.gate``,
``Qwen3MoeTopKRouter``) is a plain module with a 2-D ``weight`` [E, H], not an ``nn.Linear``. The experts' forward
is dispatched through transformers' ``ExpertsInterface`` by ``config._experts_implementation``, one setting shared
by every block; the NVFP4 learner instead swaps the experts module of each selected block (the layer rule decides
per block), keeping the parameters and their names.

In NVFP4, each expert's projection is quantised as one dense linear: 1x16 blocks along the reduction dimension
(H for gate/up, I for down), one tensor scale per expert and projection, gate and up sharing theirs (one tensor
``gate_up_proj[e]``), as vLLM's ``CompressedTensorsW4A4Nvfp4MoEMethod`` reads them (``w13_weight_global_scale``
[E, 2] with equal columns, ``w2_weight_global_scale`` [E]).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .emulated import NVFP4WeightGeneration, _EmulatedW4A4Matmul
from .modules import hf_model
from .numerics import check_finite, global_scale_from_amax, per_tensor_scale_from_amax
from .quantize import nvfp4_fake_quantize

__all__ = [
    "ExpertProjection",
    "check_sampler_nvfp4_experts",
    "NVFP4EmulatedExperts",
    "experts_forward",
    "experts_ignore_pattern",
    "iter_expert_projections",
    "iter_moe_experts",
    "iter_moe_routers",
    "native_nvfp4_experts_available",
    "repack_cpu_moe_after_reload",
    "sampler_nvfp4_moe_support",
    "vllm_moe_kernel_counts",
]

PROJECTIONS = ("gate_up_proj", "down_proj")
CHECKPOINT_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# module leaf names of MoE routers and gates (never quantised)
ROUTER_LEAF = re.compile(r"^(gate|router|\w*router\w*|\w+_gate)$")


@dataclass(frozen=True)
class ExpertProjection:
    """One projection of an experts module, as the layer rule sees it: ``name`` is ``<experts>.gate_up_proj`` or
    ``<experts>.down_proj`` (the parameter's Hugging Face name); ``in_features``/``out_features`` per expert."""

    name: str
    experts: str
    num_experts: int
    in_features: int
    out_features: int
    unsupported: str = ""  # why this layout cannot run in NVFP4 ("" when it can)


def is_moe_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds MoE experts as transformers 5's 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    # the registered parameters, not getattr: a module without them would raise (and catch) an AttributeError each,
    # which made the export's walk over a dense model's modules cost ~25 ms a sync (SmolLM2 + LoRA)
    params = module._parameters
    return all(isinstance(params.get(p), nn.Parameter) and params[p].dim() == 3 for p in PROJECTIONS)


def _unsupported_layout(module: nn.Module) -> str:
    flags = {"is_transposed": False, "has_bias": False, "has_gate": True, "is_concatenated": True}
    odd = [f"{k}={getattr(module, k)}" for k, v in flags.items() if getattr(module, k, v) != v]
    if not odd:
        return ""
    return f"experts layout {', '.join(odd)} (NVFP4 supports gated, concatenated, [E, out, in], bias-free)"


def iter_moe_experts(model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None
                     ) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(hf_name, module)`` for every MoE experts module of ``model`` (``is_moe_experts``), in module order;
    ``modules``: ``list(hf_model(model).named_modules())`` when the caller walked the model already."""
    for name, module in hf_model(model).named_modules() if modules is None else modules:
        if is_moe_experts(module):
            yield name, module


def iter_expert_projections(model: nn.Module) -> Iterator[ExpertProjection]:
    """The two projections of every experts module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])."""
    for name, module in iter_moe_experts(model):
        why = _unsupported_layout(module)
        for proj in PROJECTIONS:
            e, out_features, in_features = getattr(module, proj).shape
            yield ExpertProjection(f"{name}.{proj}", name, e, in_features, out_features, why)


def iter_moe_routers(model: nn.Module) -> Iterator[tuple[str, int, int]]:
    """Yield ``(hf_name, in_features, out_features)`` for every MoE router that is not an ``nn.Linear`` (e.g.
    ``Qwen3MoeTopKRouter``: a module named ``gate``/``router``/``*_gate`` with a 2-D ``weight``)."""
    for name, module in hf_model(model).named_modules():
        weight = getattr(module, "weight", None)
        if (ROUTER_LEAF.match(name.rpartition(".")[2]) and not isinstance(module, nn.Linear)
                and isinstance(weight, nn.Parameter) and weight.dim() == 2):
            yield name, weight.shape[1], weight.shape[0]


def experts_ignore_pattern(experts: str) -> str:
    """The compressed-tensors ``ignore`` entry that keeps experts module ``experts`` in bf16: a ``re:`` pattern
    matching its per-expert checkpoint names (``<experts>.<e>.gate_proj``, ``up_proj``, ``down_proj``), which
    vLLM's ``CompressedTensorsMoEMethod.get_moe_method`` looks up."""
    return rf"re:^{re.escape(experts)}\.\d+\.(gate_proj|up_proj|down_proj)$"


@functools.lru_cache(maxsize=1)
def sampler_nvfp4_moe_support() -> tuple[bool, str]:
    """Whether this machine's vLLM has an NVFP4 MoE kernel: ``(ok, reason)``.

    vLLM 0.31 picks NVFP4 MoE kernels in ``fused_moe/oracle/nvfp4.select_nvfp4_moe_backend``; every backend
    (FlashInfer, CUTLASS, Marlin, Humming, and EMULATION, a Triton kernel) needs a CUDA, ROCm or XPU device, so its
    CPU build raises ``NotImplementedError("No NvFp4 MoE backend supports the deployment configuration.")``.
    """
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False, "vLLM is not installed, so there is no NVFP4 MoE kernel to match"
    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return True, ""
    return False, (f"vLLM's {current_platform.device_type} build has no NVFP4 MoE kernel (all of vLLM's NVFP4 MoE "
                   "backends, its emulation included, need CUDA, ROCm or XPU)")


def check_sampler_nvfp4_experts(selection) -> None:
    """Refuse, before vLLM starts, a selection with NVFP4 experts where this machine's vLLM has no NVFP4 MoE kernel
    (vLLM itself would fail at start with "No NvFp4 MoE backend supports the deployment configuration").

    Args:
        selection: the model's ``NVFP4LayerSelection``.

    Raises:
        ValueError: naming the first NVFP4 experts projection, the reason and the remedy.
    """
    nvfp4_experts = [name for name, c in selection.layers if c.kind == "experts" and c.nvfp4]
    ok, why = sampler_nvfp4_moe_support()
    if nvfp4_experts and not ok:
        raise ValueError(
            f"The NVFP4 selection runs MoE experts in NVFP4 ({nvfp4_experts[0]}, ...), but {why}. Set "
            "nvfp4_moe_experts='auto' (experts in bf16 in the learner and the sampler alike, attention in NVFP4) "
            "or 'bf16', or run the sampler on a GPU.")


def vllm_moe_kernel_counts(model: nn.Module) -> dict[str, int]:
    """Per MoE kernel label of a loaded vLLM model (``llm.apply_model``), how many experts layers run it: the
    quantisation method's class, with the chosen experts kernel for NVFP4 (``CompressedTensorsW4A4Nvfp4MoEMethod/
    <experts class>``); ``UnquantizedFusedMoEMethod`` for bf16 experts."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            method = getattr(module, "quant_method", None)
            experts_cls = getattr(method, "experts_cls", None)
            label = type(method).__name__ + (f"/{experts_cls.__name__}" if experts_cls is not None else "")
            counts[label] = counts.get(label, 0) + 1
    return counts


def repack_cpu_moe_after_reload(model: nn.Module) -> int:
    """Put a loaded vLLM model's bf16 MoE experts back into the CPU kernel's layout after ``reload_weights``
    (``llm.apply_model``); returns how many experts layers it repacked.

    vLLM 0.31's ``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts kernel's own
    ``process_weights_after_loading`` only at the first load; on a weight update it copies the checkpoint layout
    into the parameters and skips it, so ``CPUUnquantizedExperts`` (which prepacks ``w13_weight``/``w2_weight``
    into its grouped-GEMM layout) reads unpacked weights and generates garbage. Only vLLM 0.31 and that kernel are
    touched (another version may have fixed it; prepacking twice would corrupt the weights).
    """
    import vllm
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    if not vllm.__version__.startswith("0.31."):
        return 0
    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(module, RoutedExperts) and type(experts).__name__ == "CPUUnquantizedExperts":
            experts.process_weights_after_loading(module)
            count += 1
    return count


def native_nvfp4_experts_available() -> tuple[bool, str]:
    """Whether torchao has a native NVFP4 MoE training op: ``(ok, reason)``. torchao 0.18's ``moe_training`` offers
    FP8 and MXFP8 grouped-GEMM training (``Float8TrainingOpConfig``, ``MXFP8TrainingOpConfig``) and only an emulated
    NVFP4 grouped GEMM, so NVFP4 experts run ``NVFP4EmulatedExperts`` on every device."""
    try:
        from torchao.prototype.moe_training import config as moe_config
    except Exception as err:  # noqa: BLE001 - any import failure means no native path
        return False, f"torchao.prototype.moe_training unavailable ({err})"
    if not hasattr(moe_config, "NVFP4TrainingOpConfig"):
        return False, "torchao's moe_training has no NVFP4 training op (FP8 and MXFP8 only)"
    return False, "torchao's NVFP4 MoE training op is not wired into triage_trl yet"


def experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    project: Callable[[str, int, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """transformers 5's eager experts forward (``Qwen3MoeExperts.forward``) with a pluggable projection.

    Args:
        module: an experts module (``is_moe_experts``) with ``num_experts`` and ``act_fn``.
        hidden_states: [T, H]; top_k_index, top_k_weights: [T, k] routing of each token.
        project: ``project(projection, expert, x)`` -> ``x @ W[expert]^T`` (``projection`` in ``PROJECTIONS``);
            ``None``: the float master weights.

    Returns:
        [T, H] in ``hidden_states``' dtype. Experts that receive no token are skipped.
    """
    if project is None:
        def project(proj, e, x):
            return F.linear(x, getattr(module, proj)[e])
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=module.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit[:, 0].tolist():
        top_k_pos, token_idx = torch.where(mask[e])
        gate, up = project("gate_up_proj", e, hidden_states[token_idx]).chunk(2, dim=-1)
        y = project("down_proj", e, module.act_fn(gate) * up)
        out.index_add_(0, token_idx, (y * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
    return out


class NVFP4EmulatedExperts(nn.Module):
    """MoE experts computing NVFP4 W4A4 per expert by fake quantisation, with high-precision 3-D master weights.

    Each expert GEMM is ``NVFP4EmulatedLinear``'s (``triage_trl.nvfp4.emulated``): the input quantised per call
    (torchao's dynamic scale, or the sampler's static ``input_global_scales[projection]`` with vLLM's rule), the
    expert's weight ``W[e]`` quantised with its own tensor scale (``"dynamic"``: torchao's ``amax / 2688``;
    ``"sampler"``: the export's power-of-two ``1 / global_scale``, gate and up sharing it), the straight-through
    backward to ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]. An expert that receives no token is not
    computed; its weight gradient is zero. Routing is the model's own (the router stays in bf16).

    The fake-quantised weights are cached per ``weight_generation`` (as ``NVFP4EmulatedLinear``). Setting
    ``quantizers_enabled = False`` runs the float master weights (calibration).
    """

    nvfp4_learner_path = "emulated"

    @classmethod
    def from_experts(
        cls,
        experts: nn.Module,
        *,
        name: str = "",
        weight_scales: str = "dynamic",
        compute_dtype: torch.dtype | None = None,
        compiled: bool = True,
        cache_weights: bool = True,
        generation: NVFP4WeightGeneration | None = None,
        four_over_six: bool = False,
    ) -> NVFP4EmulatedExperts:
        """Wrap ``experts``' own ``gate_up_proj``/``down_proj`` Parameters (shared, not copied); the other
        arguments as ``NVFP4EmulatedLinear.from_linear``, ``weight_scales`` ``"dynamic"`` or ``"sampler"``.

        Raises:
            ValueError: ``experts`` is not a supported experts module (3-D, gated, concatenated, bias-free).
        """
        why = _unsupported_layout(experts) if is_moe_experts(experts) else "no 3-D gate_up_proj/down_proj"
        if why:
            raise ValueError(f"{name or experts}: cannot run in NVFP4 ({why}); set nvfp4_moe_experts='bf16'.")
        new = cls()
        new.gate_up_proj, new.down_proj = experts.gate_up_proj, experts.down_proj
        new.act_fn = experts.act_fn
        new.num_experts = experts.gate_up_proj.shape[0]
        new.nvfp4_name, new.weight_scales, new.compute_dtype = name, weight_scales, compute_dtype
        new.compiled, new.cache_weights, new.four_over_six = compiled, cache_weights, four_over_six
        new.weight_generation = generation if generation is not None else NVFP4WeightGeneration()
        new.input_global_scales = {}  # {projection: 0-dim divisor}, set by set_sampler_input_scales
        new.quantizers_enabled = True
        new._cache_key, new._cache = None, None
        return new

    def weight_per_tensor_scales(self, projection: str) -> torch.Tensor:
        """Per-expert tensor scales (multipliers) of ``projection``, float32 [E].

        Raises:
            ValueError: an expert's weight holds NaN or inf (naming the projection).
        """
        amax = getattr(self, projection).detach().abs().amax(dim=(1, 2)).float()
        check_finite(amax, f"The weight of NVFP4 learner experts {self.nvfp4_name}.{projection}")
        if self.weight_scales == "sampler":
            return torch.stack([1.0 / global_scale_from_amax(a) for a in amax])
        return torch.stack([per_tensor_scale_from_amax(a) for a in amax])

    def fake_quantized_weights(self) -> dict[str, torch.Tensor]:
        """``{projection: dequant(Q(W))}`` (each [E, out, in]); cached per weight generation, dtype and device."""
        key = (self.weight_generation.value, self.gate_up_proj.dtype, self.gate_up_proj.device)
        if self.cache_weights and self._cache is not None and self._cache_key == key:
            return self._cache
        weights = {}
        for proj in PROJECTIONS:
            w, scales = getattr(self, proj).detach(), self.weight_per_tensor_scales(proj)
            weights[proj] = torch.stack([
                nvfp4_fake_quantize(w[e], scales[e], four_over_six=self.four_over_six, compiled=self.compiled)
                for e in range(w.shape[0])])
        self._cache, self._cache_key = (weights, key) if self.cache_weights else (None, None)
        return weights

    def expert_forward(self, projection: str, expert: int, x: torch.Tensor,
                       weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``Q(x) @ Q(W[expert])^T`` for ``x`` [N, in] (N may be 0: an empty [0, out] result)."""
        weights = weights if weights is not None else self.fake_quantized_weights()
        return _EmulatedW4A4Matmul.apply(
            x, getattr(self, projection)[expert], weights[projection][expert], None,
            self.input_global_scales.get(projection), self.compute_dtype, self.compiled)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if not self.quantizers_enabled:
            return experts_forward(self, hidden_states, top_k_index, top_k_weights)
        weights = self.fake_quantized_weights()
        return experts_forward(self, hidden_states, top_k_index, top_k_weights,
                               lambda proj, e, x: self.expert_forward(proj, e, x, weights))

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        rule = ", 4 over 6" if self.four_over_six else ""
        return (f"experts={e}, hidden={h}, intermediate={two_i // 2}, nvfp4=emulated W4A4, "
                f"scales={self.weight_scales}{rule}")
