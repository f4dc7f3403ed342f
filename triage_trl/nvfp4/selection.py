"""Which linear layers run in NVFP4: one rule, computed once per model, read by the learner and the sampler alike.

"Layers" are the model's linears, the two projections of each MoE experts module (``<experts>.gate_up_proj``,
``<experts>.down_proj``: transformers 5's 3-D parameters, ``triage_trl.nvfp4.experts``) and the MoE routers that are
not ``nn.Linear`` (``Qwen3MoeTopKRouter``); ``LayerChoice.kind`` tells which.

``nvfp4_layer_selection(model, config)`` applies the rule to a transformers model (or a PEFT model around one) and
stores the result on it; the learner conversion (``convert_to_nvfp4_learner``), the calibration, the checkpoint
export and its compressed-tensors ``ignore`` list all read that same object, so the two engines cannot quantise
different layers, whatever their precisions.

The rule, per linear (the first reason that applies keeps it in bf16):

1. outside the decoder blocks (``...layers.<i>...``): embeddings and ``lm_head`` are never quantised;
2. MoE routers and gates (``...gate``, ``...router``, ``...shared_expert_gate``) are never quantised;
2b. MoE experts where ``nvfp4_moe_experts`` keeps them (``"bf16"``, or ``"auto"`` where the sampler's vLLM has no
   NVFP4 MoE kernel: ``experts.sampler_nvfp4_moe_support``), or whose layout NVFP4 does not support;
3. in the first ``nvfp4_keep_first_blocks`` or the last ``nvfp4_keep_last_blocks`` decoder blocks;
4. kept by the ``nvfp4_recipe`` preset (``triage_trl.nvfp4.recipes``);
5. matching one of ``nvfp4_exclude_patterns`` (``re.search`` on the Hugging Face module name);
6. in or out features not a multiple of 16 (the NVFP4 block);

and then per vLLM-fused group (q/k/v, gate/up; an experts module's two projections): if one member is kept, all are
(vLLM runs them as one layer, and one experts module with one scheme).
Whether an NVFP4 layer runs natively (torchao, sm100) or emulated is an execution path, not part of the selection.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn

from .config import NVFP4Config
from .experts import (
    ROUTER_LEAF,
    experts_ignore_pattern,
    iter_expert_projections,
    iter_moe_routers,
    sampler_nvfp4_moe_support,
)
from .modules import base_linear, block_index, fused_group, hf_model, iter_logical_linears
from .numerics import BLOCK_SIZE
from .recipes import recipe_keeps

logger = logging.getLogger(__name__)

__all__ = [
    "LayerChoice",
    "NVFP4LayerSelection",
    "nvfp4_layer_selection",
    "resolve_nvfp4_layer_selection",
    "select_nvfp4_layers",
]

_ATTRIBUTE = "nvfp4_layer_selection"


@dataclass(frozen=True)
class LayerChoice:
    """One layer's precision: ``nvfp4`` or not, ``reason`` (why it stays in bf16; empty for NVFP4), ``kind``
    (``"linear"``, ``"experts"``: one projection of an experts module, ``"router"``) and ``params`` (its weight's
    element count, all experts included)."""

    nvfp4: bool
    reason: str = ""
    kind: str = "linear"
    params: int = 0


@dataclass(frozen=True)
class NVFP4LayerSelection:
    """The NVFP4 layer selection of one model: a ``LayerChoice`` per linear (Hugging Face module names, in module
    order) and the settings both engines must share: the layer rule's and the weight block-scale rule
    (``nvfp4_four_over_six``, read by the export). Immutable; compare with ``==``."""

    layers: tuple[tuple[str, LayerChoice], ...]
    settings: tuple[tuple[str, object], ...]
    _index: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_index", dict(self.layers))

    def choice(self, name: str) -> LayerChoice:
        """The choice for layer ``name`` (a linear, ``<experts>.gate_up_proj``/``down_proj``, or a router). Raises
        ``KeyError`` naming the layer if the model had no such layer."""
        if name not in self._index:
            raise KeyError(f"{name} is not a linear layer (nor an experts projection or router) of the model this "
                           "NVFP4 selection was computed for.")
        return self._index[name]

    def is_nvfp4(self, name: str) -> bool:
        """Whether layer ``name`` runs in NVFP4 (learner and sampler)."""
        return self.choice(name).nvfp4

    @property
    def nvfp4_layers(self) -> tuple[str, ...]:
        """Names of the NVFP4 layers, in module order."""
        return tuple(n for n, c in self.layers if c.nvfp4)

    @property
    def kept_layers(self) -> tuple[str, ...]:
        """Names of the layers kept in bf16, in module order (``checkpoint_ignore`` is the checkpoint's list)."""
        return tuple(n for n, c in self.layers if not c.nvfp4)

    @property
    def four_over_six(self) -> bool:
        """Whether NVFP4 weights use "4 over 6" block scales (``numerics.quantize_torchao``), learner and export."""
        return bool(dict(self.settings)["nvfp4_four_over_six"])

    @property
    def checkpoint_ignore(self) -> tuple[str, ...]:
        """The compressed-tensors ``ignore`` list: every kept linear and router by its Hugging Face name, and every
        kept experts module as one ``re:`` pattern over its per-expert checkpoint names
        (``experts.experts_ignore_pattern``, what vLLM's ``CompressedTensorsMoEMethod`` looks up)."""
        names = []
        for name, c in self.layers:
            if not c.nvfp4:
                names.append(experts_ignore_pattern(name.rpartition(".")[0]) if c.kind == "experts" else name)
        return tuple(dict.fromkeys(names))

    def parameter_counts(self) -> dict[str, int]:
        """Weight parameters per precision and kind: ``{"nvfp4/params_<nvfp4|bf16>_<linear|experts|router>": n}``
        (experts counted over all experts; embeddings and norms are not layers and not counted)."""
        counts: dict[str, int] = {}
        for _, c in self.layers:
            key = f"nvfp4/params_{'nvfp4' if c.nvfp4 else 'bf16'}_{c.kind}"
            counts[key] = counts.get(key, 0) + c.params
        return counts

    def summary(self) -> dict[str, int]:
        """Counts for logs and cards: ``{"nvfp4/layers_nvfp4": n, "nvfp4/layers_bf16": n}`` (an experts projection
        counts as one layer); for MoE models also the experts' parameters per precision
        (``nvfp4/params_nvfp4_experts``, ``nvfp4/params_bf16_experts``), so a log says where the experts run."""
        counts = {"nvfp4/layers_nvfp4": len(self.nvfp4_layers), "nvfp4/layers_bf16": len(self.kept_layers)}
        if any(c.kind == "experts" for _, c in self.layers):
            params = self.parameter_counts()
            counts.update({k: params.get(k, 0) for k in ("nvfp4/params_nvfp4_experts", "nvfp4/params_bf16_experts")})
        return counts

    def __str__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self.settings)
        lines = [f"NVFP4 layers ({settings}): {len(self.nvfp4_layers)} NVFP4, {len(self.kept_layers)} bf16"]
        by_reason: dict[str, list[str]] = defaultdict(list)
        for name, c in self.layers:
            if not c.nvfp4:
                by_reason[c.reason].append(name)
        for reason, names in by_reason.items():
            shown = ", ".join(names) if len(names) <= 3 else f"{names[0]}, ..., {names[-1]}"
            lines.append(f"  bf16, {reason}: {len(names)} ({shown})")
        return "\n".join(lines)


