"""A transformers model one decoder block at a time, each made whole on this rank while it is read, whether the
model is plain, sharded by FSDP2 or partitioned by DeepSpeed ZeRO-3.

Why one block at a time: an export must not hold a whole unsharded model per rank (about 61 GB for a 30B model in
bf16). Each *export unit* (one decoder block, then everything outside the blocks: embeddings, final norm,
``lm_head``) is made whole only while its tensors are read: FSDP2's ``FSDPModule.unshard()`` / ``reshard()`` of the
modules that own its parameters, or ``deepspeed.zero.GatheredParameters`` on them. vLLM's fused groups (q/k/v,
gate/up) always lie inside one block. Gathers are collectives: every rank walks the units in the same order.

Source: torch ``torch.distributed.fsdp.FSDPModule``; DeepSpeed ``deepspeed.zero.GatheredParameters``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "ExportUnit", "export_units", "fsdp_owners", "hf_model", "materialized", "parameters_materialized",
    "zero3_partitioned",
]

_BLOCK_RE = re.compile(r"(?:^|\.)layers\.\d+$")


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model under a ``peft.PeftModel`` (``get_base_model()``), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


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


def export_units(model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None) -> list[ExportUnit]:
    """The decoder blocks of ``model`` (modules named ``...layers.<i>``, in order), then the rest of the model.

    Args:
        model: a transformers causal LM, possibly wrapped by ``peft``, sharded by FSDP2 or partitioned by ZeRO-3.
        modules: ``list(hf_model(model).named_modules())`` when the caller walked the model already (a walk of
            SmolLM2 with LoRA adapters, 2,500 modules, costs a few milliseconds).
    """
    root = hf_model(model)
    modules = root.named_modules() if modules is None else modules
    blocks = [(name, m) for name, m in modules if _BLOCK_RE.search(name)]
    units = [ExportUnit(name, module) for name, module in blocks]
    units.append(ExportUnit("", root, skip=tuple(m for _, m in blocks)))
    return units


def fsdp_owners(model: nn.Module) -> dict[int, nn.Module]:
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
def materialized(unit: ExportUnit, owners_by_module: Mapping[int, nn.Module], *, zero3: bool = True
                 ) -> Iterator[None]:
    """Make the unit's parameters whole on this rank for the block (a collective under FSDP2 and ZeRO-3);
    ``owners_by_module`` is :func:`fsdp_owners` of the model; ``zero3=False``: the caller knows that no parameter
    of the model is ZeRO-3-partitioned (:func:`zero3_partitioned`), so the unit is not walked to look for them.

    FSDP2: ``unshard()`` each ``FSDPModule`` owning a parameter of the unit (not recursive: a block wrapped on its
    own unshards only itself), ``reshard()`` after. ZeRO-3: ``deepspeed.zero.GatheredParameters`` on the unit's
    partitioned parameters (read-only). Plain parameters: nothing.
    """
    if not owners_by_module and not zero3:
        yield
        return
    skip = {id(m) for m in unit.skip}
    owners: dict[int, nn.Module] = {}

    def collect(module: nn.Module):
        if id(module) in skip:
            return
        if id(module) in owners_by_module and any(p is not None for p in module._parameters.values()):
            owner = owners_by_module[id(module)]
            owners.setdefault(id(owner), owner)
        for child in module.children():
            collect(child)

    if owners_by_module:
        collect(unit.module)
    partitioned = [p for p in unit.parameters() if hasattr(p, "ds_id")] if zero3 else []
    with contextlib.ExitStack() as stack:
        if partitioned:
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters(partitioned))
        for owner in owners.values():
            owner.unshard()
            stack.callback(owner.reshard)
        yield


def zero3_partitioned(modules: list[tuple[str, nn.Module]]) -> bool:
    """Whether a parameter of these ``(name, module)`` pairs (a model's ``named_modules()``) is partitioned by
    DeepSpeed ZeRO-3 (it carries DeepSpeed's ``ds_id``)."""
    return any(p is not None and hasattr(p, "ds_id") for _, m in modules for p in m._parameters.values())


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
