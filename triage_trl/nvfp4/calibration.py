"""The NVFP4 sampler's static activation scales, calibrated reproducibly.

vLLM's NVFP4 linears quantise their input with a static per-tensor ``input_global_scale`` stored in the checkpoint.
``calibrate_input_global_scales`` computes it so that the same calibration prompts give the same scales, bit for
bit, whatever the run's seed, the learner's precision or its NVFP4 state:

* on the **float master model**: a converted learner runs with its NVFP4 quantisers off
  (``nvfp4_quantizers_disabled``), so the scales do not depend on the learner's own rounding (calibrating through
  W4A4 moved a quarter of a 135M model's scales between near-identical prompt sets);
* each scale is ``448 * 6 / amax`` **rounded down to a power of two** (``numerics.global_scale_from_amax``, the
  weights' rule): small amax differences map to the same scale, and every decoder (vLLM's ``1 / global_scale``
  multiplier included) reads it exactly;
* vLLM-fused siblings (q/k/v, gate/up) share their group's largest amax;
* MoE experts: one scale per experts module and projection (``<experts>.gate_up_proj``, ``<experts>.down_proj``),
  from the largest amax over all its experts' inputs, which every expert of the module then uses.

Which prompts form the fixed calibration set is the caller's choice (the trainer's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..runtime.progress import progress
from .experts import NVFP4EmulatedExperts, experts_forward, iter_moe_experts
from .modules import base_linear, fused_group, iter_logical_linears
from .numerics import abs_max, global_scale_from_amax
from .selection import NVFP4LayerSelection, resolve_nvfp4_layer_selection

__all__ = ["calibrate_input_global_scales", "nvfp4_quantizers_disabled"]


@contextlib.contextmanager
def nvfp4_quantizers_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run a converted learner as its float master model inside the block: every NVFP4 linear (emulated or native)
    computes ``F.linear(x, master weight, bias)``. Restores the NVFP4 forward on exit, also on error; the weight
    caches are untouched."""
    converted = [base_linear(m) for _, m in iter_logical_linears(model)]
    converted = [m for m in converted if getattr(m, "nvfp4_learner_path", None) is not None]
    experts = [m for _, m in iter_moe_experts(model) if isinstance(m, NVFP4EmulatedExperts)]
    for module in converted:
        module.forward = nn.Linear.forward.__get__(module)  # an instance attribute shadows the NVFP4 forward
    for module in experts:
        module.quantizers_enabled = False
    try:
        yield model
    finally:
        for module in converted:
            del module.forward
        for module in experts:
            module.quantizers_enabled = True


def _observing_experts_forward(module: nn.Module, name: str, make_hook):
    """A float forward of experts module ``name`` that reports each projection's input to ``make_hook``."""
    hooks = {proj: make_hook(f"{name}.{proj}") for proj in ("gate_up_proj", "down_proj")}

    def project(proj, e, x):
        hooks[proj](module, (x,))
        return torch.nn.functional.linear(x, getattr(module, proj)[e])

    return lambda hidden_states, top_k_index, top_k_weights: experts_forward(
        module, hidden_states, top_k_index, top_k_weights, project)


@torch.no_grad()
def calibrate_input_global_scales(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    *,
    selection: NVFP4LayerSelection | None = None,
    max_length: int = 256,
) -> dict[str, torch.Tensor]:
    """Activation global scales of every NVFP4 layer, from one float forward pass per prompt.

    Args:
        model: a transformers model, possibly converted by ``convert_to_nvfp4_learner`` or wrapped by peft (the
            float master model runs: NVFP4 quantisers off, active LoRA adapters on).
        tokenizer: tokenises each prompt (truncated to ``max_length`` tokens, no padding).
        prompts: the calibration set.
        selection: the NVFP4 layers (default: the model's own, ``triage_trl.nvfp4.selection``).

    Returns:
        ``{hf_linear_name: 0-dim float32}``: vLLM's divisor, ``448 * 6 / amax`` of the input over all prompts (its
        fused group's largest), rounded down to a power of two.

    Raises:
        ValueError: ``prompts`` is empty; an activation holds NaN or inf (naming the layer).
    """
    if not prompts:
        raise ValueError("calibrate_input_global_scales needs at least one prompt.")
    selection = resolve_nvfp4_layer_selection(model, selection)
    amax: dict[str, torch.Tensor] = {}

    def make_hook(name):
        def hook(_module, args):
            value = abs_max(args[0])
            amax[name] = torch.maximum(amax[name], value) if name in amax else value

        return hook

    handles = [module.register_forward_pre_hook(make_hook(name))
               for name, module in iter_logical_linears(model) if selection.is_nvfp4(name)]
    observed = [(name, module) for name, module in iter_moe_experts(model)
                if selection.is_nvfp4(f"{name}.gate_up_proj")]
    for name, module in observed:
        module.forward = _observing_experts_forward(module, name, make_hook)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with nvfp4_quantizers_disabled(model):
            for prompt in progress(prompts, desc="NVFP4 calibration", unit="prompt"):
                ids = tokenizer(prompt, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
                model(input_ids=ids.to(device))
    finally:
        for h in handles:
            h.remove()
        for _, module in observed:
            del module.forward
        model.train(was_training)
    group_amax: dict[str, torch.Tensor] = {}
    for name, value in amax.items():
        g = fused_group(name)
        group_amax[g] = torch.maximum(group_amax[g], value) if g in group_amax else value
    return {name: global_scale_from_amax(group_amax[fused_group(name)].cpu(), f"The input of {name}")
            for name in amax}