def _settings(config: NVFP4Config) -> tuple[tuple[str, object], ...]:
    return (
        ("nvfp4_recipe", config.nvfp4_recipe),
        ("nvfp4_keep_first_blocks", config.nvfp4_keep_first_blocks),
        ("nvfp4_keep_last_blocks", config.nvfp4_keep_last_blocks),
        ("nvfp4_exclude_patterns", tuple(config.nvfp4_exclude_patterns or ())),
        ("nvfp4_four_over_six", config.nvfp4_four_over_six),
        ("nvfp4_moe_experts", config.nvfp4_moe_experts),
    )


def _num_blocks(model: nn.Module, names: list[str]) -> int:
    n = getattr(getattr(hf_model(model), "config", None), "num_hidden_layers", None)
    if n is None:
        indices = [i for i in map(block_index, names) if i is not None]
        n = max(indices) + 1 if indices else 0
    return n


@dataclass(frozen=True)
class _Layer:
    name: str
    in_features: int
    out_features: int
    kind: str = "linear"
    num_experts: int = 0
    unsupported: str = ""

    @property
    def params(self) -> int:
        return self.in_features * self.out_features * max(self.num_experts, 1)


def _candidate_layers(model: nn.Module) -> list[_Layer]:
    """Every layer the rule decides on: linears, experts projections, non-Linear routers (in module order)."""
    layers = [_Layer(n, base_linear(m).in_features, base_linear(m).out_features)
              for n, m in iter_logical_linears(model)]
    layers += [_Layer(p.name, p.in_features, p.out_features, "experts", p.num_experts, p.unsupported)
               for p in iter_expert_projections(model)]
    layers += [_Layer(n, i, o, "router") for n, i, o in iter_moe_routers(model)]
    order = {name: i for i, (name, _) in enumerate(hf_model(model).named_modules())}
    return sorted(layers, key=lambda layer: order.get(layer.name.rpartition(".")[0] if layer.kind == "experts"
                                                      else layer.name, 0))


def _experts_kept_reason(config: NVFP4Config) -> str:
    if config.nvfp4_moe_experts == "bf16":
        return "nvfp4_moe_experts='bf16'"
    if config.nvfp4_moe_experts == "auto":
        ok, why = sampler_nvfp4_moe_support()
        return "" if ok else f"nvfp4_moe_experts='auto': {why}"
    return ""


