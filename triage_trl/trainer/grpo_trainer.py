"""``TriageGRPOTrainer``: TRL's ``GRPOTrainer`` with the TRIAGE objective and a colocated (NVFP4) vLLM sampler.

Spec: ``shared/design/triage-objective.md`` ("Implementation notes") and issue 4.

How the objective reaches the loss, without a copy of TRL's loss code: TRL 1.16's ``GRPOTrainer`` multiplies the
per-token policy-gradient loss by ``inputs["importance_sampling_ratio"]`` before its aggregation whenever
``use_vllm and vllm_importance_sampling_correction`` hold, and then also computes ``old_per_token_logps`` at rollout
time. While TRIAGE is on, this trainer keeps that hook active *internally* (the user-facing
``args.vllm_importance_sampling_correction`` is False), neutralises TRL's own ratio (clipped to [1, 1], removed
from the batch and from the logs), and ``_compute_loss`` puts TRIAGE's detached weights under that key before
calling ``GRPOTrainer._compute_loss``. TRL's clipping, KL, entropy terms and metrics are unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

import torch
from trl import GRPOTrainer
from trl.trainer.utils import create_model_from_path

from ..objective import METRIC_NAMES, triage_weights
from ..segments import build_newline_table, segment_ids
from .grpo_config import TriageGRPOConfig
from .model_card import TRIAGE_PAPER, insert_section, triage_card_section
from .sync_probe import check_probe_gap, probe_gap, probe_token_ids

logger = logging.getLogger(__name__)

# TRL's sampling metrics that describe its own importance-sampling ratio; meaningless once TRIAGE replaces it (the
# weights TRIAGE applies are logged as triage/weight_*).
_TRL_IS_RATIO_METRICS = (
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
# How each triage/ metric is reduced across processes.
_MAX_METRICS = {"gap_abs_max", "weight_max"}
_MIN_METRICS = {"weight_min"}


class TriageGRPOTrainer(GRPOTrainer):
    """GRPO with TRIAGE's per-token weights, an NVFP4-capable learner and a colocated NVFP4-capable vLLM sampler.

    Arguments are those of [`~trl.GRPOTrainer`]; ``args`` must be a [`TriageGRPOConfig`].

    Raises:
        TypeError: ``args`` is not a ``TriageGRPOConfig``.
        ValueError: TRIAGE is on but the run has no sampler log-probs (``use_vllm=False``).
        NotImplementedError: TRIAGE is on with an unsupported ``loss_type`` (from the config), or with a
            ``rollout_func`` but no vLLM.
    """

    _tag_names = ["trl", "grpo", "triage", "nvfp4"]
    _name = "TRIAGE-GRPO"
    _paper = TRIAGE_PAPER

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: TriageGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = TriageGRPOConfig(f"{str(name).split('/')[-1]}-TRIAGE-GRPO")
        if not isinstance(args, TriageGRPOConfig):
            raise TypeError(
                f"TriageGRPOTrainer needs a TriageGRPOConfig; got {type(args).__name__}. Build one with the same "
                "fields: TriageGRPOConfig(**your_grpo_config.to_dict()) plus the triage_* settings."
            )
        self.triage_mode = args.triage_mode
        if self.triage_mode != "off" and not args.use_vllm:
            if rollout_func is not None:
                raise NotImplementedError(
                    "TRIAGE with a rollout_func needs use_vllm=True: TRL applies per-token loss weights and computes "
                    "rollout-time learner log-probs only on its vLLM path. Set use_vllm=True, or triage_mode='off'."
                )
            raise ValueError(
                f"triage_mode={self.triage_mode!r} needs the sampler's log-probs, which only the vLLM sampler "
                "returns: set use_vllm=True (vllm_mode='colocate'), or triage_mode='off'."
            )
        # TRIAGE replaces TRL's correction unless diagnose mode keeps it on request (see TriageGRPOConfig).
        self._triage_replaces_trl_is = self.triage_mode != "off" and not args.vllm_importance_sampling_correction

        self.nvfp4_learner_report = None
        if args.learner_precision == "nvfp4":
            model, self.nvfp4_learner_report = self._nvfp4_learner(model, args)

        with _vllm_generation_factory(self._sampler_factory(args, train_dataset, processing_class, model)):
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                reward_processing_classes=reward_processing_classes,
                callbacks=callbacks,
                optimizers=optimizers,
                quantization_config=quantization_config,
                peft_config=peft_config,
                tools=tools,
                rollout_func=rollout_func,
                environment_factory=environment_factory,
            )
        if self.nvfp4_learner_report is not None:  # re-quantise the cached NVFP4 weights after every step
            from ..nvfp4.callbacks import NVFP4WeightCacheCallback

            self.add_callback(NVFP4WeightCacheCallback())

        if self._triage_replaces_trl_is:
            # TRL's hook on, its own ratio neutral: clamp(exp(diff), 1, 1) == 1. TRIAGE's weights replace it at loss
            # time; `args` keeps the user-facing value (off).
            self.vllm_importance_sampling_correction = True
            self.vllm_importance_sampling_mode = "token_truncate"
            self.vllm_importance_sampling_clip_min = 1.0
            self.vllm_importance_sampling_clip_max = 1.0

        self._newline_table = None
        if self.triage_mode != "off" and args.triage_segment_mode == "newline":
            vocab = self.model.get_input_embeddings().num_embeddings
            self._newline_table = build_newline_table(self._tokenizer, vocab_size=max(vocab, len(self._tokenizer)))
        self._push_sampler_scales()
        self._probe_ids = probe_token_ids(self._tokenizer) if self.use_vllm else None
        self.sync_probe_gaps: list[float] = []
        self.triage_history: list[dict[str, float]] = []
        if self.nvfp4_learner_report is not None:
            logger.info("NVFP4 learner layers: %s", self.nvfp4_learner_report)
            from ..nvfp4.learner import learner_execution_summary

            counts = {**self.nvfp4_learner_report.summary(), **learner_execution_summary(self.model)}
            for name, count in counts.items():  # in the first logged step
                self._metrics["train"][name].append(float(count))

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _nvfp4_learner(model, args: TriageGRPOConfig):
        """Load the model (when given by name), swap its decoder linear layers for NVFP4 W4A4 layers.

        Returns:
            ``(model, report)``: the model, changed in place, and the NVFP4 module's per-layer report.
        """
        from ..nvfp4.learner import convert_to_nvfp4_learner

        if isinstance(model, str):
            model_init_kwargs = dict(args.model_init_kwargs or {})
            model_init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            model = create_model_from_path(model, **model_init_kwargs)
            # Used above; TRL would warn that they are ignored for an instantiated model.
            args.model_init_kwargs = None
        report = convert_to_nvfp4_learner(model, args)
        return model, report

    def _sampler_factory(self, args: TriageGRPOConfig, train_dataset, processing_class, model):
        """The class TRL instantiates as its vLLM backend (colocate mode): TriageVLLMGeneration, bound to our args."""
        if not args.use_vllm or args.vllm_mode != "colocate":
            return None
        from ..sampler.engine import TriageVLLMGeneration

        return functools.partial(
            TriageVLLMGeneration,
            sampler_precision=args.sampler_precision,
            calibration_prompts=_calibration_prompts(train_dataset, args.nvfp4_calibration_prompts),
            recalibrate_every_sync=args.nvfp4_recalibrate_every_sync,
            checkpoint_dir=os.path.join(args.output_dir, "sampler_checkpoint"),
            sampler_seed=args.seed,
            nvfp4_config=args,
        )

    # ------------------------------------------------------------------ generation: sync + probe

    def _generate(self, prompts: list):
        # Sync the sampler here, before TRL's own check in `_generate` / `_generate_single_turn` (which then sees the
        # step as loaded and skips), so that the probe runs right after every sync.
        if self.use_vllm and self.state.global_step != self._last_loaded_step:
            from trl.extras.profiling import profiling_context

            with profiling_context(self, "sync_weights"):
                self.sync_sampler()
        return super()._generate(prompts)

    def sync_sampler(self) -> None:
        """Load the learner's current weights into the vLLM sampler (re-quantised for NVFP4), give the learner the
        sampler's activation scales (``nvfp4_learner_scales="sampler"``) and run the sync probe. Call it before
        using ``self.vllm_generation.llm`` directly (e.g. a held-out evaluation between steps); the next rollout
        then reuses this sync.

        Raises:
            StaleSamplerError: the probe gap exceeds ``sync_probe_max_gap``.
        """
        self.vllm_generation.sync_weights()
        self._push_sampler_scales()
        self._last_loaded_step = self.state.global_step
        self._run_sync_probe()

    def _push_sampler_scales(self) -> None:
        """With ``nvfp4_learner_scales="sampler"``: give the learner the activation scales the sampler was just
        calibrated with (the NVFP4 export recalibrates them at every sync)."""
        if self.nvfp4_learner_report is None or self.args.resolved_nvfp4_learner_scales != "sampler":
            return
        from ..nvfp4.learner import set_sampler_input_scales

        scales = getattr(getattr(self, "vllm_generation", None), "input_global_scales", None)
        if scales is None:
            raise RuntimeError(
                "nvfp4_learner_scales='sampler' but the sampler has no calibrated input scales: it needs "
                "sampler_precision='nvfp4' with vllm_mode='colocate'."
            )
        set_sampler_input_scales(self.model, scales)

    @torch.no_grad()
    def _run_sync_probe(self) -> float:
        """Score the probe sequence with the sampler and the learner; log and bound their gap (nats)."""
        ids = self._probe_ids
        sampler_logps = self.vllm_generation.score_logps([ids])[0]
        device = self.accelerator.device
        input_ids = torch.tensor([ids], device=device)
        learner_logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model, input_ids, torch.ones_like(input_ids), len(ids) - 1
        )
        gap, gap_max = probe_gap(learner_logps[0], sampler_logps)
        gathered = self.accelerator.gather(torch.tensor([gap, gap_max], dtype=torch.float64, device=device))
        gap, gap_max = (float(v) for v in gathered.view(-1, 2).max(dim=0).values)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["triage/sync_probe_gap"].append(gap)
        self._metrics[mode]["triage/sync_probe_gap_max"].append(gap_max)
        self.sync_probe_gaps.append(gap)
        check_probe_gap(
            gap,
            self.args.resolved_sync_probe_max_gap,
            step=self.state.global_step,
            learner_precision=self.args.learner_precision,
            sampler_precision=self.args.sampler_precision,
        )
        return gap

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self._triage_replaces_trl_is:
            # TRL's own ratio (identically 1 here) never reaches the loss: `_compute_loss` puts TRIAGE's weights
            # under this key. Its metrics would describe a ratio no token received.
            output.pop("importance_sampling_ratio", None)
            mode = "train" if self.model.training else "eval"
            for name in _TRL_IS_RATIO_METRICS:
                self._metrics[mode].pop(name, None)
        return output

    # ------------------------------------------------------------------ loss

    def _compute_loss(self, model, inputs):
        if self.triage_mode == "off":
            return super()._compute_loss(model, inputs)
        weights = self._triage_weights(inputs)
        if self._triage_replaces_trl_is:
            inputs = {**inputs, "importance_sampling_ratio": weights}
        return super()._compute_loss(model, inputs)

    def _triage_weights(self, inputs: dict[str, Any]) -> torch.Tensor:
        """TRIAGE's (B, T) detached weights for this micro-batch; logs the triage/ metrics.

        Raises:
            ValueError: the batch has no ``sampling_per_token_logps`` (no sampler log-probs) or no
                ``old_per_token_logps``.
        """
        sampler_logps = inputs.get("sampling_per_token_logps")
        if sampler_logps is None:
            raise ValueError(
                f"triage_mode={self.triage_mode!r} needs the sampler's per-token log-probs, but this batch has no "
                "'sampling_per_token_logps'. Use the vLLM sampler (use_vllm=True), and if you pass a rollout_func, "
                "make it return the sampled tokens' log-probs under 'logprobs'; or set triage_mode='off'."
            )
        old_logps = inputs.get("old_per_token_logps")
        if old_logps is None:
            raise ValueError(
                "TRIAGE needs the learner's rollout-time log-probs ('old_per_token_logps'), which TRL computes when "
                "use_vllm=True: this batch has none. Build inputs with TriageGRPOTrainer's own generation, or add them."
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
        result = triage_weights(old_logps, sampler_logps, inputs["advantages"], mask, seg, self.args)
        self._log_triage_metrics(result.metrics)
        return result.weights

    def _log_triage_metrics(self, metrics: dict[str, float]) -> None:
        device = self.accelerator.device
        local = torch.tensor([metrics[name] for name in METRIC_NAMES], dtype=torch.float64, device=device)
        gathered = self.accelerator.gather(local).view(-1, len(METRIC_NAMES))
        mode = "train" if self.model.training else "eval"
        record = {"step": self.state.global_step}
        for i, name in enumerate(METRIC_NAMES):
            column = gathered[:, i]
            value = column.max() if name in _MAX_METRICS else column.min() if name in _MIN_METRICS else column.mean()
            self._metrics[mode][f"triage/{name}"].append(float(value))
            record[name] = float(value)
        if mode == "train":
            self.triage_history.append(record)

    # ------------------------------------------------------------------ model card

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card (tags, TRIAGE and GRPO citations) plus a TRIAGE section; see ``model_card.py``."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        path = os.path.join(self.args.output_dir, "README.md")
        section = triage_card_section(
            triage_settings=self.args.triage_settings(),
            nvfp4_settings=self.args.nvfp4_settings(),
            kernels=self.kernel_report(),
            history=self.triage_history,
            sync_probe_gaps=self.sync_probe_gaps,
        )
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(insert_section(text, section))

    def kernel_report(self) -> dict[str, str]:
        """Which kernels / layer paths ran: the sampler's own report and the NVFP4 learner's summary."""
        report = {}
        sampler_report = getattr(getattr(self, "vllm_generation", None), "kernel_report", None)
        if callable(sampler_report):
            sampler_report = sampler_report()
        if sampler_report:
            report["sampler"] = _report_text(sampler_report)
        elif self.use_vllm:
            report["sampler"] = f"vLLM ({self.args.sampler_precision})"
        if self.nvfp4_learner_report is not None:
            report["learner"] = _report_text(self.nvfp4_learner_report)
        else:
            report["learner"] = "bf16 (no NVFP4 layers)"
        return report


@contextlib.contextmanager
def _vllm_generation_factory(factory):
    """THE seam for the sampler: while TRL's ``GRPOTrainer.__init__`` runs, the name ``VLLMGeneration`` in
    ``trl.trainer.grpo_trainer`` (the class TRL instantiates for ``use_vllm=True``) points at ``factory``."""
    if factory is None:
        yield
        return
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = factory
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = original


def _calibration_prompts(train_dataset, n: int) -> list:
    """The first ``n`` prompts of the training set (as stored: text or chat messages)."""
    if train_dataset is None or n <= 0:
        return []
    try:
        column = train_dataset[: min(n, len(train_dataset))]["prompt"]
    except (TypeError, KeyError):  # iterable datasets
        column = [row["prompt"] for row, _ in zip(train_dataset, range(n))]
    return list(column)


def _report_text(report) -> str:
    """One line for a card or log: a report's ``summary()`` counts when it has them, else its text."""
    if isinstance(report, str):
        return report
    summary = getattr(report, "summary", None)
    summary = summary() if callable(summary) else summary
    if isinstance(summary, dict):
        return ", ".join(f"{k}={v}" for k, v in summary.items())
    if summary is not None:
        return str(summary)
    if isinstance(report, dict):
        return ", ".join(f"{k}={v}" for k, v in report.items())
    return str(report)
