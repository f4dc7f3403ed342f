"""One stability-lab run: ``python -m triage_trl.lab.worker --config NAME --seed S --run-dir DIR [settings]``.

Trains one configuration (:mod:`triage_trl.lab.configs`) for one seed in this process, with its own vLLM engine,
and measures the greedy held-out accuracy of the run's own sampler (synced to the learner with
``trainer.sync_sampler()`` right before each evaluation) at step 0, every ``eval_every`` optimizer steps and at the
end (:func:`triage_trl.demo.greedy_accuracy`). It writes into DIR:

- ``log_history.jsonl``: every log record, appended as it is logged (a crashed run keeps its curve);
- ``held_out.jsonl``: one record per held-out evaluation (step, accuracy, correct, total, seconds, of which
  sync_seconds);
- ``run_summary.json`` (last, always): configuration, seed, settings, held-out accuracies, timings and ``status``
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

from .configs import SETTING_KEYS, add_setting_arguments, build_trainer_config, lab_config, resolve_settings

RUN_SUMMARY = "run_summary.json"
LOG_HISTORY = "log_history.jsonl"
HELD_OUT = "held_out.jsonl"
ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
"""The demo's environment defaults: vLLM's engine core in this process, a 1 GiB KV cache."""


def _append_jsonl(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=float) + "\n")


def resolve_model(model: str | None, run_dir: str) -> str:
    """The model folder: ``None`` is the embedded SmolLM2-135M-Instruct, ``"tiny"`` a tiny random Qwen3 saved
    under ``run_dir/tiny-qwen3`` (:func:`triage_trl.testing.save_tiny_qwen3`), anything else a folder or Hub id."""
    if model == "tiny":
        from ..testing import save_tiny_qwen3

        path = os.path.join(run_dir, "tiny-qwen3")
        if not os.path.isfile(os.path.join(path, "config.json")):
            save_tiny_qwen3(path)
        return path
    from ..models import resolve_model_path

    return resolve_model_path(model)


def load_datasets(settings: dict, seed: int):
    """``(train, held_out)`` for the run's task.

    ``reasoning_gym``: items of :data:`~triage_trl.data.DEFAULT_TASK` with seed ``TRAIN_SEED + seed``; the held-out
    slice uses ``HELD_OUT_SEED`` (the same items for every run). ``gsm8k``: the train split (shuffled with ``seed``)
    and the first ``eval_size`` rows of the test split after a ``HELD_OUT_SEED`` shuffle.

    Raises:
        ValueError: another task.
    """
    from ..data import HELD_OUT_SEED, TRAIN_SEED, gsm8k_dataset, reasoning_gym_dataset

    if settings["task"] == "reasoning_gym":
        return (reasoning_gym_dataset(size=settings["train_size"], seed=TRAIN_SEED + seed),
                reasoning_gym_dataset(size=settings["eval_size"], seed=HELD_OUT_SEED))
    if settings["task"] == "gsm8k":
        source = settings.get("data_path") or "openai/gsm8k"
        return (gsm8k_dataset(source, split="train", size=settings["train_size"], seed=seed),
                gsm8k_dataset(source, split="test", size=settings["eval_size"], seed=HELD_OUT_SEED))
    raise ValueError(f"task={settings['task']!r} is not supported by the lab: use 'reasoning_gym' or 'gsm8k'.")


def _callbacks(run_dir: str, evaluate, eval_every: int):
    """TrainerCallbacks: append each log record to ``log_history.jsonl``; evaluate every ``eval_every`` steps."""
    from transformers import TrainerCallback

    class LogWriter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            record = state.log_history[-1] if state.log_history else {**(logs or {}), "step": state.global_step}
            _append_jsonl(os.path.join(run_dir, LOG_HISTORY), record)

    class HeldOutEvaluator(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % eval_every == 0 or state.global_step == state.max_steps:
                evaluate(state.global_step)

    return [LogWriter(), HeldOutEvaluator()]


def run(config_name: str, seed: int, run_dir: str, settings: dict) -> dict:
    """Train and evaluate one (configuration, seed); always writes ``run_summary.json``; returns it.

    A run that raises is recorded with ``status="failed: <ExceptionType>: <message>"``; ``KeyboardInterrupt`` is
    not caught (the run then has no summary and the lab reruns it on resume).

    Raises:
        KeyError: unknown configuration (before anything is written).
    """
    config = lab_config(config_name)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.makedirs(run_dir, exist_ok=True)
    for name in (LOG_HISTORY, HELD_OUT, "error.txt"):  # a rerun starts clean
        if os.path.exists(os.path.join(run_dir, name)):
            os.remove(os.path.join(run_dir, name))
    start = time.perf_counter()
    summary = {"config": config.name, "description": config.description, "seed": seed,
               "settings": {k: settings.get(k) for k in ("scale", *SETTING_KEYS)},
               "overrides": {**settings.get("trainer_overrides", {}), **config.overrides},
               "held_out": [], "status": "running"}
    trainer = None
    timings = {"startup_seconds": math.nan, "train_seconds": math.nan, "eval_seconds": 0.0}
    try:
        import torch

        from ..demo import greedy_accuracy
        from ..rewards import format_reward, verified_answer_reward as accuracy_reward
        from ..trainer import TriageGRPOTrainer

        model_path = resolve_model(settings.get("model"), run_dir)
        summary["model"] = model_path
        train, held_out = load_datasets(settings, seed)
        args = build_trainer_config(config.name, settings, run_dir, seed, settings.get("trainer_overrides"))

        def evaluate(step: int) -> None:
            t0 = time.perf_counter()
            # Also at step 0, so every evaluation goes through the same path (an NVFP4 sync re-exports the learner and
            # recalibrates the sampler's activation scales); it also takes the first sync's warm-up out of step 1.
            trainer.sync_sampler()  # the latest optimizer step's weights (and, NVFP4, the learner's scales)
            t1 = time.perf_counter()
            result = greedy_accuracy(trainer, held_out, settings["max_completion_length"])
            seconds = time.perf_counter() - t0
            timings["eval_seconds"] += seconds
            record = {"step": step, "accuracy": result.accuracy, "correct": result.correct, "total": result.total,
                      "seconds": seconds, "sync_seconds": t1 - t0}
            summary["held_out"].append(record)
            _append_jsonl(os.path.join(run_dir, HELD_OUT), record)

        threads = torch.get_num_threads()  # in-process vLLM on CPU leaves torch one thread
        trainer = TriageGRPOTrainer(model=model_path, reward_funcs=[accuracy_reward, format_reward], args=args,
                                    train_dataset=train,
                                    callbacks=_callbacks(run_dir, evaluate, settings["eval_every"]))
        torch.set_num_threads(threads)
        timings["startup_seconds"] = time.perf_counter() - start
        evaluate(0)
        train_start = time.perf_counter()
        trainer.train()
        timings["train_seconds"] = time.perf_counter() - train_start
        if summary["held_out"][-1]["step"] != trainer.state.global_step:  # e.g. stopped early
            evaluate(trainer.state.global_step)
        summary["status"] = "ok"
    except Exception as err:  # recorded, not lost: the lab goes on with the next run
        summary["status"] = f"failed: {type(err).__name__}: {err}".strip()
        with open(os.path.join(run_dir, "error.txt"), "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        logging.getLogger(__name__).error("Run %s seed %d failed", config_name, seed, exc_info=True)
    finally:
        summary.update(_finish(trainer, run_dir))
    summary.update(timings)
    summary["steps"] = trainer.state.global_step if trainer is not None else 0
    summary["wall_seconds"] = time.perf_counter() - start
    with open(os.path.join(run_dir, RUN_SUMMARY), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=float)
    return summary


def _finish(trainer, run_dir: str) -> dict:
    """Save ``trainer_state.json`` and the report plots (when there is a trainer); drop the sampler checkpoint."""
    out = {"plots": []}
    if trainer is not None:
        try:
            trainer.state.save_to_json(os.path.join(run_dir, "trainer_state.json"))
            from ..report import write_plots

            out["plots"] = [os.path.basename(p) for p in write_plots(run_dir)]
        except (OSError, ValueError) as err:  # e.g. no training record: the summary says why there are no plots
            out["plots_error"] = f"{type(err).__name__}: {err}"
    shutil.rmtree(os.path.join(run_dir, "sampler_checkpoint"), ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    """Command line of one run; exits 0 whenever ``run_summary.json`` was written (read its ``status``)."""
    parser = argparse.ArgumentParser(prog="python -m triage_trl.lab.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a configuration name of triage_trl.lab.configs")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    add_setting_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    summary = run(args.config, args.seed, args.run_dir, resolve_settings(args))
    print(f"{args.config} seed {args.seed}: {summary['status']} ({summary['wall_seconds']:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
