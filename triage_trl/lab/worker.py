"""One stability-lab run: ``python -m triage_trl.lab.worker --config NAME [--dose D] --seed S --run-dir DIR [settings]``.

Trains one configuration (:mod:`triage_trl.lab.configs`) at one mismatch dose for one seed in this process, with
its own vLLM engine, and measures the greedy held-out accuracy of the run's own sampler (synced to the learner with
``trainer.sync_sampler()`` right before each evaluation) at step 0, every ``eval_every`` optimizer steps and at the
end (:func:`triage_trl.eval.held_out.greedy_accuracy`); the step-0 evaluation is measured once per starting point
and shared by the lab's runs that start from it (:mod:`triage_trl.lab.step0`). It writes into DIR:

- ``log_history.jsonl``: every log record, appended as it is logged (a crashed run keeps its curve);
- ``held_out.jsonl``: one record per held-out evaluation (step, accuracy, correct, total, the 0/1 outcome per item,
  avg@N and each item's share of correct samples when the scale asks for samples, seconds, of which sync_seconds;
  the same of the learner's own weights, ``learner_*``, for a full-precision learner beside an NVFP4 sampler);
- ``fixed_probe.jsonl`` when the scale sets ``probe_every``: k3 of the learner against the sampler on fixed
  completions (``fixed_probe.pt``, sampled at step 0), every ``probe_every`` steps (:mod:`triage_trl.lab.probe`);
- ``checkpoint-N/`` when the scale saves checkpoints (``collapse``: every 10 steps, the last one kept): a run
  stopped mid-way resumes from the last complete one when the lab reruns it (its logs are cut back to that step);
  removed when the run finishes;
- ``provenance.jsonl``: one record per start of the run (the step it started from, the triage-trl version, git
  commit and environment: :func:`triage_trl.provenance.code_revision`), so a resumed run names every code
  revision that produced it;
- ``run_summary.json`` (last, always): configuration, seed, settings, held-out accuracies, timings, ``provenance``
  and ``status``
  (``"ok"``, or ``"failed: <error>"`` for a run that raised, e.g. ``StaleSamplerError``; the traceback goes to
  ``error.txt``);
- ``trainer_state.json`` and the plots of ``triage-report`` (``plots/``).

Model weights are not saved; the sampler's NVFP4 checkpoint folder is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import time
import traceback

from ..runtime.run_logs import LOG_HISTORY, read_records, read_log_history
from ..runs import (HeldOutEvaluator, LogHistoryWriter, build_recipe_trainer, finish_run, resolve_model,
                    train_with_held_out)
from ..runs import recipe_datasets as load_datasets  # noqa: F401  (the lab's name for the recipe's data sets)
from ..runtime import vllm_process_settings
from .configs import (SETTING_KEYS, add_setting_arguments, build_trainer_config, lab_config, lab_dir_of, lab_dose,
                      resolve_settings, run_label, sibling_run_path)
from .metrics import mean_triage_weight
from .step0 import read_step0, step0_identity, write_step0

RUN_SUMMARY = "run_summary.json"
HELD_OUT = "held_out.jsonl"
PROVENANCE = "provenance.jsonl"


def scores_learner_weights(args) -> bool:
    """Whether a run's held-out evaluations also score the learner's own weights: a full-precision learner beside an
    NVFP4 sampler (``bf16_learner_nvfp4_sampler``), whose sampler's accuracy carries a quantisation cost its
    weights do not."""
    return args.learner_precision == "bf16" and args.sampler_precision == "nvfp4"


def keep_records_up_to(path: str, step: int) -> None:
    """Rewrite a jsonl log keeping the records of steps ``<= step`` (and those without a step): a run resumed from
    the checkpoint of ``step`` logs the later steps again."""
    records = [r for r in read_records(path) if r.get("step", 0) <= step]
    if os.path.exists(path):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, default=float) + "\n" for r in records)
        os.replace(path + ".tmp", path)


def _append_jsonl(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=float) + "\n")


FIXED_PROBE = "fixed_probe.jsonl"
FIXED_PROBE_BATCH = "fixed_probe.pt"


def start_fixed_probe(trainer, held_out, settings: dict, run_dir: str, *, resumed: bool,
                      hot: tuple[float, float] | None = None):
    """The fixed probe of a run (:class:`triage_trl.lab.probe.FixedProbe`, every ``probe_every`` steps): its
    completions sampled once at step 0 (kept in ``fixed_probe.pt``, so a resumed run re-scores the same ones),
    its records appended to ``fixed_probe.jsonl``. ``hot``: an E3 dose's ``(start, end)`` factors; the probe then
    also records the dose on its fixed text (``FixedProbe``'s ``dose_k3``) at the factor ``HotSampler`` sets for the
    next optimizer step."""
    import torch

    from .hot_sampler import ramp
    from .probe import FixedProbe

    max_steps = settings["max_steps"]
    probe = FixedProbe(held_out, every=settings["probe_every"], max_tokens=settings["max_completion_length"],
                       temperature=settings["temperature"],
                       on_result=lambda record: _append_jsonl(os.path.join(run_dir, FIXED_PROBE), record),
                       sampler_factor=(lambda step: ramp(step + 1, max_steps, *hot)) if hot else None)
    path = os.path.join(run_dir, FIXED_PROBE_BATCH)
    if resumed and os.path.exists(path):
        probe.trainer, probe.batch = trainer, torch.load(path)
    else:
        trainer.sync_sampler()
        torch.save(probe.capture(trainer), path)
        probe.measure(0)
    trainer.add_callback(probe)
    return probe


def learning_rate_scale(run_dir: str, reference: str, seed: int, dose: str | None) -> float:
    """The effective-step control's learning-rate scale: the mean ``triage/weight_mean`` of run ``(reference, dose,
    seed)`` of the same lab folder (:func:`triage_trl.lab.metrics.mean_triage_weight`).

    Raises:
        FileNotFoundError: that run has no finished log (the message names the command that makes it).
        ValueError: it logged no training step.
    """
    ref_dir = sibling_run_path(run_dir, reference, seed, dose)
    if not os.path.exists(os.path.join(ref_dir, RUN_SUMMARY)):
        raise FileNotFoundError(
            f"The effective-step control needs the finished run {run_label(reference, dose)} seed {seed} of the same "
            f"lab ({ref_dir}): run it first (--configs {reference} ... in the same --output-dir).")
    return mean_triage_weight(read_log_history(ref_dir))


def run(config_name: str, seed: int, run_dir: str, settings: dict, dose: str | None = None) -> dict:
    """Train and evaluate one (configuration, dose, seed); always writes ``run_summary.json``; returns it.

    A run that raises is recorded with ``status="failed: <ExceptionType>: <message>"``; ``KeyboardInterrupt`` is
    not caught (the run then has no summary and the lab reruns it on resume).

    Raises:
        KeyError: unknown configuration or dose (before anything is written).
    """
    from ..trainer.checkpoints import last_complete_checkpoint

    config = lab_config(config_name)
    dose_overrides = lab_dose(dose).overrides if dose else {}
    os.makedirs(run_dir, exist_ok=True)
    resume = last_complete_checkpoint(run_dir)  # a run stopped mid-way (a scale that saves checkpoints) goes on
    resumed_step = int(os.path.basename(resume).rsplit("-", 1)[1]) if resume else None
    if resume:
        for name in (LOG_HISTORY, HELD_OUT, FIXED_PROBE):
            keep_records_up_to(os.path.join(run_dir, name), resumed_step)
    else:
        for name in (LOG_HISTORY, HELD_OUT, "error.txt", FIXED_PROBE, FIXED_PROBE_BATCH, PROVENANCE):  # starts clean
            if os.path.exists(os.path.join(run_dir, name)):
                os.remove(os.path.join(run_dir, name))
    from ..provenance import code_revision

    _append_jsonl(os.path.join(run_dir, PROVENANCE), {"from_step": resumed_step or 0, **code_revision()})
    start = time.perf_counter()
    summary = {"config": config.name, "dose": dose, "description": config.description, "seed": seed,
               "settings": {k: settings.get(k) for k in ("scale", *SETTING_KEYS)},
               "overrides": {**settings.get("trainer_overrides", {}), **config.overrides, **dose_overrides},
               "held_out": read_records(os.path.join(run_dir, HELD_OUT)) if resume else [], "status": "running",
               "resumed_from_step": resumed_step}
    trainer = None
    timings = {"startup_seconds": math.nan, "train_seconds": math.nan, "eval_seconds": 0.0}

    lab_dir = lab_dir_of(run_dir)
    identity = None

    def record(entry: dict, _result) -> None:
        if entry["step"] == 0 and identity is not None and "shared_from" not in entry:
            write_step0(lab_dir, identity, entry, f"{run_label(config.name, dose)} seed {seed}")
        summary["held_out"].append(entry)
        timings["eval_seconds"] += entry["seconds"]
        _append_jsonl(os.path.join(run_dir, HELD_OUT), entry)

    try:
        with vllm_process_settings():
            model_path = resolve_model(settings.get("model"), run_dir)
            summary["model"] = model_path
            scale = 1.0
            if config.learning_rate_from:
                scale = learning_rate_scale(run_dir, config.learning_rate_from, seed, dose)
                summary["learning_rate_scale"] = {"from": run_label(config.learning_rate_from, dose), "scale": scale}
            args = build_trainer_config(config.name, settings, run_dir, seed, settings.get("trainer_overrides"), dose,
                                        learning_rate_scale=scale)
            trainer, train, held_out = build_recipe_trainer(model_path, args, settings, seed,
                                                            callbacks=[LogHistoryWriter(run_dir)])
            timings["startup_seconds"] = time.perf_counter() - start
            from ..eval.held_out import shared_prompts

            summary["held_out_items"] = len(held_out)
            summary["held_out_shared_with_train"] = shared_prompts(held_out, train)
            evaluator = HeldOutEvaluator(held_out, settings["max_completion_length"], every=settings["eval_every"],
                                         on_result=record, samples=settings.get("eval_samples") or 0,
                                         temperature=settings["temperature"],
                                         sampled_items=settings.get("eval_sampled_items"),
                                         learner=scores_learner_weights(args))
            identity = step0_identity(args, settings, seed, model_path)
            summary["step0_identity"] = identity
            shared = None if resume else read_step0(lab_dir, identity, learner=evaluator.learner)
            if shared is not None:  # a run from the same starting point measured it (triage_trl.lab.step0)
                evaluator.reuse({**shared, "seconds": 0.0, "sync_seconds": 0.0,
                                 "measured_seconds": shared.get("seconds")})
            hot = lab_dose(dose).sampler_temperature if dose else None
            if hot:  # E3: lab only, bypasses the trainer's same-temperature rule (triage_trl.lab.hot_sampler)
                from .hot_sampler import HotSampler

                trainer.add_callback(HotSampler(trainer, *hot))
            if settings.get("probe_every"):
                start_fixed_probe(trainer, held_out, settings, run_dir, resumed=resume is not None, hot=hot)
            timings["train_seconds"] = train_with_held_out(trainer, evaluator, resume)
        summary["status"] = "ok"
        from ..trainer.checkpoints import checkpoints

        for folder in checkpoints(run_dir):  # the resume points of a finished run (a full model and optimizer each)
            shutil.rmtree(folder, ignore_errors=True)
    except Exception as err:  # recorded, not lost: the lab goes on with the next run
        summary["status"] = f"failed: {type(err).__name__}: {err}".strip()
        with open(os.path.join(run_dir, "error.txt"), "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        logging.getLogger(__name__).error("Run %s seed %d failed", config_name, seed, exc_info=True)
    finally:
        if trainer is not None:
            summary.update(finish_run(trainer, save_model=False))
        from ..trainer.distributed import SAMPLER_CHECKPOINT

        shutil.rmtree(os.path.join(run_dir, SAMPLER_CHECKPOINT), ignore_errors=True)
    summary.update(timings)
    summary["steps"] = trainer.state.global_step if trainer is not None else 0
    summary["wall_seconds"] = time.perf_counter() - start
    summary["provenance"] = read_records(os.path.join(run_dir, PROVENANCE))
    with open(os.path.join(run_dir, RUN_SUMMARY), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=float)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """Command line of one run; exits 0 whenever ``run_summary.json`` was written (read its ``status``)."""
    parser = argparse.ArgumentParser(prog="python -m triage_trl.lab.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a configuration name of triage_trl.lab.configs")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--dose", default=None, help="a dose of triage_trl.lab.configs.DOSES (NVFP4 configurations)")
    add_setting_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    summary = run(args.config, args.seed, args.run_dir, resolve_settings(args), args.dose)
    print(f"{args.config} seed {args.seed}: {summary['status']} ({summary['wall_seconds']:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
