"""One run harness for the demo, the stability lab and the CLI: which model, the run's logs, held-out evaluations
during training, and what a finished run leaves in its folder.

Every entry point runs inside :func:`triage_trl.runtime.vllm_process_settings` (the in-process vLLM engine's
environment and threads) and ends with :func:`finish_run`: the model and its card, ``trainer_state.json``
(``Trainer.save_state``) and the ``triage-report`` plots.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from transformers import TrainerCallback

from .models.resolve import TINY_MODEL, resolve_model  # noqa: F401  (the documented path of both)
from .runtime.run_logs import LOG_HISTORY

class LogHistoryWriter(TrainerCallback):
    """Append every log record to ``run_dir/log_history.jsonl`` as it is logged."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOG_HISTORY)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            record = state.log_history[-1] if state.log_history else {**(logs or {}), "step": state.global_step}
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, default=float) + "\n")


class HeldOutEvaluator(TrainerCallback):
    """Greedy held-out accuracy of the trainer's sampler at step 0 (:meth:`evaluate`), every ``every`` optimizer steps
    and at the last step; each evaluation syncs the sampler first (``trainer.sync_sampler()``).

    Args:
        dataset: the held-out rows (``triage_trl.eval.held_out.greedy_accuracy``).
        max_tokens: completion length limit.
        every: evaluation interval in optimizer steps (``None``: only at step 0 and at the end).
        on_result: called with a record ``{"step", "accuracy", "standard_error", "correct", "total", "seconds",
            "sync_seconds"}`` and the :class:`~triage_trl.eval.held_out.HeldOutResult`.
    """

    def __init__(self, dataset, max_tokens: int, every: int | None = None, on_result: Callable | None = None):
        self.dataset, self.max_tokens, self.every, self.on_result = dataset, max_tokens, every, on_result
        self.trainer = None
        self.results: list = []
        self.seconds = 0.0

    def evaluate(self, trainer, step: int):
        from .eval.held_out import greedy_accuracy

        t0 = time.perf_counter()
        trainer.sync_sampler()  # the latest optimizer step's weights (and, NVFP4, the learner's scales)
        t1 = time.perf_counter()
        result = greedy_accuracy(trainer, self.dataset, self.max_tokens)
        record = {"step": step, "accuracy": result.accuracy, "standard_error": result.standard_error,
                  "correct": result.correct, "total": result.total, "seconds": time.perf_counter() - t0,
                  "sync_seconds": t1 - t0}
        self.seconds += record["seconds"]
        self.results.append((record, result))
        if self.on_result is not None:
            self.on_result(record, result)
        return result

    def on_step_end(self, args, state, control, **kwargs):
        periodic = self.every is not None and state.global_step % self.every == 0
        if periodic or state.global_step == state.max_steps:
            self.evaluate(self.trainer, state.global_step)


def train_with_held_out(trainer, evaluator: HeldOutEvaluator | None) -> float:
    """Evaluate at step 0, train (evaluating as the evaluator says), and evaluate at the end if training stopped
    early. Returns the training seconds, evaluations excluded."""
    if evaluator is None:
        start = time.perf_counter()
        trainer.train()
        return time.perf_counter() - start
    evaluator.trainer = trainer
    trainer.add_callback(evaluator)
    evaluator.evaluate(trainer, 0)
    before = evaluator.seconds
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start - (evaluator.seconds - before)
    if evaluator.results[-1][0]["step"] != trainer.state.global_step:
        evaluator.evaluate(trainer, trainer.state.global_step)
    return seconds


def finish_run(trainer, *, save_model: bool = True, model_name: str | None = None, dataset_name: str | None = None,
               plots: bool = True) -> dict:
    """What a finished run leaves in ``trainer.args.output_dir``: the run record ``triage-export`` reads
    (``triage_trl.export.run_record``), the model and its card (``save_model``), ``trainer_state.json``
    (``Trainer.save_state``) and the report plots (``plots``). Returns ``{"plots": [file
    names]}``, or ``plots_error`` saying why there are none."""
    from .export.run_record import write_run_record

    output_dir = trainer.args.output_dir
    write_run_record(trainer)
    if save_model:
        trainer.save_model(output_dir)
        trainer.create_model_card(model_name=model_name or os.path.basename(os.path.normpath(output_dir)),
                                  dataset_name=dataset_name)
    trainer.save_state()
    out: dict = {"plots": []}
    if plots and trainer.is_world_process_zero():
        from .report import write_plots

        try:
            out["plots"] = [os.path.basename(p) for p in write_plots(output_dir)]
        except (OSError, ValueError) as err:  # e.g. no training record: say why there are no plots
            out["plots_error"] = f"{type(err).__name__}: {err}"
    return out
