"""One run harness for the demo, the stability lab and the CLI: the demo's recipe (its budget, rewards, LoRA
adapters, ``TriageGRPOConfig`` and data sets) and the trainer built from it, which model, the run's logs, held-out
evaluations during training, and what a finished run leaves in its folder. The demo and the lab call it; no entry
point imports another.

Every entry point runs inside :func:`triage_trl.runtime.vllm_process_settings` (the in-process vLLM engine's
environment and threads) and ends with :func:`finish_run`: the model and its card, ``trainer_state.json``
(``Trainer.save_state``) and the ``triage-report`` plots.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Callable, Iterator

from transformers import TrainerCallback

from .models.resolve import TINY_MODEL, resolve_model  # noqa: F401  (the documented path of both)
from .runtime.run_logs import LOG_HISTORY

# Measured on the 2-core CPU (quiet machine): 12 steps took 6.7 min in all (steps of 23-33 s, 5.5 min of
# training; 128 held-out items greedy before and after, ~15 s each). On a CPU without bf16 instructions (AVX2 only)
# steps take 45-90 s. With other jobs on the 2 cores, steps were measured 5-10x slower (OpenMP threads contending).
# nvfp4_recipe="paper": the NVFP4 layers of published NVFP4 RL (the stability lab's `paper` dose; docs/nvfp4.md).
# beta=0.04: the k3 KL to the reference model anchors the policy; measured with these settings (128 held-out items):
# greedy accuracy 63.3% -> 59.4% (-3.9 +- 3.9 points) with it, 63.3% -> 39.8% (-23.4 +- 4.4) with beta 0.
# lora_rank=16, learning_rate=1e-4: LoRA adapters on every decoder linear instead of full fine-tuning. Measured with
# these settings and the former one-shot example (a positive answer), seed 0, 128 held-out items (docs/stability.md,
# "Earlier lab rounds"): full fine-tuning at lr 1e-5 -3.9 +- 3.9 points (AVX2 CPU); LoRA at lr
# 5e-5 / 1e-4 / 2e-4 +3.9 +- 3.4 / +7.0 +- 3.7 / +0.0 +- 3.3 (AVX512-BF16 CPU). With today's example (a negative
# answer, triage_trl.data.reasoning_gym) it gained on three seeds of three: +19.5 +- 4.7 points on seed 0 (the
# demo's), +4.7 and +7.8 on seeds 1 and 2 (docs/stability.md, "Earlier lab rounds").
DEMO_DEFAULTS = dict(
    max_steps=12,
    prompts_per_step=2,
    num_generations=8,
    max_completion_length=32,
    temperature=0.7,
    learning_rate=1e-4,
    lora_rank=16,
    train_size=256,
    eval_size=128,
    nvfp4_recipe="paper",
    beta=0.04,
    sync_probe_every=8,
)
REWARD_WEIGHTS = (1.0, 0.2)
"""Weights of :func:`demo_rewards`: the verified answer, and ending with the boxed answer (the demo and the lab)."""


def demo_rewards() -> list:
    """The reward functions of the demo and the stability lab: ``verified_answer_reward`` (1.0 for a correct final
    answer) and ``answer_then_stop_reward`` (1.0 when the completion ends with its boxed answer), weighted by
    :data:`REWARD_WEIGHTS`. Without the second, GRPO on SmolLM2-135M grows text after the answer until completions
    reach the length limit (measured: mean completion length 20 -> 31 tokens in 8 steps, and the learner-sampler k3
    rose to 1.2 nats/token on that text); with it they stayed at 21-23 tokens."""
    from .answers.rewards import answer_then_stop_reward, verified_answer_reward

    return [verified_answer_reward, answer_then_stop_reward]


def lora_config(rank: int):
    """The demo's and the lab's LoRA adapters (peft ``LoraConfig``), or ``None`` for full fine-tuning (``rank`` 0).

    Rank ``rank`` on every decoder linear (``"all-linear"``: q/k/v/o and gate/up/down, not ``lm_head``), alpha
    ``2 x rank``, no dropout (dropout would make the learner's log-probs differ from the sampler's). Under NVFP4 the
    learner runs the adapters in full precision beside its NVFP4 base layer and the sampler serves the merged weight
    re-quantised at every sync (``docs/nvfp4.md``, "LoRA adapters"); the gap is part of the measured
    learner-sampler mismatch.

    Raises:
        ValueError: a negative ``rank``.
    """
    if rank < 0:
        raise ValueError(f"lora_rank={rank} is invalid: use 0 (full fine-tuning) or a positive rank.")
    if rank == 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")


def build_config(output_dir: str, *, max_steps: int, prompts_per_step: int, num_generations: int,
                 max_completion_length: int, temperature: float, learning_rate: float, seed: int = 0,
                 nvfp4_recipe: str = "all", beta: float = 0.04, **overrides):
    """The demo's ``TriageGRPOConfig``: TRIAGE full, NVFP4 sampler and learner, CPU, colocated vLLM.

    ``overrides`` are any ``TriageGRPOConfig`` fields; they win over the demo's values (e.g. the stability lab's
    ``learner_precision="bf16"``, ``triage_mode="diagnose"``).
    """
    from .trainer import TriageGRPOConfig

    settings = dict(
        output_dir=output_dir,
        triage_mode="full",
        learner_precision="nvfp4",
        sampler_precision="nvfp4",
        nvfp4_recipe=nvfp4_recipe,
        nvfp4_calibration_prompts=4,
        # Measured on SmolLM2-135M (56-token probe): NVFP4 learner vs NVFP4 sampler differ by 0.5-1.0 nats/token
        # (W4A4: activation codes rounded apart); 2.0 still catches a stale or corrupt sync. The default for W4A4
        # engines since 2026-12-05 (sync_probe.PROBE_FLOOR_W4A4), kept explicit for the lab's recorded settings.
        sync_probe_max_gap=2.0,
        # The first sync and every 8th are probed: a probe costs about as much as the sync itself (0.25-0.34 s, 4% of
        # a 7 s demo step on a 2-core AVX512-BF16 EPYC; docs/scale.md), so every 4th would keep the two above 5% of the
        # step; a sampler that stays stale is caught within 8 syncs, the batch's learner-sampler gap is logged at
        # every step, and the probe draws no random number (the schedule changes no rollout).
        sync_probe_every=DEMO_DEFAULTS["sync_probe_every"],
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": "float32"},
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=False,
        vllm_max_model_length=512,
        per_device_train_batch_size=prompts_per_step * num_generations,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        temperature=temperature,
        loss_type="dapo",
        beta=beta,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=max_steps,
        reward_weights=list(REWARD_WEIGHTS),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        gradient_checkpointing=False,
        seed=seed,
    )
    settings.update(overrides)
    return TriageGRPOConfig(**settings)


LARGE_TASKS = ("chain_sum_2d", "chain_lines")
"""Tasks with a large item space (``triage_trl.data.reasoning_gym``: ``TWO_DIGIT_TASK``, ``CHAIN_LINES_TASK``): their
held-out slice is disjoint from the training items (:func:`disjoint_held_out`)."""
SEEDS_CHECKED = 8
"""A large task's held-out slice leaves out the items of the training sets of seeds 0..7 (any lab seed below 8 trains
on none of its held-out items)."""


def _large_task(name: str) -> tuple[dict, tuple[str, str]]:
    from .data.reasoning_gym import CHAIN_LINES_EXAMPLE, CHAIN_LINES_TASK, RG_ARITHMETIC_EXAMPLE, TWO_DIGIT_TASK

    return {"chain_sum_2d": (TWO_DIGIT_TASK, RG_ARITHMETIC_EXAMPLE),
            "chain_lines": (CHAIN_LINES_TASK, CHAIN_LINES_EXAMPLE)}[name]


def disjoint_held_out(held_out, settings: dict, task: dict, example, size: int):
    """The first ``size`` rows of ``held_out`` whose prompt is in none of the training sets of seeds
    ``0..SEEDS_CHECKED - 1``.

    Raises:
        ValueError: fewer than ``size`` such rows (the item space is too small for a disjoint slice).
    """
    from .data import TRAIN_SEED, reasoning_gym_dataset

    seen = set()
    for s in range(SEEDS_CHECKED):
        seen.update(repr(p) for p in reasoning_gym_dataset(task, size=settings["train_size"], seed=TRAIN_SEED + s,
                                                             example=example)["prompt"])
    keep = [i for i, p in enumerate(held_out["prompt"]) if repr(p) not in seen][:size]
    if len(keep) < size:
        raise ValueError(f"Only {len(keep)} of {len(held_out)} held-out items are outside the training items: lower "
                         f"--eval-size (now {size}) or --train-size.")
    return held_out.select(keep)


def recipe_datasets(settings: dict, seed: int, calibration_size: int):
    """``(train, held_out, calibration)`` for the run's task.

    ``reasoning_gym``: items of :data:`~triage_trl.data.DEFAULT_TASK` (``chain_sum_2d``, ``chain_lines``: the
    :data:`LARGE_TASKS`, with a held-out slice disjoint from training) with seed ``TRAIN_SEED + seed``; the held-out
    slice uses ``HELD_OUT_SEED`` (the same items for every run). ``gsm8k``: the train split (shuffled with ``seed``)
    and the first ``eval_size`` rows of the test split after a ``HELD_OUT_SEED`` shuffle. ``calibration``: the
    NVFP4 calibration prompts, ``calibration_size`` training items drawn with ``CALIBRATION_SEED`` whatever ``seed``
    (the first items of seed 0's training set), so every seed's sampler gets the same activation scales.

    Raises:
        ValueError: another task.
    """
    from .data import CALIBRATION_SEED, HELD_OUT_SEED, TRAIN_SEED, gsm8k_dataset, reasoning_gym_dataset

    if settings["task"] in ("reasoning_gym", *LARGE_TASKS):
        from .data.reasoning_gym import RG_ARITHMETIC_EXAMPLE

        large = settings["task"] in LARGE_TASKS
        task, example = _large_task(settings["task"]) if large else (None, RG_ARITHMETIC_EXAMPLE)
        train = reasoning_gym_dataset(task, size=settings["train_size"], seed=TRAIN_SEED + seed, example=example)
        held_out = reasoning_gym_dataset(task, size=settings["eval_size"] * (2 if large else 1), seed=HELD_OUT_SEED,
                                         example=example)
        if large:  # the held-out slice keeps only items no training seed of the lab draws
            held_out = disjoint_held_out(held_out, settings, task, example, settings["eval_size"])
        return (train, held_out,
                reasoning_gym_dataset(task, size=calibration_size, seed=CALIBRATION_SEED, example=example))
    if settings["task"] == "gsm8k":
        source = settings.get("data_path") or "openai/gsm8k"
        return (gsm8k_dataset(source, split="train", size=settings["train_size"], seed=seed),
                gsm8k_dataset(source, split="test", size=settings["eval_size"], seed=HELD_OUT_SEED),
                gsm8k_dataset(source, split="train", size=calibration_size, seed=CALIBRATION_SEED))
    raise ValueError(f"task={settings['task']!r} is not supported by the recipe: use 'reasoning_gym', 'chain_sum_2d', "
                     "'chain_lines' or 'gsm8k'.")


def build_recipe_trainer(model_path: str, args, settings: dict, seed: int, *, callbacks: list | None = None):
    """The demo's and the lab's trainer: ``TriageGRPOTrainer`` on :func:`recipe_datasets` with :func:`demo_rewards`
    and :func:`lora_config` ``(settings["lora_rank"])``.

    Args:
        model_path: a resolved model (:func:`resolve_model`). args: the ``TriageGRPOConfig`` (:func:`build_config`).
        settings: ``task``, ``train_size``, ``eval_size``, ``lora_rank`` (0 or absent: full fine-tuning) and, for
            ``gsm8k``, ``data_path``. seed: the training draw's seed. callbacks: extra ``TrainerCallback`` objects.

    Returns:
        ``(trainer, train_dataset, held_out_dataset)``.
    """
    from .trainer import TriageGRPOTrainer

    train, held_out, calibration = recipe_datasets(settings, seed, args.nvfp4_calibration_prompts)
    trainer = TriageGRPOTrainer(model=model_path, reward_funcs=demo_rewards(), args=args, train_dataset=train,
                                calibration_dataset=calibration, callbacks=callbacks,
                                peft_config=lora_config(settings.get("lora_rank") or 0))
    return trainer, train, held_out


class LogHistoryWriter(TrainerCallback):
    """Append every log record to ``run_dir/log_history.jsonl`` as it is logged."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOG_HISTORY)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            record = state.log_history[-1] if state.log_history else {**(logs or {}), "step": state.global_step}
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, default=float) + "\n")


