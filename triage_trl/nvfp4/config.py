"""``NVFP4Config``: the precision of each engine and the NVFP4 settings shared by the learner and the sampler.

No TRL import: ``TriageGRPOConfig`` inherits these fields next to TRL's ``GRPOConfig`` and the ``triage_*`` fields.
The learner conversion, the sampler's checkpoint export and the model card all read the same fields, so the two
engines cannot be configured apart. What each setting means numerically is in ``docs/nvfp4.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..runtime.validators import check_choice, check_integer_at_least
from .recipes import RECIPES, Recipe

Precision = Literal["bf16", "nvfp4"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
LearnerScales = Literal["sampler", "dynamic"]
EmulationDtype = Literal["auto", "bf16", "fp32"]
LearnerKernel = Literal["auto", "native", "emulated"]
SamplerKernel = Literal["auto", "w4a4", "w4a4_emulation", "weight_only"]
MoEExperts = Literal["auto", "nvfp4", "bf16"]


@dataclass
class NVFP4Config:
    """Engine precisions and NVFP4 settings (learner and sampler). Validated by :meth:`validate_nvfp4`.

    Raises:
        ValueError: a field is outside its allowed values; the message names the field, the value and the remedy.
    """

    learner_precision: Precision = field(
        default="bf16",
        metadata={
            "help": "Learner forward precision: `bf16`, or `nvfp4` (decoder linear layers swapped for NVFP4 W4A4 "
            "layers before training)."
        },
    )
    sampler_precision: Precision = field(
        default="bf16",
        metadata={
            "help": "Colocated vLLM sampler precision: `bf16`, or `nvfp4` (served from a compressed-tensors NVFP4 "
            "checkpoint, re-quantised from the learner after every optimizer step)."
        },
    )
    nvfp4_recipe: Recipe = field(
        default="all",
        metadata={
            "help": "Which decoder linear layers stay in bf16 in NVFP4 runs (learner and sampler), as a named preset: "
            "`all` (every decoder linear in NVFP4), `no_qkv` (attention q/k/v in bf16), `paper` (what published NVFP4 "
            "RL keeps in bf16: all of attention, the first 4 and the last 15 percent of the blocks; the MLP of the "
            "others in NVFP4). The keep/exclude settings below apply on top. See docs/nvfp4.md."
        },
    )
    nvfp4_keep_first_blocks: int = field(
        default=0,
        metadata={"help": "Number of first decoder blocks kept in bf16 in NVFP4 runs (learner and sampler); >= 0."},
    )
    nvfp4_keep_last_blocks: int = field(
        default=0,
        metadata={"help": "Number of last decoder blocks kept in bf16 in NVFP4 runs (learner and sampler); >= 0."},
    )
    nvfp4_exclude_patterns: list[str] | None = field(
        default=None,
        metadata={
            "help": "Regular expressions (re.search on Hugging Face module names) of linear layers kept in bf16 in "
            "NVFP4 runs, learner and sampler alike. Unset: none beyond the layers never quantised (embeddings, "
            "lm_head, MoE routers)."
        },
    )
    nvfp4_moe_experts: MoEExperts = field(
        default="auto",
        metadata={
            "help": "Precision of MoE expert weights in NVFP4 runs (learner and sampler alike): `nvfp4`, `bf16`, or "
            "`auto` (NVFP4 where the sampler's vLLM has an NVFP4 MoE kernel: CUDA, ROCm, XPU; bf16 on its CPU build, "
            "which has none). The other layer rules apply on top. See docs/nvfp4.md."
        },
    )
    nvfp4_learner_scales: LearnerScales | None = field(
        default=None,
        metadata={
            "help": "Per-tensor scales of the emulated NVFP4 learner layers: `sampler` (the sampler checkpoint's "
            "power-of-two weight scales shared within fused groups and its static calibrated activation scales) or "
            "`dynamic` (torchao's amax recipe). Unset: `sampler` when learner and sampler are both NVFP4, else "
            "`dynamic`."
        },
    )
    nvfp4_emulation_dtype: EmulationDtype = field(
        default="auto",
        metadata={
            "help": "Output dtype of the emulated NVFP4 learner layers' GEMMs: `bf16` (products rounded to bf16, as "
            "vLLM's bf16 engine does), `fp32`, or `auto`: what the sampler engine computes in on this machine (bf16, "
            "or fp32 on CPUs without native bf16 GEMMs, where the engine runs in fp32)."
        },
    )
    nvfp4_four_over_six: bool = field(
        default=False,
        metadata={
            "help": "'4 over 6' weight block scales (learner and sampler alike): per 16-element block, map the block "
            "maximum to 4 instead of 6 where that quantises the block with less squared error. Same checkpoint "
            "format (vLLM decodes it unchanged); the emulated learner only (torchao's native kernels cannot). See "
            "docs/nvfp4.md for what it gains."
        },
    )
    nvfp4_learner_kernel: LearnerKernel = field(
        default="auto",
        metadata={
            "help": "How the NVFP4 learner layers run: `native` (torchao's NVFP4 training kernels, sm100+ GPUs: "
            "dynamic scales, 2-D 16x16 weight blocks, NVFP4 backward; needs pad_to_multiple_of=128), `emulated` "
            "(fake quantisation, any device, the sampler's recipe) or `auto` (native where the GPU and the recipe "
            "allow it: dynamic learner scales, no 4 over 6, activations quantised; else emulated, logged)."
        },
    )
    nvfp4_sampler_kernel: SamplerKernel = field(
        default="auto",
        metadata={
            "help": "Which vLLM linear kernels the NVFP4 sampler runs, and so the recipe both engines run: `w4a4` "
            "(vLLM's own W4A4 kernels: CUTLASS/FlashInfer on sm100+, the project's CPU kernel on CPU; the start "
            "fails if vLLM picks a weight-only kernel), `w4a4_emulation` (vLLM's W4A4 emulation, any GPU, slower), "
            "`weight_only` (vLLM's weight-only NVFP4 kernel, Marlin, and the learner's activations left unquantised "
            "too: both engines W4A16; GPU only) or `auto` (`w4a4` on sm100+ and CPU, `w4a4_emulation` on older GPUs "
            "such as Hopper, where vLLM would otherwise fall back to weight-only Marlin). See docs/gpu.md."
        },
    )
    nvfp4_compile: bool = field(
        default=True,
        metadata={
            "help": "Run the emulated NVFP4 learner's fake-quantisers through torch.compile (same bits as eager, about "
            "10x faster). Only a real compile failure switches a kernel to eager, with a warning."
        },
    )
    nvfp4_weight_cache: bool = field(
        default=True,
        metadata={
            "help": "Keep each emulated NVFP4 learner layer's fake-quantised weight between optimizer steps (one extra "
            "weight copy per layer; re-quantised after each step). Turn off under FSDP2, where the copy would be a "
            "full unsharded weight per layer on every rank."
        },
    )
    nvfp4_recalibrate_every_sync: bool = field(
        default=False,
        metadata={
            "help": "Recalibrate the NVFP4 sampler's static activation scales at every weight sync. Default: "
            "calibrate once at start, as a deployed static-scale checkpoint does (a sync that changes no weight then "
            "changes no sampler output)."
        },
    )
    nvfp4_calibration_prompts: int = field(
        default=16,
        metadata={"help": "Number of prompts that calibrate the NVFP4 sampler's input global scales: the first rows of "
                  "the trainer's calibration_dataset (default: the training set); >= 1."},
    )

    def validate_nvfp4(self) -> None:
        """Check the precision and NVFP4 fields (never changes them).

        Raises:
            ValueError: naming the first bad field.
        """
        for name in ("learner_precision", "sampler_precision"):
            check_choice(name, getattr(self, name), PRECISIONS)
        check_choice("nvfp4_recipe", self.nvfp4_recipe, RECIPES)
        for name in ("nvfp4_keep_first_blocks", "nvfp4_keep_last_blocks"):
            check_integer_at_least(name, getattr(self, name), 0)
        check_integer_at_least("nvfp4_calibration_prompts", self.nvfp4_calibration_prompts, 1)
        _regexes("nvfp4_exclude_patterns", self.nvfp4_exclude_patterns)
        if self.nvfp4_learner_scales is not None:
            check_choice("nvfp4_learner_scales", self.nvfp4_learner_scales, get_args(LearnerScales))
        check_choice("nvfp4_emulation_dtype", self.nvfp4_emulation_dtype, get_args(EmulationDtype))
        check_choice("nvfp4_learner_kernel", self.nvfp4_learner_kernel, get_args(LearnerKernel))
        check_choice("nvfp4_sampler_kernel", self.nvfp4_sampler_kernel, get_args(SamplerKernel))
        if self.nvfp4_sampler_kernel == "weight_only" and self.sampler_precision != "nvfp4":
            raise ValueError(
                "nvfp4_sampler_kernel='weight_only' chooses the NVFP4 sampler's kernel (and makes the learner "
                f"weight-only to match), but sampler_precision={self.sampler_precision!r}: set "
                "sampler_precision='nvfp4', or leave nvfp4_sampler_kernel='auto'."
            )
        blockers = self.native_learner_blockers()
        if self.nvfp4_learner_kernel == "native" and blockers:
            raise ValueError(
                f"nvfp4_learner_kernel='native' cannot run this recipe: {'; '.join(blockers)}. Set "
                "nvfp4_learner_kernel='emulated' (or 'auto'), or change the settings named."
            )
        check_choice("nvfp4_moe_experts", self.nvfp4_moe_experts, get_args(MoEExperts))
        if self.nvfp4_learner_scales == "sampler" and self.sampler_precision != "nvfp4":
            raise ValueError(
                "nvfp4_learner_scales='sampler' mirrors the NVFP4 sampler's scales, but sampler_precision="
                f"{self.sampler_precision!r}: set sampler_precision='nvfp4', or nvfp4_learner_scales='dynamic'."
            )

    @property
    def uses_nvfp4(self) -> bool:
        """Whether either engine runs NVFP4."""
        return "nvfp4" in (self.learner_precision, self.sampler_precision)

    @property
    def resolved_nvfp4_learner_scales(self) -> str:
        """``nvfp4_learner_scales``, or its default: ``"sampler"`` when both engines run NVFP4, else ``"dynamic"``."""
        if self.nvfp4_learner_scales is not None:
            return self.nvfp4_learner_scales
        both = self.learner_precision == "nvfp4" and self.sampler_precision == "nvfp4"
        return "sampler" if both else "dynamic"

    def resolved_nvfp4_emulation_dtype(self, device_type: str = "cpu") -> str:
        """``nvfp4_emulation_dtype``, ``auto`` resolved for a learner on ``device_type``: ``"bf16"`` where bf16 GEMMs
        run natively (``triage_trl.runtime.native_bf16_gemm``: CUDA, or CPUs with AVX512-BF16/AMX), else ``"fp32"``
        (the sampler's NVFP4 kernel forms its products in float32 there too, then rounds them to bf16)."""
        if self.nvfp4_emulation_dtype != "auto":
            return self.nvfp4_emulation_dtype
        from ..runtime import native_bf16_gemm

        return "bf16" if native_bf16_gemm(device_type) else "fp32"

    @property
    def quantizes_activations(self) -> bool:
        """Whether the NVFP4 layers quantise their inputs (W4A4), in both engines; ``False`` only for
        ``nvfp4_sampler_kernel="weight_only"`` (W4A16)."""
        return self.nvfp4_sampler_kernel != "weight_only"

    def native_learner_blockers(self) -> list[str]:
        """Why torchao's native NVFP4 training kernels cannot run this recipe (empty: they can). They compute their
        own dynamic scales, quantise every input and use plain block scales."""
        blockers = []
        if self.resolved_nvfp4_learner_scales == "sampler":
            blockers.append("nvfp4_learner_scales='sampler' (the native kernels compute their own dynamic scales; "
                            "set nvfp4_learner_scales='dynamic')")
        if self.nvfp4_four_over_six:
            blockers.append("nvfp4_four_over_six (the native kernels use plain block scales)")
        if not self.quantizes_activations:
            blockers.append("nvfp4_sampler_kernel='weight_only' (the native kernels quantise every input)")
        return blockers

    def nvfp4_settings(self) -> dict:
        """The precision and NVFP4 fields as a plain dict, defaults resolved (for logs and model cards)."""
        settings = {name: getattr(self, name) for name in NVFP4Config.__dataclass_fields__}
        settings["nvfp4_learner_scales"] = self.resolved_nvfp4_learner_scales
        return settings


def _regexes(name, patterns) -> None:
    if patterns is None:
        return
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"{name}={patterns!r} is invalid: give a list of regular expressions (strings).")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as err:
            raise ValueError(f"{name}: {p!r} is not a valid regular expression ({err}).") from None
