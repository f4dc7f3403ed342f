"""Convert a transformers model's NVFP4 layers into the learner's NVFP4 linears: torchao's native training path, or
an exact emulation.

``convert_to_nvfp4_learner(model, config)`` swaps, in place, the linears the model's NVFP4 layer selection
(``triage_trl.nvfp4.selection``, the same one the sampler's export reads) runs in NVFP4:

* **native** (sm100+ GPU, torchao ``NVFP4TrainingConfig`` through ``quantize_`` with a filter; ``nvfp4.native``):
  torchao's ``NVFP4Linear``; all three GEMMs run in NVFP4 (backward with random Hadamard transforms and stochastic
  rounding), with torchao's own recipe (2-D 16x16 weight blocks, dynamic activation scales), so only where the
  config's recipe is torchao's (``NVFP4Config.native_learner_blockers``). torchao requires in/out features divisible
  by 128 (other layers are emulated) and the sequence length too (``pad_to_multiple_of=128``).
* **emulated** (CPU, Hopper, anything else): ``NVFP4EmulatedLinear`` (``triage_trl.nvfp4.emulated``), W4A4, or W4A16
  with ``nvfp4_sampler_kernel="weight_only"``.

MoE experts the selection runs in NVFP4 become ``NVFP4EmulatedExperts`` (``triage_trl.nvfp4.experts``) on every
device: torchao 0.18 has no native NVFP4 MoE training op (``native_nvfp4_experts_available``).

Native or emulated is an execution path (``learner_execution_paths``), not a precision choice: both quantise the
same layers.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..runtime.progress import progress
from .config import NVFP4Config
from .emulated import EmulationOptions, NVFP4EmulatedLinear, NVFP4WeightGeneration
from .experts import NVFP4EmulatedExperts, iter_moe_experts, native_nvfp4_experts_available
from .modules import base_linear, fused_group, hf_model, is_lora_layer, iter_logical_linears
from .native import NATIVE_MULTIPLE, apply_native, choose_learner_path, native_nvfp4_available
from .selection import NVFP4LayerSelection, nvfp4_layer_selection

logger = logging.getLogger(__name__)

__all__ = [
    "NATIVE_MULTIPLE",
    "NVFP4EmulatedLinear",
    "convert_to_nvfp4_learner",
    "invalidate_nvfp4_weight_caches",
    "register_nvfp4_cache_invalidation",
    "learner_execution_paths",
    "learner_execution_summary",
    "native_nvfp4_available",
    "set_sampler_input_scales",
]

def set_sampler_input_scales(model: nn.Module, input_global_scales: dict[str, torch.Tensor]) -> int:
    """Give the emulated NVFP4 layers of ``model`` the sampler's static activation scales.

    Args:
        model: converted by ``convert_to_nvfp4_learner`` with ``nvfp4_learner_scales="sampler"`` (or wrapped by
            peft).
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
        lin.input_global_scale = _sampler_scale(input_global_scales, name, lin.weight.device)
        count += 1
    for name, experts in iter_moe_experts(model):
        if isinstance(experts, NVFP4EmulatedExperts) and experts.weight_scales == "sampler":
            experts.input_global_scales = {
                proj: _sampler_scale(input_global_scales, f"{name}.{proj}", experts.gate_up_proj.device)
                for proj in ("gate_up_proj", "down_proj")}
            count += 2
    return count


def _sampler_scale(scales: dict[str, torch.Tensor], name: str, device) -> torch.Tensor:
    if name not in scales:
        raise KeyError(f"No sampler input scale for {name}: calibrate_input_global_scales on this model first.")
    return scales[name].detach().float().reshape(()).to(device)


def _owner_of_base(root: nn.Module, name: str, module: nn.Module) -> tuple[nn.Module, str]:
    """(parent, attribute) holding the innermost base linear of logical linear ``name``."""
    if not is_lora_layer(module):
        parent_name, _, child = name.rpartition(".")
        return (root.get_submodule(parent_name) if parent_name else root), child
    while is_lora_layer(module.base_layer):
        module = module.base_layer
    return module, "base_layer"


