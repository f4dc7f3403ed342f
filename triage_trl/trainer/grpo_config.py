"""``TriageGRPOConfig``: TRL's ``GRPOConfig`` plus the TRIAGE objective and the NVFP4 run settings.

Spec: ``shared/design/triage-objective.md`` (TRIAGE, arXiv 2610.07043, reconstructed from its abstract) and
issue 4. The ``triage_*`` fields and their validation come from :class:`triage_trl.TriageConfig`; this file adds
the precisions of the learner and of the sampler, the NVFP4 layer selection, the calibration size and the
sync-probe bound, and checks the combinations TRL's own fields allow but TRIAGE cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..nvfp4.config import NVFP4Config
from ..sampler.vllm_utils import check_comparable_sampling
from ..triage_config import TriageConfig

# Loss types whose per-token policy-gradient term TRIAGE can weight through TRL's importance-sampling hook, and
# whose aggregation the spec keeps unchanged (spec step 8).
TRIAGE_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
# Sampling settings that change the distribution vLLM samples from (and so its processed log-probs) in ways the
# learner's log-probs (log_softmax(logits / temperature)) do not reproduce.
# Default bound of `triage/sync_probe_gap` (mean |learner - sampler| log-prob over the probe tokens, nats).
SYNC_PROBE_DEFAULT_SAME_PRECISION = 0.1
SYNC_PROBE_DEFAULT_MIXED_PRECISION = 0.5


@dataclass
class TriageGRPOConfig(GRPOConfig, TriageConfig, NVFP4Config):
    r"""
    Configuration of [`TriageGRPOTrainer`]: every [`~trl.GRPOConfig`] field, the `triage_*` fields of
    [`triage_trl.TriageConfig`], the engine precisions and NVFP4 settings of
    [`triage_trl.nvfp4.config.NVFP4Config`], and the settings below.

    Parameters:
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
        """The precision and NVFP4 fields plus the sync-probe bound, defaults resolved (for logs and model cards)."""
        return {**NVFP4Config.nvfp4_settings(self), "sync_probe_max_gap": self.resolved_sync_probe_max_gap}

    def _validate_nvfp4(self) -> None:
        self.validate_nvfp4()
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
