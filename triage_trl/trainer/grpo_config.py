"""``TriageGRPOConfig``: TRL's ``GRPOConfig`` plus the TRIAGE objective and the NVFP4 run settings.

Spec: ``shared/design/triage-objective.md`` (TRIAGE, arXiv 2610.07043, reconstructed from its abstract) and
issue 4. The ``triage_*`` fields and their validation come from :class:`triage_trl.TriageConfig`; this file adds
the precisions of the learner and of the sampler, the NVFP4 layer selection, the calibration size and the
sync-probe bound, and checks the combinations TRL's own fields allow but TRIAGE cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..sampler.vllm_utils import check_comparable_sampling
from ..triage_config import TriageConfig

PRECISIONS = ("bf16", "nvfp4")
# Loss types whose per-token policy-gradient term TRIAGE can weight through TRL's importance-sampling hook, and
# whose aggregation the spec keeps unchanged (spec step 8).
TRIAGE_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
# Sampling settings that change the distribution vLLM samples from (and so its processed log-probs) in ways the
# learner's log-probs (log_softmax(logits / temperature)) do not reproduce.
# Default bound of `triage/sync_probe_gap` (mean |learner - sampler| log-prob over the probe tokens, nats).
SYNC_PROBE_DEFAULT_SAME_PRECISION = 0.1
SYNC_PROBE_DEFAULT_MIXED_PRECISION = 0.5


@dataclass
class TriageGRPOConfig(GRPOConfig, TriageConfig):
    r"""
    Configuration of [`TriageGRPOTrainer`]: every [`~trl.GRPOConfig`] field, the `triage_*` fields of
    [`triage_trl.TriageConfig`], and the NVFP4 settings below.

    Parameters:
        learner_precision (`str`, *optional*, defaults to `"bf16"`):
            `"nvfp4"` swaps the learner's decoder linear layers for NVFP4 W4A4 layers before training.
        sampler_precision (`str`, *optional*, defaults to `"bf16"`):
            `"nvfp4"` serves the policy to the colocated vLLM sampler as a compressed-tensors NVFP4 checkpoint.
        nvfp4_keep_first_blocks (`int`, *optional*, defaults to `0`):
            Number of first decoder blocks kept in bf16 (learner and sampler).
        nvfp4_keep_last_blocks (`int`, *optional*, defaults to `0`):
            Number of last decoder blocks kept in bf16 (learner and sampler).
        nvfp4_exclude_patterns (`list[str]` or `None`, *optional*):
            Regular expressions of module names kept in bf16 (e.g. MoE router gates). `None`: the NVFP4 module's
            defaults.
        nvfp4_learner_scales (`str` or `None`, *optional*):
            Per-tensor scales of the emulated NVFP4 learner layers: `"sampler"` mirrors the NVFP4 sampler's
            checkpoint (power-of-two weight scales shared within vLLM-fused q/k/v and gate/up groups, the sampler's
            static calibrated activation scales, pushed after every sync); `"dynamic"` is torchao's recipe (scales
            from each operand's amax). `None`: `"sampler"` when both run in NVFP4, else `"dynamic"`.
        nvfp4_emulation_dtype (`str`, *optional*, defaults to `"bf16"`):
            GEMM dtype of the emulated NVFP4 learner layers (`"bf16"`, as vLLM's NVFP4 emulation, or `"fp32"`).
        nvfp4_recalibrate_every_sync (`bool`, *optional*, defaults to `False`):
            Recalibrate the sampler's static activation scales at every sync instead of once at start.
        nvfp4_calibration_prompts (`int`, *optional*, defaults to `16`):
            Number of training prompts used to calibrate the NVFP4 sampler's input global scales.
        sync_probe_max_gap (`float` or `None`, *optional*):
            Bound on `triage/sync_probe_gap`, the mean absolute difference (nats) between the learner's and the
            sampler's log-probs of a fixed probe sequence, measured after every weight sync. Above it the trainer
            raises: the sampler is stale or corrupt. `None`: 0.1 when both precisions match, 0.5 when they differ.
        vllm_importance_sampling_correction (`bool` or `None`, *optional*):
            TRL's own vLLM importance-sampling correction. `None` (default) resolves to `False` while TRIAGE is on
            (TRIAGE replaces it) and to TRL's default `True` when `triage_mode="off"`. Asking for `True` with
            `triage_mode="full"` is an error (no token corrected twice); with `triage_mode="diagnose"` it keeps
            TRL's correction in the loss and TRIAGE only measures.
    """

    learner_precision: str = field(
        default="bf16",
        metadata={
            "help": "Learner forward precision: `bf16`, or `nvfp4` (decoder linear layers swapped for NVFP4 W4A4 "
            "layers before training).",
            "choices": list(PRECISIONS),
        },
    )
    sampler_precision: str = field(
        default="bf16",
        metadata={
            "help": "Colocated vLLM sampler precision: `bf16`, or `nvfp4` (served from a compressed-tensors NVFP4 "
            "checkpoint, re-quantised from the learner after every optimizer step).",
            "choices": list(PRECISIONS),
        },
    )
    nvfp4_keep_first_blocks: int = field(
        default=0,
        metadata={"help": "Number of first decoder blocks kept in bf16 in NVFP4 runs; >= 0."},
    )
    nvfp4_keep_last_blocks: int = field(
        default=0,
        metadata={"help": "Number of last decoder blocks kept in bf16 in NVFP4 runs; >= 0."},
    )
    nvfp4_exclude_patterns: list[str] | None = field(
        default=None,
        metadata={
            "help": "Regular expressions of module names kept in bf16 in NVFP4 runs (e.g. MoE router gates). "
            "Unset: the NVFP4 module's defaults."
        },
    )
    nvfp4_learner_scales: str | None = field(
        default=None,
        metadata={
            "help": "Per-tensor scales of the emulated NVFP4 learner layers: `sampler` (the sampler checkpoint's "
            "power-of-two weight scales shared within fused groups and its static calibrated activation scales) or "
            "`dynamic` (torchao's amax recipe). Unset: `sampler` when learner and sampler are both NVFP4, else "
            "`dynamic`.",
            "choices": ["sampler", "dynamic"],
        },
    )
    nvfp4_emulation_dtype: str = field(
        default="bf16",
        metadata={
            "help": "GEMM dtype of the emulated NVFP4 learner layers: `bf16` (what vLLM's NVFP4 emulation does; "
            "exact for the dequantised operands with power-of-two scales) or `fp32`.",
            "choices": ["bf16", "fp32"],
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
        metadata={"help": "Number of training prompts that calibrate the NVFP4 sampler's input global scales; >= 1."},
    )
    sync_probe_max_gap: float | None = field(
        default=None,
        metadata={
            "help": "Bound (nats) on `triage/sync_probe_gap`, the mean |learner - sampler| log-prob of a fixed probe "
            "sequence measured after every weight sync; above it training stops with an error naming a stale or "
            "corrupt sampler. Unset: 0.1 when learner and sampler precisions match, 0.5 when they differ."
        },
    )
    # Overrides TRL's field (default True) with a `None` sentinel, so that an explicit request can be told apart
    # from the default and TRIAGE can turn the correction off (spec step 8).
    vllm_importance_sampling_correction: bool | None = field(
        default=None,
        metadata={
            "help": "TRL's vLLM importance-sampling correction. Unset: off while TRIAGE is on (TRIAGE replaces it), "
            "TRL's default (on) when `triage_mode=off`. `true` with `triage_mode=full` is an error (no token is "
            "corrected twice); with `triage_mode=diagnose` TRL's correction stays in the loss and TRIAGE only measures."
        },
    )

    def __post_init__(self):
        # Resolve TRL's correction before GRPOConfig validates its modes and clips. After this, True with TRIAGE on
        # means: diagnose mode, TRL's correction explicitly requested.
        if self.vllm_importance_sampling_correction is None:
            self.vllm_importance_sampling_correction = self.triage_mode == "off"
        elif self.vllm_importance_sampling_correction and self.triage_mode == "full":
            raise ValueError(
                "vllm_importance_sampling_correction=True with triage_mode='full' would correct every token twice: "
                "TRIAGE's bounded repair replaces TRL's importance-sampling correction. Unset "
                "vllm_importance_sampling_correction (or set it to False), or use triage_mode='diagnose' to keep "
                "TRL's correction and only measure the mismatch."
            )
        super().__post_init__()
        self.validate_triage()
        self._validate_nvfp4()
        if self.triage_mode != "off":
            self._validate_triage_with_grpo()

    @property
    def resolved_sync_probe_max_gap(self) -> float:
        """The bound on `triage/sync_probe_gap` (nats) this run uses."""
        if self.sync_probe_max_gap is not None:
            return float(self.sync_probe_max_gap)
        if self.learner_precision == self.sampler_precision:
            return SYNC_PROBE_DEFAULT_SAME_PRECISION
        return SYNC_PROBE_DEFAULT_MIXED_PRECISION

    def nvfp4_settings(self) -> dict:
        """The precision and NVFP4 fields as a plain dict (for logs and model cards)."""
        names = (
            "learner_precision",
            "sampler_precision",
            "nvfp4_keep_first_blocks",
            "nvfp4_keep_last_blocks",
            "nvfp4_exclude_patterns",
            "nvfp4_learner_scales",
            "nvfp4_emulation_dtype",
            "nvfp4_calibration_prompts",
            "nvfp4_recalibrate_every_sync",
        )
        settings = {name: getattr(self, name) for name in names}
        settings["sync_probe_max_gap"] = self.resolved_sync_probe_max_gap
        return settings

    def _validate_nvfp4(self) -> None:
        for name in ("learner_precision", "sampler_precision"):
            if getattr(self, name) not in PRECISIONS:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: it must be 'bf16' or 'nvfp4'.")
        for name in ("nvfp4_keep_first_blocks", "nvfp4_keep_last_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} is out of range: it must be an integer >= 0.")
        if self.nvfp4_learner_scales is None:
            both = self.learner_precision == "nvfp4" and self.sampler_precision == "nvfp4"
            self.nvfp4_learner_scales = "sampler" if both else "dynamic"
        if self.nvfp4_learner_scales not in ("sampler", "dynamic"):
            raise ValueError(
                f"nvfp4_learner_scales={self.nvfp4_learner_scales!r} is invalid: it must be 'sampler' or 'dynamic'."
            )
        if self.nvfp4_learner_scales == "sampler" and self.sampler_precision != "nvfp4":
            raise ValueError(
                "nvfp4_learner_scales='sampler' mirrors the NVFP4 sampler's scales, but sampler_precision="
                f"{self.sampler_precision!r}: set sampler_precision='nvfp4', or nvfp4_learner_scales='dynamic'."
            )
        if self.nvfp4_emulation_dtype not in ("bf16", "fp32"):
            raise ValueError(
                f"nvfp4_emulation_dtype={self.nvfp4_emulation_dtype!r} is invalid: it must be 'bf16' or 'fp32'."
            )
        value = self.nvfp4_calibration_prompts
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"nvfp4_calibration_prompts={value!r} is out of range: it must be an integer >= 1.")
        if self.sync_probe_max_gap is not None and not self.sync_probe_max_gap > 0:
            raise ValueError(
                f"sync_probe_max_gap={self.sync_probe_max_gap!r} is out of range: it must be > 0 (nats), or unset "
                "for the precision-dependent default."
            )
        if self.sampler_precision == "nvfp4":
            if not self.use_vllm:
                raise ValueError(
                    "sampler_precision='nvfp4' needs the vLLM sampler: set use_vllm=True (vllm_mode='colocate')."
                )
            if self.vllm_mode != "colocate":
                raise ValueError(
                    f"sampler_precision='nvfp4' needs vllm_mode='colocate' (got {self.vllm_mode!r}): the NVFP4 "
                    "checkpoint and its in-place reloads are made in the trainer's process."
                )

    def _validate_triage_with_grpo(self) -> None:
        if self.loss_type not in TRIAGE_LOSS_TYPES:
            raise NotImplementedError(
                f"TRIAGE (triage_mode={self.triage_mode!r}) supports loss_type in {', '.join(TRIAGE_LOSS_TYPES)}; got "
                f"loss_type={self.loss_type!r}. Pick one of those, or set triage_mode='off'."
            )
        # One rule for the config and the sampler: TRIAGE compares vLLM's processed log-probs with the
        # learner's log_softmax(logits / temperature), so only plain temperature sampling is comparable.
        check_comparable_sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            generation_kwargs=self.generation_kwargs,
            structured_outputs_regex=self.vllm_structured_outputs_regex,
        )
