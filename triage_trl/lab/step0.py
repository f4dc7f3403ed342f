"""One step-0 held-out evaluation per starting point, shared by the lab's runs that start from it.

Before the first optimizer step the objective has done nothing: the runs of one lab that differ only in their
objective (naive, TIS, OPSM, TRIAGE at one dose and seed; every configuration of an E3 dose) hold the same weights,
the same sampler and the same evaluation settings, so their step-0 evaluations are one measurement. On a 2-core CPU
that measurement costs about ten minutes a run (256 greedy items and avg@8 on 64), which this file pays once per
starting point: the first run stores its step-0 record under ``LAB_DIR/step0_evals/<identity>.json``; a later run
with the same identity reads it (the record says ``shared_from``) instead of evaluating. The pairing of the training
gain by item is unchanged: every run's final evaluation is paired with the same step-0 outcomes.

The identity (:func:`step0_identity`) is every ``TriageGRPOConfig`` field except those that only act in the loss
(:data:`OBJECTIVE_ONLY`) or in the optimizer's steps (:data:`OPTIMIZER_ONLY`) or name the run's folder, plus the
model, the seed, the lab's evaluation settings and the engines' compute dtype (``runtime.engine_dtype``: it follows
the CPU kind, so a lab folder copied to another kind of machine evaluates step 0 again). A field not listed there
counts, so a new setting that could change the sampler never shares by mistake.
"""

from __future__ import annotations

import hashlib
import json
import os

OBJECTIVE_ONLY = ("triage_", "vllm_importance_sampling_", "off_policy_mask_threshold")
"""Prefixes of the fields that act only in the loss (never on the weights, the sampler or the evaluation before the
first optimizer step): TRIAGE's objective, TRL's importance-sampling correction, TRL's off-policy sequence mask."""
OPTIMIZER_ONLY = ("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
                  "weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "optim_args")
"""Fields that act only in the optimizer's steps (a learning-rate ladder shares its step-0 evaluation)."""
RUN_NAMING = ("output_dir", "logging_dir", "run_name", "hub_model_id")
"""Fields that name where a run writes, not what it computes."""
EVAL_SETTINGS = ("task", "eval_size", "eval_samples", "eval_sampled_items", "temperature", "max_completion_length",
                 "train_size")
"""The lab settings of the held-out evaluation (``train_size`` fixes which items are disjoint from training)."""
CACHE_DIR = "step0_evals"


def step0_identity(args, settings: dict, seed: int, model: str) -> str:
    """A hex digest naming a run's starting point and its step-0 evaluation.

    Args:
        args: the run's ``TriageGRPOConfig``.
        settings: the lab settings (``triage_trl.lab.configs.resolve_settings``).
        seed: the run's seed.
        model: the model path or id the run loads.
    """
    import torch

    from ..runtime import engine_dtype

    fields = {k: v for k, v in args.to_dict().items()
              if not k.startswith(OBJECTIVE_ONLY) and k not in RUN_NAMING and k not in OPTIMIZER_ONLY}
    # the engines' compute dtype follows the CPU kind (bf16 with AVX512-BF16 or AMX, float32 on AVX2 only): a record
    # copied to another kind of machine must not be shared
    device = "cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu"
    record = {"model": model, "seed": seed, "args": fields, "eval": {k: settings.get(k) for k in EVAL_SETTINGS},
              "engine_dtype": str(engine_dtype(device))}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path(lab_dir: str, identity: str) -> str:
    return os.path.join(lab_dir, CACHE_DIR, f"{identity}.json")


def read_step0(lab_dir: str, identity: str, *, learner: bool = False) -> dict | None:
    """The stored step-0 record of ``identity`` (``None`` if no run stored one, or, with ``learner``, if it lacks the
    learner's own scores: a record stored before they were measured is measured again)."""
    path = cache_path(lab_dir, identity)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    return None if learner and "learner_outcomes" not in record else record


def write_step0(lab_dir: str, identity: str, record: dict, run_label: str) -> None:
    """Store a run's step-0 record (atomically: a crash leaves no half-written file)."""
    path = cache_path(lab_dir, identity)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({**record, "shared_from": run_label}, f, default=float)
    os.replace(path + ".tmp", path)
