"""The sampler's weights from a learner that may be sharded (FSDP2) or partitioned (DeepSpeed ZeRO-3), one decoder
block at a time, and NVFP4 activation scales made identical on every rank.

Why one block at a time: a sync must not hold a whole unsharded model per rank (about 61 GB for a 30B model in
bf16). Each *export unit* (one decoder block, then everything outside the blocks: embeddings, final norm,
``lm_head``) is made whole on this rank only while its tensors are produced: FSDP2's ``FSDPModule.unshard()`` /
``reshard()`` of the modules that own its parameters, or ``deepspeed.zero.GatheredParameters`` on them. vLLM's
fused groups (q/k/v, gate/up) always lie inside one block, so every group's NVFP4 scales are computed from whole
weights, and every vLLM layer receives all its weights inside one unit (vLLM buffers a layer's weights until it is
complete). Peak extra memory per rank: one unsharded block plus its NVFP4 copy.

Gathers are collectives: every rank must consume :func:`iter_sampler_weights` completely, in the same order (each
rank reloads its own colocated engine, so each does).

Source: torch ``torch.distributed.fsdp.FSDPModule``; DeepSpeed ``deepspeed.zero.GatheredParameters``; vLLM 0.31
``model_executor/model_loader/reload/layerwise.py`` (layer-wise buffering on reload).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..nvfp4.export import weight_global_scale_from_amax
from ..nvfp4.modules import base_linear, fused_group, hf_model, iter_logical_linears, merged_weight
from ..nvfp4.quantize import nvfp4_quantize

__all__ = [
    "ExportUnit",
    "all_ranks_agree",
    "export_units",
    "iter_sampler_weights",
    "materialized",
    "parameters_materialized",
    "reduce_input_global_scales",
]

_BLOCK_RE = re.compile(r"(?:^|\.)layers\.\d+$")


@dataclass
class ExportUnit:
    """One piece of the model made whole at a time: a decoder block (``prefix`` its Hugging Face name, ``module``
    the block) or the rest of the model (``prefix=""``, ``module`` the root, blocks excluded via ``skip``)."""

    prefix: str
    module: nn.Module
    skip: tuple[nn.Module, ...] = ()

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` of the unit's parameters and persistent buffers, in ``state_dict`` order, as
        registered right now (whole inside :func:`materialized`). Tied tensors appear under each name."""
        skip = {id(m) for m in self.skip}

        def walk(module: nn.Module, prefix: str):
            if id(module) in skip:
                return
            for name, param in module._parameters.items():
                if param is not None:
                    yield prefix + name, param
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    yield prefix + name, buf
            for name, child in module._modules.items():
                if child is not None:
                    yield from walk(child, f"{prefix}{name}.")

        yield from walk(self.module, f"{self.prefix}." if self.prefix else "")

    def parameters(self) -> list[nn.Parameter]:
        """The unit's parameters, each once (tied ones are registered under several names)."""
        unique = {id(t): t for _, t in self.named_tensors() if isinstance(t, nn.Parameter)}
        return list(unique.values())


def export_units(model: nn.Module) -> list[ExportUnit]:
    """The decoder blocks of ``model`` (modules named ``...layers.<i>``, in order), then the rest of the model.

    Args:
        model: a transformers causal LM, possibly wrapped by ``peft``, sharded by FSDP2 or partitioned by ZeRO-3.
    """
    root = hf_model(model)
    blocks = [(name, m) for name, m in root.named_modules() if _BLOCK_RE.search(name)]
    units = [ExportUnit(name, module) for name, module in blocks]
    units.append(ExportUnit("", root, skip=tuple(m for _, m in blocks)))
    return units


