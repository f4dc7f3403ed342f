"""``TriageGRPOConfig``: TRL's ``GRPOConfig`` plus the TRIAGE objective and the NVFP4 run settings.

The ``triage_*`` fields come from :class:`triage_trl.TriageConfig` (``docs/objective.md``), the engine precisions and
NVFP4 fields from :class:`triage_trl.nvfp4.config.NVFP4Config` (``docs/nvfp4.md``). This file adds the sync-probe
bound, resolves the TRL fields whose defaults depend on TRIAGE (``use_vllm``, ``vllm_importance_sampling_correction``),
and refuses, at construction and before any model loads, the combinations TRL's fields allow but TRIAGE cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..nvfp4.config import NVFP4Config
from ..nvfp4.native import check_native_padding
from ..objective.config import TriageConfig
from .distributed import check_launch, check_process_count
from .sampling_rules import check_comparable_sampling, check_generation_kwargs

# Loss types whose per-token policy-gradient term TRIAGE can weight through TRL's importance-sampling hook, and
# whose aggregation TRIAGE keeps unchanged (docs/objective.md, "Loss").
TRIAGE_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


@dataclass
class TriageGRPOConfig(GRPOConfig, TriageConfig, NVFP4Config):
    r"""
    Configuration of [`TriageGRPOTrainer`]: every [`~trl.GRPOConfig`] field, the `triage_*` fields of
    [`triage_trl.TriageConfig`], the engine precisions and NVFP4 settings of
    [`triage_trl.nvfp4.config.NVFP4Config`], and the settings below.

    Parameters:
        sampler_checkpoint_dir (`str` or `None`, *optional*):
            Node-local folder the vLLM sampler starts from (no weights: config, tokenizer, NVFP4 quantisation
            config). `None`: `<output_dir>/_sampler_checkpoint` (not pushed to the Hub), with a `node<i>` subfolder per node on several
            nodes.
        sync_probe_max_gap (`float` or `None`, *optional*):
            Bound on `triage/sync_probe_gap`, the mean absolute difference (nats) between the learner's and the
            sampler's log-probs of a fixed probe sequence, measured after the weight syncs `sync_probe_every` picks. Above it, the trainer
            raises at the first sync (the engines compute different models) or when the sampler did not follow the
            learner's move since the previous probe (stale or partial sync), and warns otherwise (precision drift).
            `None`: from what the engines compute (`sync_probe.expected_probe_gap`: 2.0 with NVFP4 activations
            quantised on either side (W4A4: SmolLM2-135M measures 0.5-1.2), 0.5 with weight-only NVFP4 on one side
            only, 0.02 with both in float32, else 0.1).
        sync_probe_every (`int`, *optional*, defaults to `1`):
            Run the sync probe after the first weight sync and then after every `sync_probe_every`-th (the syncs
            before held-out evaluations, `sync_sampler()`, count too). A sampler that stays stale, partial or
            corrupt is caught within that many syncs; one bad sync that the next sync repairs may pass unseen
            between two probes. Each probe is a learner forward and a sampler scoring call on the probe sequence
            (SmolLM2-135M on a 2-core AVX512-BF16 EPYC: 0.25-0.34 s, about 4% of a 7 s demo step, as much as the sync
            itself); it draws no random number, so the schedule changes no rollout. The training batch's learner-sampler
            gap (`triage/gap_*`, `triage/k3_kl`) is logged at every step either way.
        use_vllm (`bool` or `None`, *optional*):
            TRL's switch for the vLLM sampler. `None` (default): on while TRIAGE is on (its sampler log-probs come
            from vLLM), TRL's default (off) when `triage_mode="off"`.
        vllm_importance_sampling_correction (`bool` or `None`, *optional*):
            Whether TRL's own importance-sampling ratio multiplies the loss. `None` (default) resolves to `False`
            while TRIAGE is on (TRIAGE's weights replace it) and to TRL's default `True` when `triage_mode="off"`.
            `True` with `triage_mode="full"` is an error (no token corrected twice); with `"diagnose"` TRL's ratio
            stays in the loss and TRIAGE only measures. TRIAGE's weights reach the loss through the same TRL hook:
            see :attr:`uses_trl_is_hook`.

    Raises:
        ValueError: an invalid field or combination (the message names the field and the remedy).
        NotImplementedError: TRIAGE with a `loss_type` it cannot weight; a launch the trainer cannot run
            correctly (``triage_trl.trainer.distributed.check_launch``: FSDP/DeepSpeed on CPU, FSDP1, DeepSpeed
            with the NVFP4 learner, ...).
        RuntimeError: several processes launched but accelerate sees one in each (``use_cpu`` off on CPU).
    """

    sync_probe_max_gap: float | None = field(
        default=None,
        metadata={
            "help": "Bound (nats) on `triage/sync_probe_gap`, the mean |learner - sampler| log-prob of a fixed probe "
            "sequence measured after the syncs `sync_probe_every` picks; above it training stops at the first sync or when the sampler "
            "did not follow the learner since the previous probe (stale, partial), and warns otherwise (precision "
            "drift). Unset: from the engines' precisions and dtypes (2.0 with W4A4 NVFP4 on either side, 0.5 with "
            "weight-only NVFP4 on one side only, 0.02 with both in float32, else 0.1)."
        },
    )
    sync_probe_every: int = field(
        default=1,
        metadata={
            "help": "Run the sync probe after the first weight sync and then after every N-th (evaluation syncs count; a "
            "sampler that stays stale, partial or corrupt is caught within N syncs, one bad sync repaired by the next "
            "may pass unseen). Each probe is one learner forward and one sampler scoring call "
            "on the probe sequence; the training batch's learner-sampler gap is logged every step either way."
        },
    )
    sampler_checkpoint_dir: str | None = field(
        default=None,
        metadata={
            "help": "Node-local folder the vLLM sampler starts from (config, tokenizer and NVFP4 quantisation config, "
            "no weights; written by the local main process of each node). Unset: `<output_dir>/_sampler_checkpoint` (not pushed to the Hub); "
            "a run over several nodes adds a `node<i>` subfolder per node."
        },
    )
    triage_fuse_rollout_logps: bool = field(
        default=True,
        metadata={
            "help": "Skip TRL's rollout-time learner forward when TRIAGE's weights replace TRL's ratio and every "
            "optimizer step trains on completions of its own weights (`gradient_accumulation_steps` a multiple of "
            "`steps_per_generation * num_iterations`): the learner log-probs TRIAGE compares with the sampler's are "
            "then the loss forward's own, detached (the same weights and micro-batch: one forward fewer per step). "
            "`false`: TRL's separate forward at generation (the batch then carries `old_per_token_logps`)."
        },
    )
    triage_shared_prompt_forward: bool | None = field(
        default=None,
        metadata={
            "help": "Score each prompt once per group in the learner's forwards (loss, reference, rollout-time): the "
            "rows that share a prompt are packed into one sequence whose completions see the prompt and themselves "
            "only (triage_trl/trainer/shared_prompt.py); the same log-probs as TRL's rows up to float summation "
            "order, ~3x fewer learner tokens at the demo's shape. Unset: on wherever supported (Llama, Qwen3, "
            "Qwen3-MoE decoders with sdpa or eager attention and no windowed layers; batches with images or an MoE "
            "load-balancing loss use TRL's rows); `true`: an error at construction where unsupported; `false`: "
            "TRL's rows always. Every launch (one process, DDP, FSDP2, ZeRO) makes the same single model call."
        },
    )
    # Overrides TRL's field (default False): TRIAGE needs the sampler's log-probs, so TRL's quickstart call works.
    use_vllm: bool | None = field(
        default=None,
        metadata={
            "help": "Generate with vLLM (colocated by default). Unset: on while TRIAGE is on (its sampler log-probs "
            "come from vLLM), off when `triage_mode=off` (TRL's default)."
        },
    )
    # Overrides TRL's field (default True) with a `None` sentinel, so that an explicit request can be told apart
    # from the default and TRIAGE can replace the correction (docs/objective.md, "Loss").
    vllm_importance_sampling_correction: bool | None = field(
        default=None,
        metadata={
            "help": "Whether TRL's own vLLM importance-sampling ratio multiplies the loss. Unset: off while TRIAGE is "
            "on (TRIAGE's weights replace it), TRL's default (on) when `triage_mode=off`. `true` with "
            "`triage_mode=full` is an error (no token is corrected twice); with `triage_mode=diagnose` TRL's ratio "
            "stays in the loss and TRIAGE only measures."
        },
    )

    def __post_init__(self):
        # TRL validates use_vllm and the correction's modes in its own __post_init__: resolve them first.
        if self.use_vllm is None:
            self.use_vllm = self.triage_mode != "off"
        if self.vllm_importance_sampling_correction is None:
            self.vllm_importance_sampling_correction = self.triage_mode == "off"
        elif self.vllm_importance_sampling_correction and self.triage_mode == "full":
            raise ValueError(
                "vllm_importance_sampling_correction=True with triage_mode='full' would correct every token twice: "
                "TRIAGE's weights replace TRL's importance-sampling ratio. Unset vllm_importance_sampling_correction "
                "(or set it to False), or use triage_mode='diagnose' to keep TRL's ratio and only measure."
            )
        check_launch(self)  # before TRL's and transformers' checks, which need DeepSpeed installed for a ZeRO launch
        # Our own fields first (checks of their values alone): a bad one is named even where transformers' checks
        # of the device (bf16 without a GPU, ...) would stop first.
        self.validate_triage()
        self.validate_nvfp4()
        super().__post_init__()
        self._validate_run()

    @property
    def uses_trl_is_hook(self) -> bool:
        """Whether TRL's importance-sampling hook is on in the trainer: TRL then computes the rollout-time learner
        log-probs and multiplies the per-token loss by ``inputs["importance_sampling_ratio"]``. True whenever TRIAGE
        is on (the trainer puts TRIAGE's weights under that key, replacing TRL's own ratio unless
        ``vllm_importance_sampling_correction`` keeps it in diagnose mode) or TRL's correction is on."""
        return self.use_vllm and (self.triage_mode != "off" or self.vllm_importance_sampling_correction)

    @property
    def triage_replaces_trl_ratio(self) -> bool:
        """Whether TRIAGE's weights take the place of TRL's importance-sampling ratio in the loss."""
        return self.triage_mode != "off" and not self.vllm_importance_sampling_correction

    @property
    def fuses_rollout_logps(self) -> bool:
        """Whether the trainer skips TRL's rollout-time learner forward (:attr:`triage_fuse_rollout_logps`): TRIAGE's
        weights replace TRL's ratio and the batches are on-policy (TRL's own test for needing old log-probs:
        ``gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0``)."""
        generate_every = (self.steps_per_generation or self.gradient_accumulation_steps) * self.num_iterations
        return (self.triage_fuse_rollout_logps and self.use_vllm and self.triage_replaces_trl_ratio
                and self.gradient_accumulation_steps % generate_every == 0)

    @property
    def resolved_sync_probe_max_gap(self) -> float:
        """The bound on `triage/sync_probe_gap` (nats) from the precisions alone (the trainer's
        ``sync_probe_bound()`` also knows the engines' dtypes: 0.02 when both compute float32)."""
        if self.sync_probe_max_gap is not None:
            return float(self.sync_probe_max_gap)
        from .sync_probe import expected_probe_gap

        # the dtypes are unknown before the engines start: "unknown" never matches the float32 case
        return expected_probe_gap(self.learner_precision, self.sampler_precision, "unknown", "unknown",
                                  self.quantizes_activations)[0]

    def nvfp4_settings(self) -> dict:
        """The precision and NVFP4 fields plus the sync-probe bound, defaults resolved (for logs and model cards)."""
        return {**NVFP4Config.nvfp4_settings(self), "sync_probe_max_gap": self.resolved_sync_probe_max_gap}

    def _validate_run(self) -> None:
        if self.sync_probe_max_gap is not None and not self.sync_probe_max_gap > 0:
            raise ValueError(
                f"sync_probe_max_gap={self.sync_probe_max_gap!r} is out of range: it must be > 0 (nats), or unset "
                "for the precision-dependent default."
            )
        if isinstance(self.sync_probe_every, bool) or not isinstance(self.sync_probe_every, int) \
                or self.sync_probe_every < 1:
            raise ValueError(
                f"sync_probe_every={self.sync_probe_every!r} is out of range: give a whole number >= 1 (1 probes "
                "after every weight sync, N after the first and every N-th)."
            )
        if self.sampler_precision == "nvfp4" and not self.use_vllm:
            raise ValueError("sampler_precision='nvfp4' needs the vLLM sampler: set use_vllm=True.")
        if self.use_vllm and self.vllm_mode != "colocate" and (self.triage_mode != "off" or self.uses_nvfp4):
            raise NotImplementedError(
                f"vllm_mode={self.vllm_mode!r} with triage_mode={self.triage_mode!r}, learner_precision="
                f"{self.learner_precision!r}, sampler_precision={self.sampler_precision!r}: the sync probe and the "
                "NVFP4 export need the engine in the trainer's process. Run the same command with "
                "`--vllm_mode colocate` (no `trl vllm-serve`; every training process starts its own engine, "
                "`--vllm_gpu_memory_utilization` sets its share of the GPU), or keep the server with "
                "triage_mode='off' and bf16 precisions (plain TRL GRPO). See docs/scale.md."
            )
        if self.triage_mode != "off":
            if not self.use_vllm:
                raise ValueError(
                    f"triage_mode={self.triage_mode!r} needs the sampler's log-probs, which only the vLLM sampler "
                    "returns: set use_vllm=True, or triage_mode='off'."
                )
            if self.loss_type not in TRIAGE_LOSS_TYPES:
                raise NotImplementedError(
                    f"TRIAGE (triage_mode={self.triage_mode!r}) supports loss_type in {', '.join(TRIAGE_LOSS_TYPES)}; "
                    f"got loss_type={self.loss_type!r}. Pick one of those, or set triage_mode='off'."
                )
        check_native_padding(self)
        check_process_count(self)
        if self.use_vllm:
            check_generation_kwargs(self.generation_kwargs)
            if self.uses_trl_is_hook:
                self._check_comparable_sampling()

    def _check_comparable_sampling(self) -> None:
        reasons = []
        if self.triage_mode != "off":
            reasons.append(f"TRIAGE (triage_mode={self.triage_mode!r})")
        if self.vllm_importance_sampling_correction:
            reasons.append("TRL's vLLM importance-sampling correction")
        check_comparable_sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            generation_kwargs=self.generation_kwargs,
            structured_outputs_regex=self.vllm_structured_outputs_regex,
            reason=" and ".join(reasons),
        )