@contextlib.contextmanager
def training_random_state_kept(device) -> Iterator[None]:
    """Python's, NumPy's and torch's random generators (CPU, and ``device`` when it is a GPU) as they were on entry, on
    exit: a held-out evaluation between optimizer steps leaves the training's random stream (rollouts drawn by the
    sampler from torch's generator, data order) as it found it, so a run that measures its step-0 evaluation and one
    that reuses another run's (``HeldOutEvaluator.reuse``) roll out alike, and arms with the same engines start from
    the same rollouts (common random numbers)."""
    import numpy as np
    import torch

    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if getattr(device, "type", "cpu") == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


class HeldOutEvaluator(TrainerCallback):
    """Greedy held-out accuracy of the trainer's sampler at step 0 (:meth:`evaluate`), every ``every`` optimizer steps
    and at the last step; each evaluation syncs the sampler first (``trainer.sync_sampler()``) and leaves the random
    generators as it found them (:func:`training_random_state_kept`).

    Args:
        dataset: the held-out rows (``triage_trl.eval.held_out.greedy_accuracy``).
        max_tokens: completion length limit.
        every: evaluation interval in optimizer steps (``None``: only at step 0 and at the end).
        on_result: called with a record ``{"step", "accuracy", "standard_error", "correct", "total", "outcomes"
            (0/1 per item), "seconds", "sync_seconds"}`` (with ``samples``: also ``"avg_at_<samples>"``,
            ``"sample_temperature"`` and ``"item_scores"``, each item's share of correct samples) and the
            :class:`~triage_trl.eval.held_out.HeldOutResult`.
        samples: avg@``samples`` beside the greedy accuracy at each evaluation (0: greedy only), sampled at
            ``temperature`` (``triage_trl.eval.held_out.sampled_accuracy``), on the first ``sampled_items`` items
            (``None``: all; sampling n per item costs n greedy passes).
        learner: also score the learner's own weights (``triage_trl.eval.held_out.learner_accuracy``, transformers
            ``generate``): the record gains ``"learner_accuracy"``, ``"learner_outcomes"`` and, with ``samples``,
            ``"learner_avg_at_<samples>"`` and ``"learner_item_scores"`` (for a full-precision learner trained with
            an NVFP4 sampler, the weights without the sampler's quantisation cost).
    """

    def __init__(self, dataset, max_tokens: int, every: int | None = None, on_result: Callable | None = None, *,
                 samples: int = 0, temperature: float = 1.0, sampled_items: int | None = None, learner: bool = False):
        self.dataset, self.max_tokens, self.every, self.on_result = dataset, max_tokens, every, on_result
        self.samples, self.temperature, self.learner = samples, temperature, learner
        self.sampled = dataset if sampled_items is None else dataset.select(range(min(sampled_items, len(dataset))))
        self.trainer = None
        self.results: list = []
        self.seconds = 0.0

    def evaluate(self, trainer, step: int):
        with training_random_state_kept(trainer.accelerator.device):
            return self._evaluate(trainer, step)

    def _evaluate(self, trainer, step: int):
        from .eval.held_out import greedy_accuracy

        t0 = time.perf_counter()
        trainer.sync_sampler()  # the latest optimizer step's weights (and, NVFP4, the learner's scales)
        t1 = time.perf_counter()
        result = greedy_accuracy(trainer, self.dataset, self.max_tokens)
        record = {"step": step, "accuracy": result.accuracy, "standard_error": result.standard_error,
                  "correct": result.correct, "total": result.total, "outcomes": [int(o) for o in result.outcomes]}
        if self.samples:
            from .eval.held_out import sampled_accuracy

            sampled = sampled_accuracy(trainer, self.sampled, self.max_tokens, n=self.samples,
                                       temperature=self.temperature)
            record.update({f"avg_at_{self.samples}": sampled.accuracy, "sample_temperature": self.temperature,
                           "item_scores": sampled.item_scores})
        if self.learner:
            record.update(self._learner_record(trainer))
        record.update({"seconds": time.perf_counter() - t0, "sync_seconds": t1 - t0})
        self.seconds += record["seconds"]
        self.results.append((record, result))
        if self.on_result is not None:
            self.on_result(record, result)
        return result

    def _learner_record(self, trainer) -> dict:
        from .eval.held_out import learner_accuracy

        greedy = learner_accuracy(trainer, self.dataset, self.max_tokens, seed=trainer.args.seed)
        record = {"learner_accuracy": greedy.accuracy, "learner_outcomes": [int(o) for o in greedy.outcomes]}
        if self.samples:
            sampled = learner_accuracy(trainer, self.sampled, self.max_tokens, n=self.samples,
                                       temperature=self.temperature, seed=trainer.args.seed)
            record.update({f"learner_avg_at_{self.samples}": sampled.accuracy,
                           "learner_item_scores": sampled.item_scores})
        return record

    def reuse(self, record: dict) -> None:
        """Take an evaluation measured by another run from the same starting point (``triage_trl.lab.step0``) as this
        run's: recorded and passed to ``on_result`` (with ``None`` for the result object), no sampler pass."""
        self.results.append((record, None))
        if self.on_result is not None:
            self.on_result(record, None)

    def evaluated(self, step: int) -> bool:
        return any(record["step"] == step for record, _ in self.results)

    def on_step_end(self, args, state, control, **kwargs):
        periodic = self.every is not None and state.global_step % self.every == 0
        if periodic or state.global_step == state.max_steps:
            self.evaluate(self.trainer, state.global_step)


def train_with_held_out(trainer, evaluator: HeldOutEvaluator | None, resume_from_checkpoint: str | None = None) -> float:
    """Evaluate at step 0 (not when resuming: the run did; nor when the evaluator already holds a step-0 record,
    ``HeldOutEvaluator.reuse``), train (evaluating as the evaluator says), and evaluate at
    the end if training stopped early. Returns the training seconds, evaluations excluded."""
    if evaluator is None:
        start = time.perf_counter()
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
        return time.perf_counter() - start
    evaluator.trainer = trainer
    trainer.add_callback(evaluator)
    if resume_from_checkpoint is None and not evaluator.evaluated(0):
        evaluator.evaluate(trainer, 0)
    before = evaluator.seconds
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    seconds = time.perf_counter() - start - (evaluator.seconds - before)
    if not evaluator.results or evaluator.results[-1][0]["step"] != trainer.state.global_step:
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