def convert_to_nvfp4_learner(
    model: nn.Module, config: NVFP4Config | None = None, *, native: bool | str | None = None
) -> NVFP4LayerSelection:
    """Put NVFP4 W4A4 linears into the layers the model's NVFP4 selection chooses, in place.

    Args:
        model: a transformers model (or a ``peft`` model around one); parameters are kept (the new modules share
            them), so optimizers built before still apply.
        config: the NVFP4 settings (``NVFP4Config`` or a ``TriageGRPOConfig``; ``None``: the defaults): the layer
            selection (``nvfp4_recipe``, keep/exclude), the emulated layers' scales
            (``resolved_nvfp4_learner_scales``: ``"dynamic"``, torchao's recipe, or ``"sampler"``, the sampler
            checkpoint's power-of-two weight scales shared within vLLM-fused groups and static activation scales
            from ``set_sampler_input_scales``), GEMM dtype (``nvfp4_emulation_dtype``) and
            ``nvfp4_compile``; activations quantised unless ``nvfp4_sampler_kernel="weight_only"``. Native layers use
            torchao's own recipe, so they are taken only where the config's recipe is torchao's.
        native: ``None`` (default) follows ``config.nvfp4_learner_kernel``; ``"auto"`` uses torchao's native path
            where the GPU (sm100+), the recipe and the shapes allow, else emulation (the reason is logged);
            ``True`` requires native; ``False`` always emulates.

    Returns:
        The model's ``NVFP4LayerSelection`` (the object the export and the sampler read; print it for a report).
        ``learner_execution_paths(model)`` says which layers run natively.

    Raises:
        ValueError: ``native=True`` where native NVFP4 training is unavailable or cannot run the recipe, or for a
            model with NVFP4 MoE experts (torchao has no native NVFP4 MoE training; use ``native=False`` or ``"auto"``
            for the emulated W4A4 path); ``native`` not one of None/True/False/"auto"; an invalid ``config``; the
            model already has a selection from other settings.
    """
    config = config if config is not None else NVFP4Config()
    config.validate_nvfp4()
    root = hf_model(model)
    param = next(root.parameters(), None)
    native_ok, native_why = choose_learner_path(config, native, param.device if param is not None else None)
    if not native_ok:
        logger.info("NVFP4 learner: emulated layers (%s).", native_why)
    selection = nvfp4_layer_selection(model, config)
    generation = root.__dict__.setdefault("nvfp4_weight_generation", NVFP4WeightGeneration())
    linears = list(iter_logical_linears(model))
    native_names = set()
    for name, module in progress(linears, desc="NVFP4 learner layers", unit="layer"):
        lin = base_linear(module)
        if not selection.is_nvfp4(name) or getattr(lin, "nvfp4_learner_path", None) is not None:
            continue
        if native_ok and lin.in_features % NATIVE_MULTIPLE == 0 and lin.out_features % NATIVE_MULTIPLE == 0:
            native_names.add(name)
            continue
        parent, attr = _owner_of_base(root, name, module)
        options = EmulationOptions.from_config(config, lin.weight.device.type)
        setattr(parent, attr, NVFP4EmulatedLinear.from_linear(lin, name=name, generation=generation,
                                                              **options.layer_kwargs()))
    if native_names:
        _apply_native(root, linears, native_names)
    _convert_experts(root, selection, config, generation, native)
    if config.resolved_nvfp4_learner_scales == "sampler":
        _share_weight_scales_in_fused_groups(model)
    return selection


def _convert_experts(root: nn.Module, selection: NVFP4LayerSelection, config: NVFP4Config,
                     generation: NVFP4WeightGeneration, native: bool | str) -> None:
    """Swap each NVFP4 experts module for ``NVFP4EmulatedExperts`` (same parameters, same names)."""
    targets = [(n, m) for n, m in iter_moe_experts(root)
               if selection.is_nvfp4(f"{n}.gate_up_proj") and not isinstance(m, NVFP4EmulatedExperts)]
    if targets and not config.quantizes_activations:
        raise ValueError(
            f"nvfp4_sampler_kernel='weight_only', but {targets[0][0]} has NVFP4 MoE experts, which run W4A4 only. Set "
            "nvfp4_moe_experts='bf16', or another nvfp4_sampler_kernel.")
    if targets and (native is True or (native is None and config.nvfp4_learner_kernel == "native")):
        raise ValueError(
            f"native=True, but {targets[0][0]} has NVFP4 MoE experts and native NVFP4 experts training is unavailable "
            f"({native_nvfp4_experts_available()[1]}). Use native='auto' (native linears, emulated experts) or "
            "native=False.")
    for name, experts in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, attr, NVFP4EmulatedExperts.from_experts(
            experts, name=name, weight_scales=config.resolved_nvfp4_learner_scales, generation=generation,
            **EmulationOptions.from_config(config, experts.gate_up_proj.device.type).layer_kwargs(experts=True)))


