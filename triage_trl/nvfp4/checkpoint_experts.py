"""MoE experts in the sampler's checkpoint: transformers 5's 3-D expert weights written per expert, the way
transformers saves them and vLLM 0.31's Qwen3-MoE loader reads them.

Per experts module ``<x>`` (``mlp.experts``) and expert ``e``, the projections ``<x>.<e>.gate_proj``,
``<x>.<e>.up_proj`` (rows ``[:I]`` and ``[I:]`` of ``gate_up_proj[e]``) and ``<x>.<e>.down_proj``:

* bf16: ``<p>.weight``;
* NVFP4 (compressed-tensors ``nvfp4-pack-quantized``, what ``CompressedTensorsW4A4Nvfp4MoEMethod`` stacks into
  ``w13_weight_packed`` [E, 2I, H/2], ``w13_weight_scale``, ``w13_weight_global_scale`` [E, 2],
  ``w13_input_global_scale`` [E, 2] and their ``w2_`` counterparts): ``<p>.weight_packed``, ``<p>.weight_scale``,
  ``<p>.weight_global_scale`` [1] and ``<p>.input_global_scale`` [1]. Gate and up of one expert share one weight
  global scale (vLLM keeps only the gate's, ``w13_weight_global_scale[:, 0]``); every expert of one module gets
  the module's one activation scale (the learner's ``NVFP4EmulatedExperts.input_global_scales``).

Scales and codes follow ``triage_trl.nvfp4.checkpoint_tensors`` (power-of-two global scales, torchao's block quantisation).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .experts import CHECKPOINT_PROJECTIONS
from .numerics import abs_max, check_finite, global_scale_from_amax
from .quantize import nvfp4_quantize_packed

__all__ = ["expert_checkpoint_tensor_names", "iter_expert_checkpoint_tensors"]

NVFP4_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")


def expert_checkpoint_tensor_names(projection: str, num_experts: int, nvfp4: bool) -> list[str]:
    """The checkpoint tensor names :func:`iter_expert_checkpoint_tensors` yields for ``projection``
    (``<experts>.gate_up_proj`` or ``<experts>.down_proj``), in order."""
    experts, _, proj = projection.rpartition(".")
    suffixes = NVFP4_SUFFIXES if nvfp4 else ("weight",)
    return [f"{experts}.{e}.{leaf}.{s}" for e in range(num_experts) for leaf in CHECKPOINT_PROJECTIONS[proj]
            for s in suffixes]


def _split(projection: str, w: torch.Tensor) -> list[torch.Tensor]:
    return list(w.chunk(2, dim=0)) if projection.endswith("gate_up_proj") else [w]


@torch.no_grad()
def iter_expert_checkpoint_tensors(
    projection: str,
    weight: torch.Tensor,
    *,
    nvfp4: bool,
    input_global_scale: torch.Tensor | None = None,
    four_over_six: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint ``(name, tensor)`` pairs of one experts projection, expert by expert.

    Args:
        projection: ``<experts>.gate_up_proj`` or ``<experts>.down_proj`` (Hugging Face names).
        weight: its master weight, [E, 2I, H] or [E, H, I].
        nvfp4: write NVFP4 (else the bf16 ``weight`` slices, as stored).
        input_global_scale: the module's activation divisor for this projection (0-dim); required for NVFP4.
        four_over_six: the selection's block-scale rule.

    Yields:
        The names of :func:`expert_checkpoint_tensor_names`; NVFP4 ``weight_packed`` uint8 [out, in/2],
        ``weight_scale`` fp8 e4m3 [out, in/16], global scales float32 [1].

    Raises:
        KeyError: NVFP4 without an input global scale. ValueError: an expert's weight holds NaN or inf.
    """
    experts, _, proj = projection.rpartition(".")
    leaves = CHECKPOINT_PROJECTIONS[proj]
    if nvfp4 and input_global_scale is None:
        raise KeyError(f"No input global scale for {projection}: run calibrate_input_global_scales first.")
    for e in range(weight.shape[0]):
        w = weight[e]
        if not nvfp4:
            for leaf, part in zip(leaves, _split(projection, w)):
                yield f"{experts}.{e}.{leaf}.weight", part
            continue
        amax = abs_max(w).cpu()
        check_finite(amax, f"The weight of expert {e} of {projection}")
        global_scale = global_scale_from_amax(amax)  # one per expert, shared by gate and up
        codes, scales = nvfp4_quantize_packed(w, (1.0 / global_scale).to(w.device), four_over_six=four_over_six)
        for leaf, c, s in zip(leaves, _split(projection, codes), _split(projection, scales)):
            p = f"{experts}.{e}.{leaf}"
            yield f"{p}.weight_packed", c
            yield f"{p}.weight_scale", s
            yield f"{p}.weight_global_scale", global_scale.reshape(1)
            yield f"{p}.input_global_scale", input_global_scale.detach().float().reshape(1).cpu()