def _kept_reason(layer: _Layer, block: int | None, n_blocks: int, config: NVFP4Config) -> str:
    """Why ``layer`` stays in bf16 (rules 1-6 of the module docstring), or "" when it runs in NVFP4."""
    name = layer.name
    leaf = name.rpartition(".")[2]
    if block is None:
        return "outside the decoder blocks"
    if layer.kind == "router" or ROUTER_LEAF.match(leaf):
        return "MoE router/gate"
    if block < config.nvfp4_keep_first_blocks:
        return f"block {block} < nvfp4_keep_first_blocks={config.nvfp4_keep_first_blocks}"
    if block >= n_blocks - config.nvfp4_keep_last_blocks:
        return f"block {block} in the last nvfp4_keep_last_blocks={config.nvfp4_keep_last_blocks}"
    if layer.kind == "experts" and (layer.unsupported or _experts_kept_reason(config)):
        return layer.unsupported or _experts_kept_reason(config)
    recipe_reason = recipe_keeps(config.nvfp4_recipe, name, block, n_blocks)
    if recipe_reason:
        return f"nvfp4_recipe={config.nvfp4_recipe!r}: {recipe_reason}"
    pattern = next((p for p in config.nvfp4_exclude_patterns or () if re.search(p, name)), None)
    if pattern is not None:
        return f"matches nvfp4_exclude_patterns {pattern!r}"
    if layer.in_features % BLOCK_SIZE or layer.out_features % BLOCK_SIZE:
        return f"{layer.in_features}x{layer.out_features} not multiples of {BLOCK_SIZE}"
    return ""


def _vllm_group(layer: _Layer) -> str:
    return layer.name.rpartition(".")[0] if layer.kind == "experts" else fused_group(layer.name)


def select_nvfp4_layers(model: nn.Module, config: NVFP4Config | None = None) -> NVFP4LayerSelection:
    """Apply the layer rule (module docstring) to ``model``'s linears, experts projections and routers; pure,
    stores nothing.

    Args:
        model: a transformers model, a PEFT model around one, or a model already converted by
            ``convert_to_nvfp4_learner`` (its layers keep their Hugging Face names).
        config: the NVFP4 settings (``NVFP4Config`` or a ``TriageGRPOConfig``); ``None`` = the defaults.

    Raises:
        ValueError: ``config`` is invalid (``NVFP4Config.validate_nvfp4``).
    """
    config = config if config is not None else NVFP4Config()
    config.validate_nvfp4()
    layers = _candidate_layers(model)
    n_blocks = _num_blocks(model, [layer.name for layer in layers])
    reasons = {layer.name: _kept_reason(layer, block_index(layer.name), n_blocks, config) for layer in layers}
    misaligned = [n for n, r in reasons.items() if r.endswith(f"not multiples of {BLOCK_SIZE}")]
    if misaligned:
        logger.warning("NVFP4: %d linear layer(s) have dimensions that are not multiples of %d and stay in bf16: %s",
                       len(misaligned), BLOCK_SIZE, ", ".join(misaligned))
    groups: dict[str, list[str]] = defaultdict(list)
    for layer in layers:
        groups[_vllm_group(layer)].append(layer.name)
    for members in groups.values():
        kept = next((m for m in members if reasons[m]), None)
        if kept is not None:
            for m in members:
                reasons[m] = reasons[m] or f"fused by vLLM with {kept.rpartition('.')[2]} ({reasons[kept]})"
    return NVFP4LayerSelection(
        layers=tuple((layer.name, LayerChoice(not reasons[layer.name], reasons[layer.name], layer.kind, layer.params))
                     for layer in layers),
        settings=_settings(config),
    )


def nvfp4_layer_selection(model: nn.Module, config: NVFP4Config | None = None) -> NVFP4LayerSelection:
    """The model's NVFP4 layer selection: computed once (``select_nvfp4_layers``) and stored on the model, so the
    learner conversion, the calibration and the export of the same model all get the same object.

    Args:
        model: as ``select_nvfp4_layers``.
        config: the settings; ``None`` takes the stored selection, or computes one from the defaults.

    Raises:
        ValueError: the model already has a selection computed from other settings (the learner and the sampler
            would quantise different layers): build a fresh model, or pass the same settings.
    """
    root = hf_model(model)
    stored = root.__dict__.get(_ATTRIBUTE)
    if stored is not None:
        if config is not None and _settings(config) != stored.settings:
            raise ValueError(
                f"This model already has an NVFP4 layer selection from {dict(stored.settings)}, not "
                f"{dict(_settings(config))}: the learner and the sampler would quantise different layers. Load a "
                "fresh model for other NVFP4 settings."
            )
        return stored
    selection = select_nvfp4_layers(model, config)
    root.__dict__[_ATTRIBUTE] = selection
    return selection


def resolve_nvfp4_layer_selection(model: nn.Module, selection: NVFP4LayerSelection | None) -> NVFP4LayerSelection:
    """``selection``, or the model's own (``nvfp4_layer_selection(model)``), for functions that take an optional one.

    Raises:
        ValueError: ``selection`` differs from the one stored on the model (the sampler would quantise other layers
            than the learner).
    """
    stored = hf_model(model).__dict__.get(_ATTRIBUTE)
    if selection is None:
        return nvfp4_layer_selection(model)
    if stored is not None and selection != stored:
        raise ValueError(
            "The NVFP4 selection given differs from the one this model was converted with; the sampler would "
            "quantise other layers than the learner. Pass selection=None to use the model's own."
        )
    return selection