def invalidate_nvfp4_weight_caches(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Mark the weights of every emulated NVFP4 layer in ``model`` as changed: each re-quantises its weight at its
    next forward. Call it after anything that changes the master weights in place (an optimizer step, DeepSpeed's
    ``.data.copy_``, loading a state dict); ``register_nvfp4_cache_invalidation`` and ``NVFP4WeightCacheCallback``
    call it after every optimizer step. Works through PEFT, DDP and FSDP wrappers (walks ``model.modules()``).

    Args:
        trainable_only: after an optimizer step: leave the caches alone when no NVFP4 layer's weight requires a
            gradient (LoRA on a frozen NVFP4 base: the step changed only the adapters, so re-quantising every base
            weight at each step would redo identical work).

    Returns:
        The number of emulated NVFP4 layers whose cache it invalidated (0 for a model without any).
    """
    layers = [m for m in model.modules() if isinstance(m, (NVFP4EmulatedLinear, NVFP4EmulatedExperts))]
    if trainable_only and not any(p.requires_grad for m in layers for name, p in m.named_parameters(recurse=False)
                                  if not name.endswith("bias")):  # the quantised weights, not the biases
        return 0
    for generation in {id(m.weight_generation): m.weight_generation for m in layers}.values():
        generation.advance()
    return len(layers)


def register_nvfp4_cache_invalidation(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Invalidate ``model``'s NVFP4 weight caches after every ``optimizer.step()`` (torch's public
    ``register_step_post_hook``); for training loops outside ``transformers.Trainer``. Returns the hook handle
    (``.remove()`` detaches it)."""
    return optimizer.register_step_post_hook(
        lambda _optimizer, _args, _kwargs: invalidate_nvfp4_weight_caches(model, trainable_only=True))


def learner_execution_paths(model: nn.Module) -> dict[str, str]:
    """How each linear and experts projection of a converted model runs: ``{hf_name: "native" | "emulated" |
    "bf16"}`` (experts projections as ``<experts>.gate_up_proj`` and ``<experts>.down_proj``)."""
    paths = {n: getattr(base_linear(m), "nvfp4_learner_path", "bf16") for n, m in iter_logical_linears(model)}
    for name, experts in iter_moe_experts(model):
        for proj in ("gate_up_proj", "down_proj"):
            paths[f"{name}.{proj}"] = getattr(experts, "nvfp4_learner_path", "bf16")
    return paths


def learner_execution_summary(model: nn.Module) -> dict[str, int]:
    """Counts of ``learner_execution_paths`` for logs: ``{"nvfp4/native", "nvfp4/emulated", "nvfp4/kept_bf16"}``."""
    paths = list(learner_execution_paths(model).values())
    return {f"nvfp4/{key}": paths.count(path) for key, path in
            (("native", "native"), ("emulated", "emulated"), ("kept_bf16", "bf16"))}


def _share_weight_scales_in_fused_groups(model: nn.Module) -> None:
    """Point every emulated layer at the weights of its vLLM-fused group (the export's scale rule)."""
    groups: dict[str, list[NVFP4EmulatedLinear]] = {}
    for name, module in iter_logical_linears(model):
        lin = base_linear(module)
        if isinstance(lin, NVFP4EmulatedLinear):
            groups.setdefault(fused_group(name), []).append(lin)
    for members in groups.values():
        for m in members:
            m.weight_scale_group = tuple(members)  # a plain attribute: not registered as submodules


def _apply_native(root: nn.Module, linears, names: set[str]) -> None:
    apply_native(root, {id(base_linear(m)) for n, m in linears if n in names})
    for name, module in iter_logical_linears(root):
        if name in names:
            base_linear(module).nvfp4_learner_path = "native"
