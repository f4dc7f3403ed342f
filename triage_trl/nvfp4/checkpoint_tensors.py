"""The tensors of a compressed-tensors NVFP4 checkpoint of a learner's weights: streamed to the vLLM sampler at every
weight sync (:func:`iter_checkpoint_weights`), or written as a folder (:func:`save_nvfp4_checkpoint`, which
``triage-export`` and the tests use). Not the ``triage-export`` product itself: that is ``triage_trl/export/``.

Format (compressed-tensors ``nvfp4-pack-quantized``, preset scheme ``NVFP4``, what vLLM's
``CompressedTensorsW4A4Fp4`` scheme loads), per quantised linear ``<p>``:

* ``<p>.weight_packed``        uint8 [out, in/2]: E2M1 codes, element 2j in the low nibble;
* ``<p>.weight_scale``         float8_e4m3fn [out, in/16]: block scales;
* ``<p>.weight_global_scale``  float32 [1]: a *divisor*, ``w = e2m1 * weight_scale / global``;
* ``<p>.input_global_scale``   float32 [1]: divisor for the activations, from ``calibrate_input_global_scales``
  (``triage_trl.nvfp4.calibration``; vLLM quantises activations with this static scale);
* ``<p>.bias`` when present. Every other parameter (embeddings, norms, ``lm_head``, MoE routers) is exported
  unchanged. vLLM fuses q/k/v and gate/up, so those share both global scales (max amax).

MoE experts (transformers 5's 3-D ``gate_up_proj``/``down_proj``) are written per expert, in bf16 or NVFP4 as the
selection says, under the names vLLM's MoE loaders read (``triage_trl.nvfp4.checkpoint_experts``).

Global scales (weights and activations): ``numerics.global_scale_from_amax``, ``448 * 6 / amax`` rounded down to a
power of two, so vLLM, compressed-tensors and torchao decode bit-identical values (see ``triage_trl.nvfp4.numerics``).
The codes and block scales are torchao's quantisation (``numerics.quantize_torchao``, bit-identical to
``NVFP4Tensor.to_nvfp4``; its "4 over 6" block scales when the selection's ``four_over_six`` says so, the learner's
rule too), packed as torchao packs them (``numerics.encode_e2m1``), both in one compiled pass per weight
(``quantize.nvfp4_quantize_packed``, bit-identical).

Master weights are read from the model as it is: a plain transformers model, one converted by
``convert_to_nvfp4_learner`` (its high-precision master weights, not the fake-quantised copy),
or a ``peft`` model (base weight plus active LoRA deltas, merged in float32).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..models.blocks import export_units, fsdp_owners, materialized, zero3_partitioned
from ..runtime.progress import progress
from .experts import PROJECTIONS, _unsupported_layout, iter_moe_experts
from .checkpoint_experts import iter_expert_checkpoint_tensors
from .modules import base_linear, fused_group, hf_model, is_lora_layer, iter_logical_linears, merged_weight
from .calibration import calibrate_input_global_scales
from .numerics import abs_max, check_finite, global_scale_from_amax
from .quantize import nvfp4_quantize_packed
from .selection import NVFP4LayerSelection, resolve_nvfp4_layer_selection

__all__ = [
    "DequantisedWeights",
    "calibrate_input_global_scales",
    "iter_checkpoint_weights",
    "iter_nvfp4_checkpoint_weights",
    "nvfp4_quantization_config",
    "save_nvfp4_checkpoint",
]

@dataclass
class DequantisedWeights:
    """Where :func:`iter_checkpoint_weights` leaves each NVFP4 linear's dequantised weight, for a consumer that
    would otherwise decode the packed weight it was just given (the sampler's direct sync,
    ``triage_trl.sampler.direct_write``).

    Attributes:
        dtype: the dtype to dequantise into (the engine's).
        by_name: ``{hf_linear_name: [out, in]}``, computed in the export's quantisation pass: bit for bit what
            vLLM's ``dequantize_to_dtype`` decodes from that linear's ``weight_packed``, ``weight_scale`` and
            ``weight_global_scale`` (``nvfp4.quantize.nvfp4_quantize_packed``). The consumer pops what it uses.
    """

    dtype: torch.dtype
    by_name: dict[str, torch.Tensor] = field(default_factory=dict)


@torch.no_grad()
def iter_checkpoint_weights(
    model: nn.Module,
    *,
    selection: NVFP4LayerSelection | None = None,
    input_global_scales: Mapping[str, torch.Tensor] | None = None,
    dequantised: DequantisedWeights | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-format ``(name, tensor)`` pairs of ``model``, one export unit made whole at a time
    (``triage_trl.models.blocks``: plain, FSDP2-sharded and ZeRO-3-partitioned models alike).

    Feed them, all in one call, to vLLM's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` or to a
    checkpoint writer. Names are Hugging Face checkpoint names (PEFT prefixes and ``base_layer`` removed; active LoRA
    deltas merged in float32); tied weights are yielded once, under their first name. Gathers are collectives: every
    rank must consume the iterator completely.

    Args:
        model: a transformers causal LM, possibly converted by ``convert_to_nvfp4_learner``, wrapped by ``peft``,
            sharded by FSDP2 or partitioned by ZeRO-3.
        selection: the NVFP4 layers; ``None`` exports every linear unquantised (the bf16 sampler's checkpoint).
        input_global_scales: ``{hf_linear_name: 0-dim}`` activation scales (``calibrate_input_global_scales``),
            required for every NVFP4 layer; fused siblings take their group's smallest (largest amax).
        dequantised: when given, each NVFP4 linear's dequantised weight is left in it
            (:class:`DequantisedWeights`) just before its tensors are yielded (MoE experts are not).

    Yields:
        Non-quantised tensors as stored (detached, not copied); per NVFP4 linear ``weight_packed`` uint8
        [out, in/2], ``weight_scale`` fp8 e4m3 [out, in/16], ``weight_global_scale`` and ``input_global_scale``
        float32 [1] (the members of a fused group whose every member is LoRA-adapted: consecutive row blocks of one
        tensor, quantised together); biases; MoE experts per expert
        (``checkpoint_experts.iter_expert_checkpoint_tensors``).

    Raises:
        KeyError: an NVFP4 linear has no input global scale (calibrate first).
        ValueError: an NVFP4 weight holds NaN or inf (naming the layer).
    """
    quantized = frozenset(selection.nvfp4_layers) if selection is not None else frozenset()
    four_over_six = selection.four_over_six if selection is not None else False
    scales = dict(input_global_scales or {})
    missing = sorted(quantized - set(scales))
    if missing:
        raise KeyError(
            f"No input global scale for {missing[:4]}{'...' if len(missing) > 4 else ''}; run "
            "calibrate_input_global_scales(model, tokenizer, prompts) on this model first."
        )
    linears = dict(iter_logical_linears(model))
    modules = list(hf_model(model).named_modules())  # one walk, read three times below (runs at every sync)
    # Per-expert names for the gated, concatenated, bias-free [E, out, in] layout (Qwen3-MoE's, which vLLM reads per
    # expert); any other layout (GptOss: transposed, interleaved, with biases) never runs in NVFP4 and goes out as
    # stored, the 3-D tensors save_pretrained writes and vLLM's loader for that family reads.
    experts = {f"{name}.{proj}" for name, module in iter_moe_experts(model, modules)
               if not _unsupported_layout(module) for proj in PROJECTIONS}
    owners = fsdp_owners(model)
    zero3 = zero3_partitioned(modules)
    seen: set[int] = set()
    for unit in export_units(model, modules):
        with materialized(unit, owners, zero3=zero3):
            for key, tensor in _unit_tensors(unit, linears, quantized, scales, seen, four_over_six, dequantised):
                if key in experts:  # a 3-D experts projection: written per expert
                    yield from iter_expert_checkpoint_tensors(key, tensor, nvfp4=key in quantized,
                                                              input_global_scale=scales.get(key),
                                                              four_over_six=four_over_six)
                else:
                    yield key, tensor


def iter_nvfp4_checkpoint_weights(
    model: nn.Module,
    input_global_scales: Mapping[str, torch.Tensor],
    *,
    selection: NVFP4LayerSelection | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_checkpoint_weights` of ``model`` as an NVFP4 compressed-tensors model: ``selection`` ``None`` is
    the model's own (``triage_trl.nvfp4.selection``, the one its learner conversion used).

    Raises:
        as :func:`iter_checkpoint_weights`; ValueError: ``selection`` differs from the model's own.
    """
    selection = resolve_nvfp4_layer_selection(model, selection)
    yield from iter_checkpoint_weights(model, selection=selection, input_global_scales=input_global_scales)


def _unit_tensors(unit, linears, quantized, scales, seen, four_over_six, dequantised
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    keys = list(unit.named_tensors())
    owners = {key: _owning_linear(key, linears) for key, _ in keys}
    names = list(dict.fromkeys(o for o in owners.values() if o is not None))
    weights, fused = _merged_weights(names, linears, quantized)
    group_quantised: dict[str, tuple] = {}
    group_w_amax: dict[str, torch.Tensor] = {}
    group_in_scale: dict[str, torch.Tensor] = {}
    for name in names:
        if name in quantized:
            g = fused_group(name)
            amax = abs_max(weights[name]).cpu()
            check_finite(amax, f"The weight of {name}")
            scale = scales[name].detach().float().reshape(()).cpu()
            group_w_amax[g] = torch.maximum(group_w_amax[g], amax) if g in group_w_amax else amax
            group_in_scale[g] = torch.minimum(group_in_scale[g], scale) if g in group_in_scale else scale
    # once per fused group (its members share both scales): the scalar work is per layer, not per element
    group_scales = {g: (global_scale_from_amax(amax), group_in_scale[g]) for g, amax in group_w_amax.items()}
    values_dtype = dequantised.dtype if dequantised is not None else None
    done: set[str] = set()
    for key, tensor in keys:
        owner = owners[key]
        if owner is None:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield key, tensor.detach()
        elif owner not in done:
            done.add(owner)
            base = base_linear(linears[owner])
            if owner in quantized:
                g = fused_group(owner)
                global_scale, input_scale = group_scales[g]
                if g in fused:  # the group's members in one buffer: quantised once, each member its row block
                    buffer, rows = fused[g]
                    if g not in group_quantised:
                        group_quantised[g] = _quantise(buffer, global_scale, four_over_six, values_dtype)
                    start, end = rows.pop(owner)
                    quantised = tuple(None if t is None else t[start:end] for t in group_quantised[g])
                    if not rows:  # the last member: the consumer holds what it keeps
                        del group_quantised[g], fused[g]
                else:
                    quantised = _quantise(weights[owner], global_scale, four_over_six, values_dtype)
                yield from _nvfp4_tensors(owner, *quantised, global_scale, input_scale, dequantised)
            elif id(base.weight) not in seen:  # a tied lm_head goes once, as the embedding
                seen.add(id(base.weight))
                yield f"{owner}.weight", weights[owner]
            if base.bias is not None:
                yield f"{owner}.bias", base.bias.detach()


def _owning_linear(key: str, linears: Mapping[str, nn.Module]) -> str | None:
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in linears:
            return prefix
    return None


def _merged_weights(names, linears, quantized) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """``merged_weight`` of each linear in ``names``, and the NVFP4 fused groups (gate/up, q/k/v) whose members are
    all LoRA wrappers over bases of one dtype and input width: merged into one buffer (where the merge writes its
    result anyway), so the group is quantised once and the direct sync takes its codes without concatenating them.

    Returns:
        ``(weights, fused)``: ``{name: [out, in]}`` (row blocks of the buffer for fused members) and
        ``{group: (buffer, {name: (first_row, end_row)})}``.
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        if name in quantized:
            groups.setdefault(fused_group(name), []).append(name)
    weights: dict[str, torch.Tensor] = {}
    fused: dict[str, tuple] = {}
    for group, members in groups.items():
        bases = [base_linear(linears[m]).weight for m in members]
        if (len(members) < 2 or not all(_adapted(linears[m]) for m in members)
                or any(b.dtype != bases[0].dtype or b.dim() != 2 or b.device != bases[0].device for b in bases)
                or len({b.shape[1] for b in bases}) != 1):
            continue
        buffer = torch.empty(sum(b.shape[0] for b in bases), bases[0].shape[1], dtype=bases[0].dtype,
                             device=bases[0].device)
        rows, start = {}, 0
        for member, base in zip(members, bases):
            rows[member] = (start, start + base.shape[0])
            weights[member] = merged_weight(linears[member], out=buffer[start:start + base.shape[0]])
            start += base.shape[0]
        fused[group] = (buffer, rows)
    for name in names:
        if name not in weights:
            weights[name] = merged_weight(linears[name])
    return weights, fused


def _adapted(module) -> bool:
    """A LoRA wrapper whose merge copies its weight anyway: unmerged, enabled, with an active adapter."""
    return (is_lora_layer(module) and not getattr(module, "merged", False)
            and not getattr(module, "disable_adapters", False)
            and any(a in module.lora_A for a in module.active_adapters))


def _quantise(weight, global_scale, four_over_six, values_dtype) -> tuple:
    """``(weight_packed, weight_scale, values or None)`` of a weight [out, in] (``nvfp4_quantize_packed``)."""
    per_tensor_scale = (1.0 / global_scale).to(weight.device)
    if values_dtype is None:
        return (*nvfp4_quantize_packed(weight, per_tensor_scale, four_over_six=four_over_six), None)
    return nvfp4_quantize_packed(weight, per_tensor_scale, four_over_six=four_over_six, values_dtype=values_dtype)


def _nvfp4_tensors(name, packed, block_scale, values, global_scale, input_scale, dequantised
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    if dequantised is not None:
        dequantised.by_name[name] = values
    yield f"{name}.weight_packed", packed
    yield f"{name}.weight_scale", block_scale
    yield f"{name}.weight_global_scale", global_scale.reshape(1)
    yield f"{name}.input_global_scale", input_scale.reshape(1)


def nvfp4_quantization_config(model: nn.Module, *, selection: NVFP4LayerSelection | None = None):
    """compressed-tensors ``QuantizationConfig`` for the checkpoint: preset scheme ``NVFP4`` targeting ``Linear``,
    format ``nvfp4-pack-quantized``, status compressed, and ``ignore`` listing every layer the selection keeps
    in bf16 (``selection.checkpoint_ignore``: linears and routers by their full Hugging Face name, kept experts by
    their per-expert checkpoint names)."""
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    return QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("NVFP4", ["Linear"])},
        format=CompressionFormat.nvfp4_pack_quantized.value,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(resolve_nvfp4_layer_selection(model, selection).checkpoint_ignore),
    )


def save_nvfp4_checkpoint(
    model: nn.Module,
    tokenizer,
    out_dir: str | Path,
    input_global_scales: dict[str, torch.Tensor],
    *,
    selection: NVFP4LayerSelection | None = None,
) -> Path:
    """Write ``model`` as an NVFP4 compressed-tensors checkpoint folder that ``vllm.LLM`` loads.

    Writes ``model.safetensors`` (``iter_nvfp4_checkpoint_weights``), ``config.json`` (the model's
    config plus a ``quantization_config`` written by compressed-tensors' ``ModelCompressor``) and
    the tokenizer. Returns ``out_dir``. Raises as ``iter_nvfp4_checkpoint_weights``.
    """
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import save_file

    selection = resolve_nvfp4_layer_selection(model, selection)
    tensors = {
        name: t.detach().to("cpu").contiguous().clone()
        for name, t in progress(iter_nvfp4_checkpoint_weights(model, input_global_scales, selection=selection),
                                desc="NVFP4 export", unit="tensor")
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = hf_model(model).config
    config.save_pretrained(out_dir)
    quantization_config = nvfp4_quantization_config(model, selection=selection)
    ModelCompressor(quantization_config=quantization_config).update_config(str(out_dir))
    json.loads((out_dir / "config.json").read_text())  # fail here, not in vLLM, on a bad file
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
