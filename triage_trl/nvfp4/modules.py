"""Finding a transformers model's linear layers under PEFT and NVFP4 wrappers.

Both the learner conversion and the checkpoint export address linears by their Hugging Face
checkpoint name (``model.layers.0.self_attn.q_proj``), which is also what vLLM loads; this module
maps PEFT's names (``base_model.model.<hf name>.base_layer``) back to those.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from ..models.blocks import hf_model  # the PEFT unwrap lives with the block walk; re-exported for nvfp4's modules

__all__ = [
    "block_index",
    "fused_group",
    "hf_model",
    "is_lora_layer",
    "iter_logical_linears",
]

_BLOCK_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FUSED_SIBLINGS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def is_lora_layer(module: nn.Module) -> bool:
    """True for a PEFT LoRA wrapper around a base linear (``peft.tuners.lora.LoraLayer``)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional
        return False
    return isinstance(module, LoraLayer) and hasattr(module, "base_layer")


def base_linear(module: nn.Module) -> nn.Module:
    """The innermost base linear of a (possibly nested) PEFT wrapper."""
    while is_lora_layer(module):
        module = module.base_layer
    return module


def iter_logical_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(hf_name, module)`` for every linear layer of ``model``, in module order.

    ``module`` is the outermost module whose input is the linear's input: the PEFT LoRA wrapper
    when there is one (its base linear is ``base_linear(module)``), else the ``nn.Linear``
    (including this package's NVFP4 learner linears, which subclass it).
    """
    root = hf_model(model)
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        name, module = stack.pop()
        if is_lora_layer(module) or isinstance(module, nn.Linear):
            yield name, module
            continue
        children = list(module.named_children())
        for child_name, child in reversed(children):
            stack.append((f"{name}.{child_name}" if name else child_name, child))


def block_index(name: str) -> int | None:
    """Decoder block number in ``...layers.<i>....``, or None outside the decoder blocks."""
    m = _BLOCK_RE.search(name)
    return int(m.group(1)) if m else None


def fused_group(name: str) -> str:
    """The name vLLM fuses this projection into (``...self_attn.qkv_proj`` for q/k/v,
    ``...mlp.gate_up_proj`` for gate/up); other layers are their own group."""
    prefix, _, leaf = name.rpartition(".")
    fused = _FUSED_SIBLINGS.get(leaf)
    return f"{prefix}.{fused}" if fused else name


@torch.no_grad()
def merged_weight(module: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
    """Master weight [out, in] of a logical linear, with active, unmerged LoRA deltas added.

    For a PEFT LoRA wrapper: ``W + sum_a get_delta_weight(a)`` over active adapters (nothing added
    when the adapters are merged already or disabled), in the base weight's dtype; for a plain
    linear: its weight, detached. ``out``: an [out, in] tensor of the base weight's dtype to write it into, returned
    (the export merges a fused group's members into one buffer).

    Raises:
        ValueError: ``out`` is not of the base weight's dtype.
    """
    if out is not None and out.dtype != base_linear(module).weight.dtype:
        raise ValueError(f"merged_weight(out=...) writes the base weight's dtype {base_linear(module).weight.dtype}; "
                         f"got {out.dtype}.")
    if not is_lora_layer(module):
        return module.weight.detach() if out is None else out.copy_(module.weight)
    base_w = merged_weight(module.base_layer)
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return base_w if out is None else out.copy_(base_w)
    # a copy of its own (the in-place addmm below must not reach base_w): out itself when float32
    total = out.copy_(base_w) if out is not None and out.dtype == torch.float32 else base_w.to(torch.float32, copy=True)
    for adapter in module.active_adapters:
        if adapter not in module.lora_A:
            continue
        if _plain_lora(module, adapter):
            # W + s * B @ A in one pass with no [out, in] temporary; in place, the same bits as torch.addmm and 8x
            # faster on CPU (SmolLM2's [1536, 576] with rank 16, 2-core EPYC: out-of-place copies the input first)
            total.addmm_(module.lora_B[adapter].weight.float(), module.lora_A[adapter].weight.float(),
                         alpha=module.scaling[adapter])
        else:
            total = total + module.get_delta_weight(adapter).float()
    if out is not None and out is not total:
        return out.copy_(total)  # rounded to the base's dtype, as below, into the caller's buffer
    return total.to(base_w.dtype)


def _plain_lora(module: nn.Module, adapter: str) -> bool:
    """A ``peft`` LoRA ``Linear`` adapter whose delta is ``scaling * B @ A``: no variant (DoRA and the others PEFT
    registers in ``lora_variant``), no ``fan_in_fan_out`` transpose, no LoRA bias."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return False
    if type(module) is not LoraLinear or getattr(module, "fan_in_fan_out", False):
        return False
    if adapter in getattr(module, "lora_variant", {}) or module.use_dora.get(adapter, False):
        return False
    lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
    return isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear) and lora_b.bias is None
