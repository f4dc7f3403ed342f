"""A weight sync written straight into a CPU engine's processed layers, without vLLM's layerwise reload machinery.

vLLM 0.31's in-place ``reload_weights(..., is_checkpoint_format=True)`` handles any layer of any model: per layer it
puts the checkpoint-format parameters back on the meta device, wraps every weight loader to buffer its calls until
the layer is complete, materialises the layer, loads it, runs ``process_weights_after_loading`` and copies the
processed tensors back into the storage the layer had before (CUDA graphs hold those addresses), then puts back every
layer that received nothing. On the demo's sync (SmolLM2-135M, 2-core AVX2 EPYC) that machinery cost about 0.25 s a
sync beyond the processing itself (docs/scale.md, "Sync cost").

On vLLM's CPU platform with eager execution nothing holds those addresses, so for the layers whose processing the
project knows, :class:`DirectWrite` does the same work with none of the machinery: it rebuilds the layer's
checkpoint-format parameters from the export (the members of a fused layer concatenated in the model's
``packed_modules_mapping`` order) and calls the layer's own ``quant_method.process_weights_after_loading``, the
function the reload would have called:

* unquantised linears without a bias (``UnquantizedLinearMethod``: vLLM packs the weight for its CPU GEMM);
* compressed-tensors NVFP4 W4A4 linears without a bias run by ``cpu_kernel.FastCpuNvFp4LinearKernel`` (the scheme
  renames, reduces the fused global scales and calls the kernel, which takes the dequantised weight the export's
  quantisation pass computed with the codes, :data:`DEQUANTISED_ATTR`, instead of decoding the packed one again);
* ``RMSNorm`` weights (copied in place, as the model's default weight loader does);
* vocabulary matrices of the checkpoint's shape (copied in place and re-packed; the tied ``lm_head`` is refreshed
  after the sync, ``cpu_reload.refresh_cpu_lm_heads``).

Anything else (biases, MoE experts, padded vocabularies, names the model maps differently) is returned to the caller
and goes through ``reload_weights`` in the same sync. Used for the vLLM model classes in :data:`DIRECT_WRITE_MODEL_CLASSES`,
each checked against the reload bit for bit (``tests/test_sampler_engine.py``), after the engine's first load
(a reload), on one process or DDP ranks (the learner whole), never with FSDP2, ZeRO-3, sleep mode, tensor
parallelism or a compiled engine (``enforce_eager=False``): those reload as before (:func:`direct_write_supported`).

Source: vLLM 0.31 ``model_executor/model_loader/reload/layerwise.py``, ``layers/linear.py``
(``UnquantizedLinearMethod``), ``layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .reload_warnings import NOT_FROM_CHECKPOINT, NOT_LOADED, filtered_reload_warnings

__all__ = ["DEQUANTISED_ATTR", "DIRECT_WRITE_MODEL_CLASSES", "DirectWrite", "direct_write_supported"]

logger = logging.getLogger(__name__)

DIRECT_WRITE_MODEL_CLASSES = frozenset({"LlamaForCausalLM", "Qwen3ForCausalLM"})
"""vLLM model classes whose direct sync the tests compare with vLLM's reload (engine state and log-probs bit for bit,
``tests/test_sampler_engine.py``): Llama (SmolLM2, the demo's and the lab's model) and Qwen3 (the tests' samplers).
vLLM's Transformers backend (``model_impl="transformers"``) is another class and reloads."""

_NVFP4_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")

DEQUANTISED_ATTR = "_nvfp4_dequantised_by_export"
"""The layer attribute through which :class:`DirectWrite` hands an NVFP4 layer the [out, in] values (model dtype) its
packed weight decodes to, computed by the export's own quantisation pass (``checkpoint_tensors.DequantisedWeights``):
``cpu_kernel.FastCpuNvFp4LinearKernel.process_weights_after_loading`` takes (and removes) it instead of decoding."""


def direct_write_supported(*, model_class: str | None, on_cpu: bool, enforce_eager: bool, tensor_parallel_size: int,
                           sharded_learner: bool, sleep_mode: bool) -> tuple[bool, str]:
    """Whether a sync may write into the engine's layers directly, and why not.

    Returns:
        ``(ok, reason)``; ``reason`` names the first condition that failed (empty when ``ok``).
    """
    for failed, reason in (
        (not on_cpu, "the engine is not on vLLM's CPU platform"),
        (not enforce_eager, "the engine is compiled (enforce_eager=False): its graphs may hold the layers' storage"),
        (tensor_parallel_size != 1, "tensor parallelism shards the layers"),
        (sharded_learner, "FSDP2 and ZeRO-3 gather the learner one unit at a time through the reload"),
        (sleep_mode, "sleep mode discards and restores the weights"),
        (model_class not in DIRECT_WRITE_MODEL_CLASSES,
         f"vLLM model class {model_class!r} is not checked against the reload"),
    ):
        if failed:
            return False, reason
    return True, ""


@dataclass
class _Target:
    """One vLLM layer the sync writes, and the checkpoint tensors it still waits for."""

    module: nn.Module
    kind: str  # "dense", "nvfp4", "norm" or "vocab"
    members: tuple[str, ...]  # checkpoint prefixes, in the fused layer's shard order
    needed: set[str]
    got: dict[str, torch.Tensor] = field(default_factory=dict)


class DirectWrite:
    """Per engine: routes a sync's checkpoint tensors to the engine layers it can write directly.

    Attributes:
        written: vLLM layer names written by the last sync.
        passed_on: checkpoint names the last sync returned for ``reload_weights``.
        missed: vLLM linear, norm and vocabulary layers that the last sync neither wrote, passed on nor left out on
            purpose (``skipped``): the export had no tensor for them, so they keep their previous values (logged as a
            warning, as vLLM's reload does).
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget the last sync (call at the start of every sync, whichever path it takes)."""
        self.written: list[str] = []
        self.passed_on: list[str] = []
        self.missed: list[str] = []
        self._written_counts: Counter[str] = Counter()  # layer class -> layers of it written directly

    def write(self, model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
              skipped: Sequence[str] = (), dequantised: dict[str, torch.Tensor] | None = None
              ) -> list[tuple[str, torch.Tensor]]:
        """Write every layer of ``model`` (a loaded vLLM model, inside ``llm.apply_model``) that ``weights`` completes
        and this class knows; return the other ``(name, tensor)`` pairs, in order, for ``reload_weights``.

        ``weights`` are checkpoint-format pairs in the engine's dtype (``vllm_engine.sampler_tensors``), one export
        unit at a time: a layer is written as soon as its last tensor arrives, so the written layers hold at most one
        unit (tensors passed on are held until the end). A layer still incomplete when ``weights`` ends is passed on
        whole. ``skipped``: checkpoint names left out on purpose (``frozen_vocab.FrozenVocabSkip.skipped``, read
        once ``weights`` is consumed); any other known layer that received nothing is in :attr:`missed`.
        ``dequantised``: the export's dequantised NVFP4 weights by checkpoint prefix
        (``checkpoint_tensors.DequantisedWeights.by_name``, filled while ``weights`` is read): an NVFP4 layer whose
        members all have one takes them (concatenated) instead of decoding its packed weight
        (:data:`DEQUANTISED_ATTR`); each entry is removed when its layer is written, and the rest (layers passed on,
        which the reload decodes) when ``weights`` ends.
        """
        from vllm.model_executor.layers.linear import LinearBase

        modules = dict(model.named_modules())
        packed = getattr(type(model), "packed_modules_mapping", None) or {}
        member_of = {m: fused for fused, members in packed.items() for m in members}
        targets: dict[str, _Target] = {}
        rest: list[tuple[str, torch.Tensor]] = []
        self.reset()
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            layer_name, target = self._target(prefix, leaf, modules, member_of, packed, targets, LinearBase)
            if target is None:
                rest.append((name, tensor))
                self.passed_on.append(name)
                if dequantised is not None and leaf == "weight_packed":
                    dequantised.pop(prefix, None)
                continue
            target.got[name] = tensor
            target.needed.discard(name)
            if not target.needed:
                del targets[layer_name]
                if self._write(target, dequantised):
                    self.written.append(layer_name)
                    self._written_counts[type(target.module).__name__] += 1
                else:
                    rest.extend(target.got.items())
                    self.passed_on.extend(target.got)
        for target in targets.values():
            rest.extend(target.got.items())
            self.passed_on.extend(target.got)
        if dequantised is not None:  # the layers passed on decode their own: hold no values through the reload
            dequantised.clear()
        self.missed = _missed_layers(modules, self.written, [*self.passed_on, *skipped], member_of, LinearBase)
        if self.missed:
            logger.warning("This sync had no weights for %d engine layer(s), which keep their previous values: %s. "
                           "The learner's export does not cover them; the sync probe judges whether the sampler "
                           "still follows the learner.", len(self.missed), ", ".join(self.missed[:8]))
        return rest

    @contextlib.contextmanager
    def quiet_reload(self) -> Iterator[None]:
        """Around a reload of what :meth:`write` passed on: drop vLLM's warnings about the layers written directly
        (the layerwise reload's "Failed to load weights", one record per layer written of that class, which names
        only the class; the model runner's list of weights not loaded, less theirs); every other record passes.
        The layers nobody wrote are :attr:`missed`, warned about by :meth:`write`."""
        written = tuple(f"{name}." for name in self.written)
        left = Counter(self._written_counts)  # one record dropped per layer written directly, no more

        def keep_layerwise(record: logging.LogRecord) -> bool:
            if record.msg != NOT_LOADED or not record.args or left[record.args[0]] <= 0:
                return True
            left[record.args[0]] -= 1
            return False

        def keep_runner(record: logging.LogRecord) -> bool:
            if record.msg != NOT_FROM_CHECKPOINT or not record.args or not written:
                return True
            record.args = ({n for n in record.args[0] if not n.startswith(written)},)
            return bool(record.args[0])

        with filtered_reload_warnings(keep_layerwise, keep_runner):
            yield

    def _target(self, prefix, leaf, modules, member_of, packed, targets, linear_base):
        """``(vLLM layer name, _Target)`` for the checkpoint tensor ``prefix.leaf``, or ``(None, None)``."""
        layer_name = _layer_name(prefix, member_of)
        if layer_name in targets:
            return layer_name, targets[layer_name]
        module = modules.get(layer_name)
        if module is None:
            return None, None
        parent, _, short = prefix.rpartition(".")
        members = (prefix,) if layer_name == prefix else tuple(f"{parent}.{m}" for m in packed[member_of[short]])
        kind = _kind(module, leaf, linear_base)
        if kind is None:
            return None, None
        leaves = _NVFP4_SUFFIXES if kind == "nvfp4" else ("weight",)
        target = _Target(module, kind, members, {f"{m}.{x}" for m in members for x in leaves})
        if f"{prefix}.{leaf}" not in target.needed:
            return None, None
        targets[layer_name] = target
        return layer_name, target

    def _write(self, target: _Target, dequantised: dict[str, torch.Tensor] | None = None) -> bool:
        """Write ``target``'s layer from its tensors; ``False`` (nothing written) when they do not fit its shapes."""
        module, got = target.module, target.got
        values = [dequantised.pop(m, None) for m in target.members] if dequantised is not None else []
        if target.kind in ("norm", "vocab"):
            (tensor,) = got.values()
            if tuple(tensor.shape) != tuple(module.weight.shape):
                return False
            module.weight.data.copy_(tensor)
            if target.kind == "vocab":
                module.quant_method.process_weights_after_loading(module)
            return True
        leaves = _NVFP4_SUFFIXES if target.kind == "nvfp4" else ("weight",)
        # fresh tensors: the processed layer must not share storage with the learner (an NVFP4 group's row blocks
        # of one buffer are the export's own: its quantisation pass made them)
        join = _joined if target.kind == "nvfp4" else torch.cat
        parts = {x: join([got[f"{m}.{x}"] for m in target.members]) if len(target.members) > 1
                 else got[f"{target.members[0]}.{x}"].clone() for x in leaves}
        if not _fits(module, parts[leaves[0]]):
            return False
        for x, tensor in parts.items():
            # the scheme's own processing renames weight_packed to the processed `weight`
            setattr(module, x, nn.Parameter(tensor, requires_grad=False))
        if hasattr(module, "_already_called_process_weights_after_loading"):
            delattr(module, "_already_called_process_weights_after_loading")
        if target.kind == "nvfp4" and values and all(v is not None for v in values):
            setattr(module, DEQUANTISED_ATTR, _joined(values) if len(values) > 1 else values[0])
        try:
            module.quant_method.process_weights_after_loading(module)
        finally:  # taken by the kernel; never left for a later load should the processing fail first
            module.__dict__.pop(DEQUANTISED_ATTR, None)
        return True


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` along rows; no copy when they are consecutive row blocks of one contiguous tensor (the
    export quantises a fused NVFP4 group's LoRA members in one pass: ``checkpoint_tensors._merged_weights``), whose
    memory they then share. For the export's NVFP4 codes, scales and values only: they are never the learner's."""
    first, base = tensors[0], tensors[0]._base
    if base is None or not base.is_contiguous() or first.dim() < 1:
        return torch.cat(tensors)
    start = offset = first.storage_offset()
    for tensor in tensors:
        if (tensor._base is not base or not tensor.is_contiguous() or tensor.shape[1:] != first.shape[1:]
                or tensor.storage_offset() != offset):
            return torch.cat(tensors)
        offset += tensor.numel()
    begin = start - base.storage_offset()
    return base.reshape(-1)[begin:begin + offset - start].view(-1, *first.shape[1:])


def _layer_name(prefix: str, member_of: dict[str, str]) -> str:
    """The vLLM layer of a checkpoint module name: a fused member's fused layer (``q_proj`` -> ``qkv_proj``)."""
    parent, _, short = prefix.rpartition(".")
    fused = member_of.get(short)
    return f"{parent}.{fused}" if fused and parent else prefix


def _missed_layers(modules: dict[str, nn.Module], written: list[str], other: list[str], member_of: dict[str, str],
                   linear_base) -> list[str]:
    """Linear, norm and vocabulary layers of ``modules`` that hold parameters of their own and were neither written
    nor named (as a layer or a fused member) by a checkpoint name in ``other``; a layer whose parameters all belong
    to a covered layer (a tied ``lm_head``) is covered."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    covered_names = set(written) | {_layer_name(n.rpartition(".")[0], member_of) for n in other}
    covered = {id(p) for n in covered_names if n in modules for p in modules[n].parameters(recurse=False)}
    missed = []
    for name, module in modules.items():
        if name in covered_names or not isinstance(module, (linear_base, RMSNorm, VocabParallelEmbedding)):
            continue
        own = list(module.parameters(recurse=False))
        if own and not all(id(p) in covered for p in own):
            missed.append(name)
    return missed


def _kind(module: nn.Module, leaf: str, linear_base) -> str | None:
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW4A4Fp4
    from vllm.model_executor.layers.vocab_parallel_embedding import (UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)

    from .cpu_kernel import FastCpuNvFp4LinearKernel

    method = getattr(module, "quant_method", None)
    if isinstance(module, linear_base) and getattr(module, "bias", None) is None:
        if isinstance(method, UnquantizedLinearMethod) and leaf == "weight":
            return "dense"
        scheme = getattr(module, "scheme", None)
        if (isinstance(scheme, CompressedTensorsW4A4Fp4) and not getattr(scheme, "use_a16", True)
                and isinstance(getattr(scheme, "kernel", None), FastCpuNvFp4LinearKernel) and leaf in _NVFP4_SUFFIXES):
            return "nvfp4"
        return None
    if type(module) is RMSNorm and leaf == "weight" and getattr(module, "has_weight", True):
        return "norm"
    if (isinstance(module, VocabParallelEmbedding) and isinstance(method, UnquantizedEmbeddingMethod)
            and leaf == "weight" and getattr(module, "bias", None) is None
            and module.weight.shape[0] == module.org_vocab_size):
        return "vocab"
    return None


def _fits(module: nn.Module, weight: torch.Tensor) -> bool:
    """Whether a linear's concatenated members (``weight`` [out, in], or packed NVFP4 [out, in/2]) have the shape
    of the engine's layer (one tensor-parallel partition, the only one)."""
    rows = sum(getattr(module, "output_partition_sizes", None) or [module.output_size_per_partition])
    cols = module.input_size_per_partition // (2 if weight.dtype == torch.uint8 else 1)
    return tuple(weight.shape) == (rows, cols)
