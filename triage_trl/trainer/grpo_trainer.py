"""``TriageGRPOTrainer``: TRL's ``GRPOTrainer`` with the TRIAGE objective, an NVFP4-capable learner and a colocated
NVFP4-capable vLLM sampler.

How the objective reaches the loss, without a copy of TRL's loss code: TRL 1.16 multiplies the per-token
policy-gradient loss by ``inputs["importance_sampling_ratio"]`` before its aggregation whenever its importance-sampling
hook is on, and then also computes the rollout-time learner log-probs ``old_per_token_logps``. The hook's switch comes
from one place, :attr:`TriageGRPOConfig.uses_trl_is_hook`; the public ``compute_loss`` puts TRIAGE's detached weights
under that key (replacing TRL's own ratio unless diagnose mode keeps it) and calls TRL's. On-policy, the rollout-time
forward is skipped and TRIAGE takes the loss forward's own detached log-probs
(:attr:`TriageGRPOConfig.fuses_rollout_logps`). TRL's clipping, KL, entropy
terms and metrics are unchanged. Every TRL name this module relies on is listed in ``tests/test_trl_contract.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from typing import Any

import torch
from trl import GRPOTrainer

from ..objective import METRIC_NAMES, triage_weights
from ..objective.zero_signal import zero_reward_spread
from ..runtime.run_folder import refuse_existing_run
from ..runtime import check_learner_dtype, compute_dtype_reason
from ..objective.segments import build_newline_table, segment_ids
from .checkpoints import atomic_checkpoint, remove_partials, resolve_resume
from .distributed import per_rank, sampler_checkpoint_dir
from .grpo_config import TriageGRPOConfig
from .metrics_log import TriageMetricsLog
from .model_card import TRIAGE_PAPER, trainer_model_card
from .reward_checks import check_rewards
from .run_checks import check_run_inputs, check_sampler_peft_config, check_shared_prompt_forward, hold_output_dir
from .shared_prompt import prompt_groups, shared_prompt_logps, unsupported_reason
from .sync_probe import (PROBE_TEMPERATURE, StaleSamplerError, classify_probe, expected_probe_gap, probe_batch,
                         probe_gap, probe_token_ids, untracked_move)
from .trl_contract import check_trl_contract
from .trl_seam import TRLContractError, compact_fused_lm_head_on_cpu, trl_builds_sampler_with

logger = logging.getLogger(__name__)

# TRL's metrics of its own importance-sampling ratio: no token receives that ratio while TRIAGE's weights replace it
# (TRIAGE's weights are logged as triage/weight_*).
_TRL_RATIO_METRICS = (
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
ZERO_SIGNAL_KEY = "triage_zero_signal"  # (B,) bool in the generation batch: the completion's group has no signal


class TriageGRPOTrainer(GRPOTrainer):
    """GRPO with TRIAGE's per-token weights, an NVFP4-capable learner and a colocated NVFP4-capable vLLM sampler.

    Args:
        model: as [`~trl.GRPOTrainer`] (a Hub id or local folder is loaded by TRL, with TRL's rules).
        reward_funcs: as [`~trl.GRPOTrainer`].
        args: a [`TriageGRPOConfig`] (default: one named after the model, TRIAGE full, colocated vLLM sampler;
            ``use_cpu=True`` on a machine without an accelerator, so TRL's quickstart call also runs on CPU).
        calibration_dataset: the prompts (a ``prompt`` column, as ``train_dataset``'s) whose first
            ``args.nvfp4_calibration_prompts`` rows calibrate the NVFP4 sampler's static activation scales
            (``triage_trl.nvfp4.calibration``). Default: ``train_dataset``. Pass one fixed set to give runs that draw
            other training items (e.g. per seed) bit-identical sampler scales. Unused by a bf16 sampler. Works with
            every launch configuration (each rank calibrates on the same rows).
        **kwargs: every other [`~trl.GRPOTrainer`] argument (``train_dataset``, ``peft_config``, ...).

    Before TRL loads the model, the output folder is checked (writable, room for a checkpoint) and its run lock taken,
    and every prompt is checked (``triage_trl.trainer.run_checks``). Checkpoints are written aside and renamed
    (``triage_trl.trainer.checkpoints``); ``train(resume_from_checkpoint=...)`` resumes from the last complete one.

    Raises:
        ValueError: ``calibration_dataset`` has no row or no ``prompt`` column.
        triage_trl.runtime.run_folder.OutputFolderError: a read-only or full ``output_dir``, or one another live run
            holds.
        triage_trl.runtime.preflight.PromptError: an empty, non-text or too long prompt (names the data set and row).
        TypeError: ``args`` is not a ``TriageGRPOConfig``.
        NotImplementedError: TRIAGE with a ``rollout_func`` (TRL scores custom rollouts without the sampler
            log-probs TRIAGE needs on every path).
        TRLContractError: the installed TRL did not build its sampler through the seam triage-trl relies on.
    """

    _tag_names = ["trl", "grpo", "triage", "nvfp4"]
    _name = "TRIAGE-GRPO"
    _paper = TRIAGE_PAPER

    def __init__(self, model, reward_funcs=None, args: TriageGRPOConfig | None = None, *,
                 calibration_dataset=None, **kwargs):
        check_trl_contract()
        args = _triage_args(model, args)
        if calibration_dataset is not None and not _calibration_prompts(calibration_dataset, 1):
            raise ValueError("calibration_dataset has no prompt: give a dataset with a 'prompt' column and at least "
                             "one row, or leave it unset to calibrate on train_dataset.")
        if args.triage_mode != "off" and kwargs.get("rollout_func") is not None:
            raise NotImplementedError(
                "TRIAGE with a rollout_func is not supported: the sampler log-probs and sync probe TRIAGE relies on "
                "come from its own colocated sampler. Drop rollout_func, or set triage_mode='off'."
            )
        if args.use_vllm:
            check_sampler_peft_config(kwargs.get("peft_config"))
        calibration = _calibration_prompts(calibration_dataset, args.nvfp4_calibration_prompts) if (
            calibration_dataset is not None and args.use_vllm and args.sampler_precision == "nvfp4") else None
        self._prior_run = check_run_inputs(
            model, args, train_dataset=kwargs.get("train_dataset"), eval_dataset=kwargs.get("eval_dataset"),
            calibration_prompts=calibration, processing_class=kwargs.get("processing_class"))
        self._run_lock = hold_output_dir(self, args)
        self.triage_mode = args.triage_mode
        self.triage_metrics = TriageMetricsLog()
        self.triage_history: list[dict[str, float]] = []
        # one entry per probe: after the first sync and every args.sync_probe_every-th
        self.sync_probe_gaps: list[float] = []  # mean over ranks (nats)
        self.sync_probe_rank_gaps: list[list[float]] = []  # each rank's own gap (nats)
        self.sync_probe_verdicts: list[str] = []  # "ok" or "drift" (errors raise)
        self.sync_probe_steps: list[int] = []  # the optimizer step of each probed sync
        self._syncs_seen = 0
        self._probe_prev = None  # (learner, sampler) log-probs of the previous probe
        self._pushed_scales = None  # (scales dict, device) the learner last received (a new dict per calibration)
        self._probe_bound = None  # (bound, what) once the engines are known
        self._drift_warned = 0.0
        self.nvfp4_learner_report = None
        # the learner forward's path, resolved once the model is loaded (_resolve_shared_prompt_forward)
        self.shared_prompt_forward, self.shared_prompt_off_reason = False, "not resolved: the model is not loaded yet"
        self._shared_prompt_eager_mask = False
        self.learner_forwards = {"shared_prompt": 0, "rows": 0}  # calls of each path (kernel_report)
        self._synced_step = None
        built: list = []
        if calibration_dataset is None:
            calibration_dataset = kwargs.get("train_dataset")
        try:
            with trl_builds_sampler_with(self._sampler_factory(args, calibration_dataset, built)):
                super().__init__(model, reward_funcs, args, **kwargs)
            if self.use_vllm and (len(built) != 1 or self.vllm_generation is not built[0]):
                raise TRLContractError(
                    "TRL did not build its vLLM sampler through triage-trl's factory, so TRIAGE's export, one-call "
                    "sync and sync probe would not run. triage-trl supports TRL 1.16.x: install trl>=1.16,<1.17."
                )
            self.triage_metrics.accelerator = self.accelerator
            self.vllm_importance_sampling_correction = args.uses_trl_is_hook
            if args.learner_precision == "nvfp4":
                self._convert_learner()
            self._newline_table = None
            if self.triage_mode != "off" and args.triage_segment_mode == "newline":
                vocab = self.model.get_input_embeddings().num_embeddings
                tokenizer = _tokenizer_of(self.processing_class)
                self._newline_table = build_newline_table(tokenizer, vocab_size=max(vocab, len(tokenizer)))
            self._probe_ids = probe_token_ids(_tokenizer_of(self.processing_class)) if self.use_vllm else None
            if self.use_vllm:
                self.vllm_generation.on_sync = self._after_sampler_sync
            self._push_sampler_scales()
            self._resolve_shared_prompt_forward(args)
            check_learner_dtype(self.model, self.accelerator.device.type)
        except BaseException:  # a construction that fails after its sampler started closes it
            for sampler in built:
                sampler.close()
            raise

    # ------------------------------------------------------------------ construction

    def _sampler_factory(self, args: TriageGRPOConfig, calibration_dataset, built: list):
        """The callable TRL instantiates as its vLLM backend: TriageVLLMGeneration bound to this run's settings.
        Each sampler it builds is appended to ``built``, so the trainer can check TRL used it."""
        if not args.use_vllm:
            return None
        from ..sampler.vllm_generation import TriageVLLMGeneration

        make = functools.partial(
            TriageVLLMGeneration,
            sampler_precision=args.sampler_precision,
            calibration_prompts=_calibration_prompts(calibration_dataset, args.nvfp4_calibration_prompts),
            recalibrate_every_sync=args.nvfp4_recalibrate_every_sync,
            sampler_seed=args.seed,
            nvfp4_config=args,
        )

        def factory(model, accelerator, processing_class, **kw):
            checkpoint_dir = sampler_checkpoint_dir(args, accelerator)
            built.append(make(model, accelerator, processing_class, checkpoint_dir=checkpoint_dir, **kw))
            return built[-1]

        return factory

    def _convert_learner(self) -> None:
        """Swap the learner's decoder linears for NVFP4 W4A4 layers, on the device the trainer placed the model on."""
        from ..nvfp4.callbacks import NVFP4WeightCacheCallback
        from ..nvfp4.learner import convert_to_nvfp4_learner, learner_execution_summary

        self.nvfp4_learner_report = convert_to_nvfp4_learner(self.model, self.args)
        self.add_callback(NVFP4WeightCacheCallback())  # re-quantise the cached NVFP4 weights after every step
        logger.info("NVFP4 learner layers: %s", self.nvfp4_learner_report)
        counts = {**self.nvfp4_learner_report.summary(), **learner_execution_summary(self.model)}
        self.triage_metrics.record("train", {k: float(v) for k, v in counts.items()})

    # ------------------------------------------------------------------ sampler sync: scales + probe

    def sync_sampler(self) -> None:
        """Load the learner's current weights into the vLLM sampler (re-quantised for NVFP4); the sampler then runs
        the trainer's scale push and, after the first sync and every ``args.sync_probe_every``-th, the sync probe.
        Call it before using ``self.vllm_generation.llm`` directly (e.g. a held-out evaluation between steps).

        Raises:
            StaleSamplerError: the sampler is stale, partially synced or corrupt (``sync_probe.classify_probe``);
                a gap above the bound while the sampler follows the learner (precision drift) only warns.
        """
        self.vllm_generation.sync_weights()

    def _after_sampler_sync(self) -> None:
        self._push_sampler_scales()
        # The count is the same on every rank, so all of them take part in the probe's collectives or none does.
        if self._syncs_seen % self.args.sync_probe_every == 0:
            self._run_sync_probe()
        self._syncs_seen += 1
        self._synced_step = self.state.global_step

    def _push_sampler_scales(self) -> None:
        """With ``nvfp4_learner_scales="sampler"``: give the learner the sampler's activation scales."""
        if self.nvfp4_learner_report is None or self.args.resolved_nvfp4_learner_scales != "sampler":
            return
        scales = self.vllm_generation.input_global_scales
        if scales is None:  # calibrated at the first sync (sharded learners)
            return
        # The same dict on the same device is already in place (a calibration makes a new dict; the scales are plain
        # attributes, which a later move of the model, e.g. by DeepSpeed, leaves behind): no module walk.
        device = next(self.model.parameters()).device
        if self._pushed_scales is not None and self._pushed_scales[0] is scales and self._pushed_scales[1] == device:
            return
        from ..nvfp4.learner import set_sampler_input_scales

        set_sampler_input_scales(self.model, scales)
        self._pushed_scales = (scales, device)

    @torch.no_grad()
    def _run_sync_probe(self) -> float:
        """Score the probe sequence with the sampler and the learner; log their gap (nats) and judge it
        (``sync_probe.classify_probe``): drift above the bound warns, a stale, partial or corrupt sync raises.

        Both engines score at temperature 1 (:data:`sync_probe.PROBE_TEMPERATURE`), whatever the sampling temperature:
        vLLM's prompt log-probs carry no temperature, and rescaling them needs the whole vocabulary back per position
        (SmolLM2: 49,152 Python floats a token, seconds per sync). The learner side is the model's own forward and a
        log-softmax (TRL's fused log-prob head has the sampling temperature built in)."""
        ids = self._probe_ids
        sampler_logps = torch.as_tensor(self.vllm_generation.score_logps([ids], temperature=PROBE_TEMPERATURE)[0],
                                        dtype=torch.float64)
        # Padded as the training batches are (torchao's native NVFP4 kernels need 128-token multiples).
        input_ids, mask, _ = probe_batch(ids, self._pad_token_id(), self.args.pad_to_multiple_of)
        device = self.accelerator.device
        logits = self.model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                            use_cache=False).logits[0, : len(ids) - 1]
        targets = torch.tensor(ids[1:], device=logits.device)[:, None]
        learner_logps = torch.log_softmax(logits.float() / PROBE_TEMPERATURE, -1).gather(-1, targets)[:, 0]
        learner_logps = learner_logps.detach().double().cpu()
        gap, gap_max = probe_gap(learner_logps, sampler_logps)
        bound, what = self.sync_probe_bound()
        first = self._probe_prev is None
        moved = untracked = 0.0
        if not first:
            moved, untracked = untracked_move(learner_logps, sampler_logps, *self._probe_prev)
        self._probe_prev = (learner_logps, sampler_logps)
        mode = "train" if self.model.training else "eval"
        reduced = self.triage_metrics.record(mode, {
            "triage/sync_probe_gap": gap, "triage/sync_probe_gap_max": gap_max, "triage/sync_probe_bound": bound,
            "triage/sync_probe_untracked": untracked,
        })
        # Every rank's sampler must serve the current weights: judge the worst rank, not the mean over ranks.
        rank_gaps = per_rank(self.accelerator, gap)
        rank_moved, rank_untracked = per_rank(self.accelerator, moved), per_rank(self.accelerator, untracked)
        self.sync_probe_rank_gaps.append(rank_gaps)
        self.sync_probe_gaps.append(reduced["triage/sync_probe_gap"])
        self.sync_probe_steps.append(self.state.global_step)
        worst = max(range(len(rank_gaps)), key=lambda r: rank_gaps[r])
        verdict = classify_probe(
            rank_gaps[worst], bound, step=self.state.global_step, what=what, first=first,
            moved=None if first else rank_moved[worst], untracked=None if first else rank_untracked[worst],
            rank=worst if len(rank_gaps) > 1 else None,
            step0_gap=self.sync_probe_gaps[0] if self.sync_probe_gaps else None,
        )
        if verdict.is_error:
            raise StaleSamplerError(verdict.message)
        self.sync_probe_verdicts.append(verdict.kind)
        if verdict.kind == "drift" and rank_gaps[worst] > 2 * self._drift_warned:  # again each time it doubles
            self._drift_warned = rank_gaps[worst]
            logger.warning(verdict.message)
            warnings.warn(verdict.message, stacklevel=2)
        return reduced["triage/sync_probe_gap"]

    def sync_probe_bound(self) -> tuple[float, str]:
        """``(bound, what)``: the probe gap (nats) above which a sync is judged (``sync_probe.classify_probe``) and
        the engines it follows from: ``args.sync_probe_max_gap`` when set, else
        ``sync_probe.expected_probe_gap`` of the two precisions and the dtypes each engine really computes in (the
        learner's parameters or its bf16/fp16 autocast; the sampler's ``kernel_report["dtype"]``)."""
        if self._probe_bound is None:
            learner_dtype = _learner_compute_dtype(self.model, self.args)
            report = getattr(self.vllm_generation, "kernel_report", None) or {}
            sampler_dtype = str(report.get("dtype", learner_dtype))
            bound, what = expected_probe_gap(self.args.learner_precision, self.args.sampler_precision,
                                             learner_dtype, sampler_dtype, self.args.quantizes_activations)
            if self.args.sync_probe_max_gap is not None:
                bound, what = float(self.args.sync_probe_max_gap), f"{what}, set by sync_probe_max_gap"
            self._probe_bound = (bound, what)
        return self._probe_bound

    def _pad_token_id(self) -> int:
        tokenizer = _tokenizer_of(self.processing_class)
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # ------------------------------------------------------------------ rewards: zero-signal groups

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        num_generations = self.num_generations if self.model.training else self.num_generations_eval
        missing = check_rewards(rewards_per_func, names=getattr(self, "reward_func_names", None),
                                weights=self.reward_weights, num_generations=num_generations,
                                step=self.state.global_step)
        # Already global (gathered rewards): TRL's own metric buffer, no collective.
        self._metrics["train" if self.model.training else "eval"]["triage/reward_missing_frac"].append(missing)
        if self.triage_mode != "off":
            num_generations = self.num_generations if self.model.training else self.num_generations_eval
            self._zero_signal = zero_reward_spread(self._rewards_for_spread(rewards_per_func), num_generations)
        return rewards_per_func

    def _rewards_for_spread(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """The rewards TRL's advantages come from: (N,) weighted sums (NaN where no function scored), or the (N, F)
        per-function rewards when each function is normalised on its own (``normalize_then_sum``)."""
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            return rewards_per_func
        summed = (rewards_per_func * self.reward_weights.to(rewards_per_func)).nansum(dim=1)
        return summed.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))

    def _generate_and_score_completions(self, inputs):
        if self.args.fuses_rollout_logps:
            # TRL skips its rollout-time learner forward (and its ratio); compute_loss takes the loss forward's
            # log-probs instead (TriageGRPOConfig.fuses_rollout_logps).
            self.vllm_importance_sampling_correction = False
            try:
                output = super()._generate_and_score_completions(inputs)
            finally:
                self.vllm_importance_sampling_correction = self.args.uses_trl_is_hook
        else:
            output = super()._generate_and_score_completions(inputs)
        if self.use_vllm and self._synced_step != self.state.global_step:
            raise StaleSamplerError(
                f"The sampler generated this batch at step {self.state.global_step} without a weight sync since step "
                f"{self._synced_step}: it samples a stale policy. TRL's sync before generation did not run; check the "
                "installed TRL version (triage-trl supports 1.16.x) and any override of _generate."
            )
        if self.triage_mode != "off":
            # TRL's rewards (and so the mark) cover every process's completions; keep this process's slice, as TRL
            # does for the advantages.
            local = self._zero_signal.view(self.accelerator.num_processes, -1)[self.accelerator.process_index]
            output[ZERO_SIGNAL_KEY] = local.to(output["advantages"].device)
            # Exact reward equality, unlike TRL's frac_reward_zero_std (isclose(std, 0) misses float32 residues).
            mode = "train" if self.model.training else "eval"
            self.triage_metrics.record(mode, {"triage/zero_signal_frac": self._zero_signal.float().mean().item()})
        return output

    # ------------------------------------------------------------------ loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's ``GRPOTrainer.compute_loss`` with TRIAGE's per-token weights in place of TRL's importance-sampling
        ratio (the public seam of ``docs/trainer.md``).

        TRL's loss multiplies its per-token policy-gradient loss by ``inputs["importance_sampling_ratio"]`` (its vLLM
        importance-sampling correction, ``vllm_importance_sampling_correction``) before its own aggregation. When
        ``triage_replaces_trl_ratio`` (TRIAGE on, TRL's correction off) that entry is replaced by TRIAGE's detached
        (B, T) weights (:func:`triage_trl.objective.triage_weights`; all 1 with ``triage_mode="diagnose"``, which only
        logs the statistics); with ``"off"`` nothing is computed. The zero-signal mark that the generation batch carries
        is removed from ``inputs`` before TRL sees them. Arguments and return value are TRL's; TRL's clipping, KL,
        entropy terms, aggregation and metrics run unchanged.

        The learner log-probs TRIAGE compares with the sampler's are TRL's rollout-time ones
        (``old_per_token_logps``), or, when the batch has none because the trainer skipped that forward
        (``TriageGRPOConfig.fuses_rollout_logps``), the loss forward's own, detached, taken before the loss reads
        the weights.

        Raises:
            ValueError: TRIAGE is on and the batch has no sampler log-probs.
        """
        inputs = dict(inputs)
        zero_signal = inputs.pop(ZERO_SIGNAL_KEY, None)
        if self.triage_mode != "off" and "old_per_token_logps" not in inputs and self.args.fuses_rollout_logps:
            inputs.pop("importance_sampling_ratio", None)  # TRIAGE's weights take its place after the forward
            with self._weights_from_loss_forward(inputs, zero_signal):
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
        if self.triage_mode != "off":
            weights = self._triage_weights(inputs, zero_signal)
            if self.args.triage_replaces_trl_ratio:
                inputs["importance_sampling_ratio"] = weights
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        """TRL's learner log-prob path (arguments and return value are TRL's), with each prompt scored once per
        group where :attr:`shared_prompt_forward` is on and the batch is text only with no MoE load-balancing loss
        (:func:`shared_prompt.shared_prompt_logps`: the same log-probs up to float summation order), and TRL's
        fused LM head scoring only the completion tokens on CPU too (:func:`trl_seam.compact_fused_lm_head_on_cpu`:
        the same log-probs, bit for bit, without the vocabulary projection of every prompt position)."""
        with compact_fused_lm_head_on_cpu():
            if self.shared_prompt_forward and not compute_aux_loss and all(v is None for v in extra.values()):
                groups = prompt_groups(input_ids[:, :-logits_to_keep], attention_mask[:, :-logits_to_keep])
                if len(groups) < input_ids.size(0) and bool(attention_mask[:, -logits_to_keep - 1].all()):
                    logps, entropies = shared_prompt_logps(
                        model, input_ids, attention_mask, logits_to_keep, groups,
                        batch_size=batch_size or input_ids.size(0), compute_entropy=compute_entropy,
                        eager_mask=self._shared_prompt_eager_mask, autocast=self.accelerator.autocast)
                    self.learner_forwards["shared_prompt"] += 1
                    return logps, entropies, None
            self.learner_forwards["rows"] += 1
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **extra)

    def _resolve_shared_prompt_forward(self, args: TriageGRPOConfig) -> None:
        """Set :attr:`shared_prompt_forward` from ``args.triage_shared_prompt_forward`` and the loaded model.

        Raises:
            ValueError: ``triage_shared_prompt_forward=True`` for a model it cannot serve.
        """
        config = self.model.config
        attn = getattr(config, "_attn_implementation", None)
        self._shared_prompt_eager_mask = attn == "eager"
        self.shared_prompt_off_reason = "triage_shared_prompt_forward=False"
        if args.triage_shared_prompt_forward is False:
            return
        if args.triage_shared_prompt_forward:
            check_shared_prompt_forward(config, attn)
        self.shared_prompt_off_reason = unsupported_reason(config, attn)
        self.shared_prompt_forward = self.shared_prompt_off_reason is None
        if not self.shared_prompt_forward:
            logger.info("Learner forward: TRL's rows (no shared prompt): %s.", self.shared_prompt_off_reason)

    @contextlib.contextmanager
    def _weights_from_loss_forward(self, inputs: dict[str, Any], zero_signal: torch.Tensor | None):
        """Inside the block, the first learner forward of TRL's ``_compute_loss`` (its policy log-probs) also puts
        TRIAGE's weights from its detached log-probs under ``inputs["importance_sampling_ratio"]`` (read by TRL after
        that forward) and logs TRL's ``sampling/sampling_logp_difference`` metrics, which the skipped rollout-time
        forward would have logged."""
        forward = self._get_per_token_logps_and_entropies

        def forward_then_weights(*args, **kwargs):
            out = forward(*args, **kwargs)
            if "importance_sampling_ratio" not in inputs:
                learner = out[0].detach()
                inputs["importance_sampling_ratio"] = self._triage_weights(
                    {**inputs, "old_per_token_logps": learner}, zero_signal)
                self._log_sampling_difference(learner, inputs)
            return out

        own = self.__dict__.get("_get_per_token_logps_and_entropies")  # an instance wrapper (a profiler's) stays
        self._get_per_token_logps_and_entropies = forward_then_weights
        try:
            yield
        finally:
            if own is None:
                del self._get_per_token_logps_and_entropies  # the class's method again
            else:
                self._get_per_token_logps_and_entropies = own

    def _log_sampling_difference(self, learner: torch.Tensor, inputs: dict[str, Any]) -> None:
        """TRL's ``sampling/sampling_logp_difference/{mean,max}`` (|learner - sampler| log-prob over valid tokens,
        nats; gathered over processes) for a batch whose learner log-probs came from the loss forward."""
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        delta = torch.abs(learner - inputs["sampling_per_token_logps"])
        delta = delta[mask.bool() & ~torch.isnan(delta)]
        zero = torch.tensor(0.0, device=learner.device)
        mean, high = (delta.mean(), delta.max()) if delta.numel() else (zero, zero)
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["sampling/sampling_logp_difference/mean"].append(self.accelerator.gather(mean).mean().item())
        metrics["sampling/sampling_logp_difference/max"].append(self.accelerator.gather(high).max().item())

    def _triage_weights(self, inputs: dict[str, Any], zero_signal: torch.Tensor | None) -> torch.Tensor:
        """TRIAGE's (B, T) detached weights for this micro-batch; records the triage/ metrics.

        Raises:
            ValueError: the batch has no ``sampling_per_token_logps`` or no ``old_per_token_logps``.
        """
        sampler_logps = inputs.get("sampling_per_token_logps")
        if sampler_logps is None:
            raise ValueError(
                f"triage_mode={self.triage_mode!r} needs the sampler's per-token log-probs, but this batch has no "
                "'sampling_per_token_logps'. Generate with TriageGRPOTrainer's vLLM sampler (use_vllm=True), or set "
                "triage_mode='off'."
            )
        old_logps = inputs.get("old_per_token_logps")
        if old_logps is None:
            raise ValueError(
                "TRIAGE needs the learner's rollout-time log-probs ('old_per_token_logps'), which TRL computes when its "
                "importance-sampling hook is on (TriageGRPOConfig.uses_trl_is_hook): this batch has none."
            )
        completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        seg = segment_ids(
            completion_ids,
            mode=self.args.triage_segment_mode,
            max_tokens=self.args.triage_segment_max_tokens,
            newline_table=self._newline_table,
        )
        result = triage_weights(
            old_logps, sampler_logps, inputs["advantages"], mask, seg, self.args, zero_signal=zero_signal
        )
        mode = "train" if self.model.training else "eval"
        reduced = self.triage_metrics.record(mode, {f"triage/{name}": result.metrics[name] for name in METRIC_NAMES})
        if mode == "train":
            self.triage_history.append(
                {"step": self.state.global_step + 1, **{k.removeprefix("triage/"): v for k, v in reduced.items()}}
            )
        return result.weights

    # ------------------------------------------------------------------ checkpoints

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """TRL's ``train``, resuming from the last *complete* checkpoint (``triage_trl.trainer.checkpoints``:
        ``True``, a run folder or a ``checkpoint-N`` path; incomplete ones are skipped with a warning).

        Raises:
            triage_trl.runtime.run_folder.OutputFolderError: not resuming, into an ``output_dir`` that held a run
                before this trainer was built.
            ValueError: ``resume_from_checkpoint`` set but no complete checkpoint found.
        """
        resume = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        if self._prior_run:
            refuse_existing_run(self.args.output_dir, resume)
        if self.args.should_save:
            remove_partials(self.args.output_dir)
        return super().train(resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval,
                             **kwargs)

    def _save_checkpoint(self, model, trial):
        """TRL's ``_save_checkpoint`` (transformers' plus the model card), written aside and renamed into place
        (``checkpoints.atomic_checkpoint``), so a kill leaves the previous or the new complete checkpoint."""
        with atomic_checkpoint(self, trial):
            super()._save_checkpoint(model, trial)

    # ------------------------------------------------------------------ logging and card

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        logs.update({f"{prefix}{name}": value for name, value in self.triage_metrics.pop(mode).items()})
        if self.args.triage_replaces_trl_ratio:
            for name in _TRL_RATIO_METRICS:
                self._metrics[mode].pop(name, None)
        super().log(logs, start_time)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """Write ``output_dir/README.md``: Hub metadata, TRL's card layout and the TRIAGE section
        (``model_card.trainer_model_card``)."""
        if self.is_world_process_zero():
            card = trainer_model_card(self, model_name=model_name, dataset_name=dataset_name, tags=tags)
            card.save(os.path.join(self.args.output_dir, "README.md"))

    def close(self) -> None:
        """Free the colocated vLLM engine (:meth:`TriageVLLMGeneration.close`), e.g. before a re-run notebook cell
        builds another trainer. The trainer can still save and push, not generate. Also the end of a ``with`` block:
        ``with TriageGRPOTrainer(...) as trainer: trainer.train()``."""
        if getattr(self, "vllm_generation", None) is not None:
            self.vllm_generation.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def kernel_report(self) -> dict[str, str]:
        """Which kernels / layer paths ran: the sampler's own report and the NVFP4 learner's summary."""
        report = {}
        sampler_report = getattr(getattr(self, "vllm_generation", None), "kernel_report", None)
        if sampler_report:
            report["sampler"] = ", ".join(f"{k}={v}" for k, v in sampler_report.items())
        elif self.use_vllm:
            report["sampler"] = f"vLLM ({self.args.sampler_precision})"
        if self.nvfp4_learner_report is not None:
            from ..nvfp4.learner import learner_execution_summary

            counts = {**self.nvfp4_learner_report.summary(), **learner_execution_summary(self.model),
                      "activations": "nvfp4" if self.args.quantizes_activations else "bf16 (weight-only, W4A16)"}
            report["learner"] = ", ".join(f"{k}={v}" for k, v in counts.items())
        else:
            report["learner"] = "bf16 (no NVFP4 layers)"
        calls = self.learner_forwards
        counts = f"{calls['shared_prompt']} shared-prompt and {calls['rows']} row-by-row forwards"
        report["learner_forward"] = (f"shared prompt, each scored once per group ({counts})"
                                     if self.shared_prompt_forward
                                     else f"TRL's rows ({self.shared_prompt_off_reason}; {counts})")
        learner_dtype = next(self.model.parameters()).dtype
        report["compute_dtype"] = (f"learner weights {str(learner_dtype).removeprefix('torch.')}; NVFP4 GEMMs and "
                                   f"sampler: {compute_dtype_reason(self.accelerator.device.type)}")  # runtime.engine_dtype
        return report


def _triage_args(model, args) -> TriageGRPOConfig:
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        # By keyword: the first positional field is the mixins' (learner_precision), not TRL's output_dir. Without
        # any accelerator, TrainingArguments refuses its own bf16 default unless use_cpu is set.
        return TriageGRPOConfig(output_dir=f"{str(name).split('/')[-1]}-TRIAGE-GRPO",
                                use_cpu=not torch.accelerator.is_available())
    if not isinstance(args, TriageGRPOConfig):
        raise TypeError(
            f"TriageGRPOTrainer needs a TriageGRPOConfig; got {type(args).__name__}. Build one with the same fields "
            "plus the triage_* settings, e.g. TriageGRPOConfig(output_dir=..., learning_rate=..., triage_mode='full')."
        )
    return args


def _calibration_prompts(dataset, n: int) -> list:
    """The first ``n`` prompts of ``dataset`` (as stored: text or chat messages); ``[]`` without rows or a ``prompt``
    column."""
    if dataset is None or n <= 0:
        return []
    try:
        column = dataset[: min(n, len(dataset))]["prompt"]
    except (TypeError, KeyError):  # iterable datasets
        column = [row["prompt"] for row, _ in zip(dataset, range(n)) if "prompt" in row]
    return list(column)


def _tokenizer_of(processing_class):
    return getattr(processing_class, "tokenizer", None) or processing_class


def _learner_compute_dtype(model, args) -> str:
    """The dtype the learner's matmuls run in: bf16/fp16 under the trainer's mixed precision, else the floating
    parameters' dtype (TRL loads a Hub id or folder in float32 unless ``model_init_kwargs`` says otherwise)."""
    if getattr(args, "bf16", False):
        return "bfloat16"
    if getattr(args, "fp16", False):
        return "float16"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return str(dtype).removeprefix("torch.")
