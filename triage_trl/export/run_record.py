"""What a run folder records for its NVFP4 export: ``triage_run.json``.

The export must quantise the layers the run's sampler quantised and calibrate its activation scales on the prompts
the sampler calibrated on (the first ``nvfp4_calibration_prompts`` prompts of the trainer's ``calibration_dataset``,
by default the training set, rendered as the sampler rendered them). The run harness writes both here before training
and at the end (``triage_trl.runs``); a run folder without the file is exported with the default NVFP4 settings and
:data:`BUILTIN_CALIBRATION_PROMPTS`.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields

from .. import __version__

RUN_RECORD = "triage_run.json"

BUILTIN_CALIBRATION_PROMPTS = (
    "What is 17 + 25? Put the final answer in \\boxed{}.",
    "Compute 144 / 12 and explain each step.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?",
    "Solve for x: 3x - 7 = 11.",
    "What is the sum of the interior angles of a hexagon, in degrees?",
    "Write a short poem about the sea.",
    "Summarise the plot of a detective story in three sentences.",
    "Translate 'good morning, how are you?' into French.",
    "List three prime numbers larger than 50.",
    "Explain what a derivative is to a high-school student.",
    "If a train travels 60 km in 45 minutes, what is its speed in km/h?",
    "Give a Python function that returns the n-th Fibonacci number.",
    "What is 2^10 - 1?",
    "A rectangle is 7 cm wide and 12 cm long. What is its area?",
    "Name the planets of the solar system in order.",
    "Simplify the fraction 84/126.",
)
"""The fixed calibration set of an export whose run folder records no prompts: arithmetic, word problems and
general chat, each rendered as one user turn with the tokenizer's chat template."""


def run_record(trainer) -> dict:
    """The record of a ``TriageGRPOTrainer`` run (JSON-ready).

    Returns:
        ``{"triage_trl_version", "git_commit", "git_dirty", "model_name_or_path", "nvfp4": {NVFP4Config field:
        value}, "calibration_prompts": [str, ...]}``; the commit of the checkout triage-trl runs from and whether its
        code differed from it (``None`` for an installed copy: ``provenance.git_revision``); the prompts are those
        the vLLM sampler calibrated on, rendered to text (empty without a vLLM sampler).
    """
    from ..nvfp4.config import NVFP4Config
    from ..provenance import git_revision

    sampler = getattr(trainer, "vllm_generation", None)
    prompts = sampler.calibration_texts() if sampler is not None else []
    config = getattr(trainer.model, "config", None)
    return {
        "triage_trl_version": __version__,
        **git_revision(),
        "model_name_or_path": getattr(config, "_name_or_path", None) or None,
        "nvfp4": {f.name: getattr(trainer.args, f.name) for f in fields(NVFP4Config)},
        "calibration_prompts": prompts,
    }


def write_run_record(trainer, run_dir: str | None = None) -> str | None:
    """Write :func:`run_record` to ``run_dir/triage_run.json`` (default: ``trainer.args.output_dir``) on the main
    process; returns the path there, ``None`` on the other processes."""
    if not trainer.is_world_process_zero():
        return None
    run_dir = run_dir or trainer.args.output_dir
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, RUN_RECORD)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(run_record(trainer), f, indent=2, default=str)
    return path


def read_run_record(run_dir: str | os.PathLike) -> dict | None:
    """The run's record, or ``None`` when the folder has none.

    Raises:
        ValueError: the file is not a JSON object with an ``nvfp4`` object and a ``calibration_prompts`` list of
            strings (names the file).
    """
    path = os.path.join(run_dir, RUN_RECORD)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON ({err}): delete it to export with the built-in calibration prompts.") \
            from None
    prompts = record.get("calibration_prompts") if isinstance(record, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("nvfp4"), dict) or not isinstance(prompts, list) \
            or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{path} is not a triage-trl run record (an `nvfp4` object and a `calibration_prompts` list "
                         "of strings): delete it to export with the default settings and built-in prompts.")
    return record