def _fsdp_owners(model: nn.Module) -> dict[int, nn.Module]:
    """``id(module) -> the FSDP2 module whose parameter group holds that module's own parameters`` (the nearest
    ``FSDPModule`` at or above it), for every module under one; empty without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return {}
    owners: dict[int, nn.Module] = {}

    def walk(module: nn.Module, owner):
        owner = module if isinstance(module, FSDPModule) else owner
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            walk(child, owner)

    walk(model, None)
    return owners


@contextlib.contextmanager
def materialized(unit: ExportUnit, fsdp_owners: Mapping[int, nn.Module]) -> Iterator[None]:
    """Make the unit's parameters whole on this rank for the block (a collective under FSDP2 and ZeRO-3).

    FSDP2: ``unshard()`` each ``FSDPModule`` owning a parameter of the unit (not recursive: a block wrapped on its
    own unshards only itself), ``reshard()`` after. ZeRO-3: ``deepspeed.zero.GatheredParameters`` on the unit's
    partitioned parameters (read-only). Plain parameters: nothing.
    """
    skip = {id(m) for m in unit.skip}
    owners: dict[int, nn.Module] = {}

    def collect(module: nn.Module):
        if id(module) in skip:
            return
        if id(module) in fsdp_owners and any(p is not None for p in module._parameters.values()):
            owner = fsdp_owners[id(module)]
            owners.setdefault(id(owner), owner)
        for child in module.children():
            collect(child)

    collect(unit.module)
    partitioned = [p for p in unit.parameters() if hasattr(p, "ds_id")]
    with contextlib.ExitStack() as stack:
        if partitioned:
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters(partitioned))
        for owner in owners.values():
            owner.unshard()
            stack.callback(owner.reshard)
        yield


def parameters_materialized(model: nn.Module) -> bool:
    """Whether every parameter of ``model`` is whole on this rank now: no FSDP2 ``DTensor``, no ZeRO-3 partition,
    no meta tensor (FSDP's ``cpu_ram_efficient_loading`` loads ranks other than 0 on the meta device)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        DTensor = ()  # noqa: N806
    return not any(
        isinstance(p, DTensor) or hasattr(p, "ds_id") or p.device.type == "meta" for p in model.parameters()
    )


def all_ranks_agree(flag: bool, accelerator) -> bool:
    """``flag`` AND-reduced over every process (a collective; ``flag`` itself with one process)."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([1 if flag else 0], device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum").item() == accelerator.num_processes)


def reduce_input_global_scales(scales: dict[str, torch.Tensor], accelerator) -> dict[str, torch.Tensor]:
    """The NVFP4 activation global scales every rank will use: per layer the minimum over ranks.

    A global scale is ``448 * 6 / amax`` (a divisor, monotone decreasing in ``amax``), so the minimum scale is the
    scale of the largest activation any rank saw: the all-reduce of the per-layer ``amax`` with MAX. (A layer whose
    calibration saw ``amax = 0`` on some rank has scale 1 there and takes part as such.)

    Args:
        scales: ``{hf_linear_name: 0-dim float32}``; the same names on every rank.
        accelerator: the trainer's ``Accelerator`` (a collective with more than one process).

    Returns:
        A new dict, identical on every rank.

    Raises:
        ValueError: the ranks calibrated different layers.
    """
    names = sorted(scales)
    if accelerator.num_processes == 1:
        return {name: scales[name].detach().float().reshape(()).cpu() for name in names}
    count = torch.tensor([len(names)], device=accelerator.device)
    counts = accelerator.gather(count).cpu()
    if bool((counts != len(names)).any()):
        raise ValueError(f"Ranks calibrated different numbers of NVFP4 layers ({counts.tolist()}); every rank must "
                         "run the same model and layer selection.")
    local = torch.stack([scales[n].detach().float().reshape(()) for n in names]).to(accelerator.device)
    gathered = accelerator.gather(local).view(accelerator.num_processes, len(names)).cpu()
    reduced = gathered.amin(dim=0)
    return {name: reduced[i].clone() for i, name in enumerate(names)}


@torch.no_grad()
def iter_sampler_weights(
    model: nn.Module,
    *,
    quantized: Collection[str] = (),
    input_global_scales: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-format ``(name, tensor)`` pairs for the sampler, one export unit made whole at a time.

    The same tensors as ``triage_trl.nvfp4.export.iter_nvfp4_checkpoint_weights`` for a plain model (asserted
    bit for bit in ``tests/test_distributed_export.py``), for FSDP2-sharded and ZeRO-3-partitioned models too.
    With ``quantized`` empty it is the bf16 sampler's export (LoRA deltas merged, Hugging Face names).

    Args:
        model: a transformers causal LM (plain, ``peft``, NVFP4-converted; FSDP2 or ZeRO-3 allowed).
        quantized: Hugging Face names of the linears exported as NVFP4 (``quantized_linear_names``).
        input_global_scales: ``{hf_linear_name: 0-dim}`` activation scales (required for every quantised name);
            fused siblings take their group's smallest.

    Yields:
        Non-quantised tensors as registered (detached; whole while the unit is materialised); per quantised linear
        ``weight_packed`` uint8 [out, in/2], ``weight_scale`` fp8 e4m3 [out, in/16], ``weight_global_scale`` and
        ``input_global_scale`` float32 [1]; biases. Tied tensors once, under their first name.

    Raises:
        KeyError: a quantised linear has no input global scale.
    """
    quantized = frozenset(quantized)
    scales = dict(input_global_scales or {})
    missing = sorted(quantized - set(scales))
    if missing:
        raise KeyError(f"No input global scale for {missing[:4]}: calibrate the NVFP4 activation scales first.")
    linears = dict(iter_logical_linears(model))
    owners = _fsdp_owners(model)
    seen: set[int] = set()
    for unit in export_units(model):
        with materialized(unit, owners):
            yield from _unit_tensors(unit, linears, quantized, scales, seen)


def _unit_tensors(unit, linears, quantized, scales, seen) -> Iterator[tuple[str, torch.Tensor]]:
    keys = list(unit.named_tensors())
    owners = {key: _owning_linear(key, linears) for key, _ in keys}
    names = list(dict.fromkeys(o for o in owners.values() if o is not None))
    weights = {name: merged_weight(linears[name]) for name in names}
    group_w_amax: dict[str, torch.Tensor] = {}
    group_in_scale: dict[str, torch.Tensor] = {}
    for name in names:
        if name in quantized:
            g = fused_group(name)
            amax = weights[name].abs().amax().float().cpu()
            scale = scales[name].detach().float().reshape(()).cpu()
            group_w_amax[g] = torch.maximum(group_w_amax[g], amax) if g in group_w_amax else amax
            group_in_scale[g] = torch.minimum(group_in_scale[g], scale) if g in group_in_scale else scale
    done: set[str] = set()
    for key, tensor in keys:
        owner = owners[key]
        if owner is None:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield key, tensor.detach()
        elif owner not in done:
            done.add(owner)
            bias = base_linear(linears[owner]).bias
            if owner in quantized:
                g = fused_group(owner)
                yield from _nvfp4_linear(owner, weights[owner], group_w_amax[g], group_in_scale[g])
            elif id(base_linear(linears[owner]).weight) not in seen:  # a tied lm_head goes once, as the embedding
                seen.add(id(base_linear(linears[owner]).weight))
                yield f"{owner}.weight", weights[owner]
            if bias is not None:
                yield f"{owner}.bias", bias.detach()


def _owning_linear(key: str, linears: Mapping[str, nn.Module]) -> str | None:
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in linears:
            return prefix
    return None


def _nvfp4_linear(name: str, weight: torch.Tensor, w_amax: torch.Tensor, input_scale: torch.Tensor):
    global_scale = weight_global_scale_from_amax(w_amax)
    qt = nvfp4_quantize(weight, per_tensor_scale=(1.0 / global_scale).to(weight.device))
    yield f"{name}.weight_packed", qt.qdata.view(torch.uint8)
    yield f"{name}.weight_scale", qt.scale.view(torch.float8_e4m3fn)
    yield f"{name}.weight_global_scale", global_scale.reshape(1)
    yield f"{name}.input_global_scale", input_scale.reshape(1)
