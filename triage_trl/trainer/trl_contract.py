"""Every TRL name, attribute, batch key and behaviour triage-trl relies on, each with where it is used.

:func:`check_trl_contract` runs when a ``TriageGRPOTrainer`` is built (and in ``tests/test_trl_contract.py``), so a
TRL upgrade that renames or drops one of them fails at once with a message naming it, its use and the supported TRL
version, instead of training silently with another loss or sampler. Private names (``_...``) are listed with why each
is unavoidable in ``docs/trainer.md``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from .trl_seam import TRL_TESTED, TRLContractError, trl_version


@dataclass(frozen=True)
class Requirement:
    """One thing triage-trl needs from TRL: ``target`` is ``"module:attribute.path"``; ``source_contains`` (optional)
    are strings the target's source must contain (a behaviour, e.g. a batch key TRL's loss reads)."""

    target: str
    used_by: str
    source_contains: tuple[str, ...] = ()


TRL_CONTRACT: tuple[Requirement, ...] = (
    Requirement("trl:GRPOTrainer", "TriageGRPOTrainer subclasses it"),
    Requirement("trl:GRPOConfig", "TriageGRPOConfig subclasses it"),
    Requirement("trl:TrlParser", "the triage-grpo command line (recipes and CLI overrides)"),
    Requirement("trl:ModelConfig", "the triage-grpo command line (model arguments)"),
    Requirement("trl:get_peft_config", "the triage-grpo command line (LoRA flags)"),
    Requirement("trl.trainer.grpo_trainer:VLLMGeneration",
                "trl_seam.trl_builds_sampler_with: TRL instantiates its vLLM backend through this module name"),
    Requirement("trl.generation.vllm_generation:VLLMGeneration", "TriageVLLMGeneration subclasses it"),
    Requirement("trl.generation.vllm_generation:VLLMGeneration.__init__",
                "TriageVLLMGeneration reads TRL's colocate settings from the attributes it sets",
                ("self.tensor_parallel_size", "self.max_model_length", "self.enable_sleep_mode", "self._dist",
                 "self._init_vllm()")),
    Requirement("trl.generation.vllm_generation:VLLMGeneration.generate",
                "TriageVLLMGeneration keeps _llm_weights_sleeping true to its engine (asleep after start, awake after "
                "each sync); TRL's generate re-syncs the weights when it is set (sleep mode)",
                ("self._llm_weights_sleeping",)),
    Requirement("trl.trainer.utils:ensure_master_addr_port", "TriageVLLMGeneration joins the colocated ranks"),
    Requirement("trl:GRPOTrainer._calculate_rewards",
                "TriageGRPOTrainer marks zero-signal groups from the rewards of all processes"),
    Requirement("trl:GRPOTrainer._generate_and_score_completions",
                "TriageGRPOTrainer adds the zero-signal mark to the generation batch; TRL computes the rollout-time "
                "learner log-probs when the importance-sampling hook is on",
                ("self.use_vllm and self.vllm_importance_sampling_correction", '"old_per_token_logps"',
                 '"sampling_per_token_logps"', '"advantages"', '"completion_ids"', '"completion_mask"',
                 "process_slice")),
    Requirement("trl:GRPOTrainer._get_per_token_logps_and_entropies",
                "the sync probe scores the probe sequence with TRL's own learner log-prob path; compute_loss wraps it "
                "to take TRIAGE's learner log-probs from the loss forward when the rollout-time forward is skipped"),
    Requirement("trl.trainer.utils:_use_triton",
                "trl_seam.compact_fused_lm_head_on_cpu: the fused LM head scores only the completion tokens on CPU"),
    Requirement("trl.trainer.utils:add_fused_lm_head",
                "trl_seam.compact_fused_lm_head_on_cpu: its forward picks the scored positions with _use_triton",
                ("compact = _use_triton(hidden_states.device)",)),
    Requirement("trl:GRPOTrainer.compute_loss", "TriageGRPOTrainer.compute_loss adds TRIAGE's weights, then calls it",
                ("self._compute_loss(model, inputs)",)),
    Requirement("trl:GRPOTrainer._compute_loss",
                "TRIAGE's weights reach the loss through TRL's importance-sampling hook",
                ('per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]',
                 "self.use_vllm and self.vllm_importance_sampling_correction")),
    Requirement("transformers.trainer:Trainer._save_checkpoint",
                "checkpoints.atomic_checkpoint: every checkpoint file goes under self._get_output_dir(), which it "
                "points at a staging folder; it rotates checkpoints itself after the rename",
                ("run_dir = self._get_output_dir(trial=trial)", "os.path.join(run_dir, checkpoint_folder)",
                 "save_total_limit=self.args.save_total_limit")),
    Requirement("trl:GRPOTrainer._save_checkpoint", "its extra checkpoint files go under self._get_output_dir() too",
                ("self._get_output_dir(trial=trial)", "super()._save_checkpoint(model, trial)")),
    Requirement("trl:GRPOTrainer.log", "TriageGRPOTrainer.log adds the triage/ metrics and drops TRL's ratio metrics",
                ("self._metrics[mode]",)),
    Requirement("trl.trainer.utils:get_config_model_id", "the model card's base model"),
    Requirement("trl.trainer.utils:get_trackio_space_url", "the model card's trackio link and tag"),
    Requirement("trl.trainer.utils:get_comet_experiment_url", "the model card's Comet link"),
)


def _resolve(target: str):
    module_name, _, path = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_trl_contract(contract: tuple[Requirement, ...] = TRL_CONTRACT) -> None:
    """Check every requirement against the installed TRL.

    Raises:
        TRLContractError: listing each missing name or behaviour, where triage-trl uses it, and the TRL version to
            install.
    """
    problems = []
    for req in contract:
        try:
            obj = _resolve(req.target)
        except (ImportError, AttributeError):
            problems.append(f"- {req.target} is missing (used by: {req.used_by})")
            continue
        if req.source_contains:
            source = inspect.getsource(obj)
            for text in req.source_contains:
                if text not in source:
                    problems.append(f"- {req.target} no longer contains {text!r} (used by: {req.used_by})")
    if problems:
        raise TRLContractError(
            f"The installed TRL {trl_version()} lacks what triage-trl relies on:\n" + "\n".join(problems)
            + f"\ntriage-trl supports TRL {TRL_TESTED}.x: install trl>={TRL_TESTED},<1.17."
        )
