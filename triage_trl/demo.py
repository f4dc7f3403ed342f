"""``make demo`` / ``python -m triage_trl.demo``: TRIAGE-GRPO on a real pretrained model and real tasks, on a CPU.

Trains the embedded default, SmolLM2-135M-Instruct (``triage_trl.models``), with TRIAGE (``triage_mode="full"``),
an NVFP4 colocated vLLM sampler and an NVFP4 learner (:class:`~triage_trl.trainer.TriageGRPOTrainer`), on
reasoning-gym arithmetic (:data:`triage_trl.data.DEFAULT_TASK`, no network) with the verified accuracy reward.
It writes into ``--output-dir``: the model and its card (``README.md``), ``trainer_state.json`` (TRL's log
history, every ``triage/`` metric per step), ``demo_summary.json`` and the plots of ``triage-report``; and prints
a table: greedy held-out accuracy before and after training, steps, time, and the mismatch summary.

The held-out slice is items of the same task drawn with another seed (:data:`~triage_trl.data.HELD_OUT_SEED`),
answered greedily by the run's own sampler (the NVFP4 vLLM engine, synced to the final learner weights): the
accuracy of the policy TRIAGE trains and serves.

Defaults (``DEMO_DEFAULTS``) were chosen so the whole run takes under 20 minutes on a 2-core CPU; ``--quick``
(2 steps, small held-out slice) is the CI smoke run.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time

# The recipe lives in the library (runs.py); its names stay importable from here, where the docs point.
from .runs import DEMO_DEFAULTS, REWARD_WEIGHTS, build_config, demo_rewards, lora_config  # noqa: F401
from .runtime import vllm_process_settings

QUICK = dict(max_steps=2, eval_size=8, prompts_per_step=2, num_generations=4, train_size=16, sync_probe_every=1)


def run_demo(output_dir: str = "runs/demo", *, model: str | None = None, quick: bool = False, seed: int = 0,
             plots: bool = True, **overrides) -> dict:
    """Train, evaluate before/after, save model/card/log/plots; returns the summary dict (also saved as JSON).

    Args:
        output_dir: run folder (created). A folder holding an earlier run is moved aside first, to
            ``<output_dir>.previous-<N>`` (the trainer refuses a new run into a folder that holds one), so ``make demo``
            can run again and loses nothing.
        model: ``None`` for the embedded default SmolLM2-135M-Instruct, or a local folder / Hub id.
        quick: the CI smoke settings (:data:`QUICK`) instead of :data:`DEMO_DEFAULTS`.
        overrides: any :data:`DEMO_DEFAULTS` key.

    Raises:
        ValueError: an unknown override.
    """
    settings = {**DEMO_DEFAULTS, **(QUICK if quick else {})}
    unknown = set(overrides) - set(settings)
    if unknown:
        raise ValueError(f"Unknown demo settings {sorted(unknown)}: use {sorted(settings)}.")
    settings.update({k: v for k, v in overrides.items() if v is not None})
    with vllm_process_settings():
        return _run(output_dir, model, seed, plots, settings)


def _move_earlier_run_aside(output_dir: str) -> str | None:
    """Rename a folder holding an earlier run to the first free ``<output_dir>.previous-<N>``; returns its new name."""
    from .runtime.run_folder import existing_run

    if not existing_run(output_dir):
        return None
    n = 1
    while os.path.exists(f"{output_dir}.previous-{n}"):
        n += 1
    os.rename(output_dir, f"{output_dir}.previous-{n}")
    print(f"{output_dir} held an earlier run: moved to {output_dir}.previous-{n}", flush=True)
    return f"{output_dir}.previous-{n}"


def _run(output_dir: str, model: str | None, seed: int, plots: bool, settings: dict) -> dict:
    from .eval.held_out import items_won_lost, paired_difference, shared_prompts
    from .runs import HeldOutEvaluator, build_recipe_trainer, finish_run, resolve_model, train_with_held_out
    from .trainer.model_card import mismatch_summary

    start = time.perf_counter()
    _move_earlier_run_aside(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    model_path = resolve_model(model, output_dir)
    config = build_config(
        output_dir,
        seed=seed,
        **{k: settings[k] for k in ("max_steps", "prompts_per_step", "num_generations", "max_completion_length",
                                    "temperature", "learning_rate", "nvfp4_recipe", "beta", "sync_probe_every")},
    )
    trainer, train, held_out = build_recipe_trainer(model_path, config, {**settings, "task": "reasoning_gym"}, seed)
    evaluator = HeldOutEvaluator(held_out, settings["max_completion_length"])
    train_seconds = train_with_held_out(trainer, evaluator)
    before, after = evaluator.results[0][1], evaluator.results[-1][1]
    gain, gain_se = paired_difference(before, after)
    won, lost = items_won_lost(before, after)
    finished = finish_run(trainer, dataset_name="reasoning-gym", plots=plots)
    first_last = mismatch_summary(trainer.state.log_history)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    summary = {
        "model": model_path if model else "SmolLM2-135M-Instruct (embedded)",
        "task": "reasoning_gym", "settings": settings,
        "accuracy_before": before.accuracy, "accuracy_after": after.accuracy,
        "standard_error_before": before.standard_error, "standard_error_after": after.standard_error,
        "accuracy_gain": gain, "accuracy_gain_se": gain_se, "items_won": won, "items_lost": lost,
        "held_out_in_train": shared_prompts(held_out, train),
        "correct_before": before.correct, "correct_after": after.correct, "held_out": before.total,
        "steps": trainer.state.global_step, "train_seconds": train_seconds,
        "zero_signal_frac": _mean(h.get("triage/zero_signal_frac") for h in logs),
        "reward_first": logs[0]["reward"] if logs else math.nan, "reward_last": logs[-1]["reward"] if logs else math.nan,
        "sync_probe_gap_max": max(trainer.sync_probe_gaps, default=math.nan),
        "sync_probes": len(trainer.sync_probe_gaps),
        "mismatch_first": first_last[0] if first_last else None, "mismatch_last": first_last[1] if first_last else None,
        "examples_after": after.completions[:3],
        **finished,
    }
    summary["total_seconds"] = time.perf_counter() - start
    with open(os.path.join(output_dir, "demo_summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=float)
    print(format_table(summary))
    return summary


def _trained_weights(settings: dict) -> str:
    rank = settings["lora_rank"]
    text = f"LoRA rank {rank} on every decoder linear" if rank else "all (full fine-tuning)"
    return f"{text}, learning rate {settings['learning_rate']:g}"


def _mean(values) -> float:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else math.nan


def format_table(summary: dict) -> str:
    """The short table the demo prints (plain text)."""
    rows = [
        ("held-out accuracy before (greedy)", f"{summary['accuracy_before']:.1%} ± {summary['standard_error_before']:.1%} "
         f"({summary['correct_before']}/{summary['held_out']})"),
        ("held-out accuracy after (greedy)", f"{summary['accuracy_after']:.1%} ± {summary['standard_error_after']:.1%} "
         f"({summary['correct_after']}/{summary['held_out']})"),
        ("change, paired (± standard error)", f"{summary['accuracy_gain']:+.1%} ± {summary['accuracy_gain_se']:.1%} "
         f"(items won {summary['items_won']}, lost {summary['items_lost']})"),
        ("held-out questions also among the training items", f"{summary['held_out_in_train']}/{summary['held_out']}"),
        ("NVFP4 recipe (learner and sampler)", str(summary.get("settings", {}).get("nvfp4_recipe", "n/a"))),
        ("trained weights", _trained_weights(summary["settings"])),
        ("optimizer steps", str(summary["steps"])),
        ("training time", f"{summary['train_seconds'] / 60:.1f} min"),
        ("total time", f"{summary.get('total_seconds', math.nan) / 60:.1f} min"),
        ("mean train reward first -> last step", f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}"),
        ("groups with zero reward spread (mean)", f"{summary['zero_signal_frac']:.1%}"),
        ("sync probe mean gap, largest probe (nats)", f"{summary['sync_probe_gap_max']:.3f}"),
    ]
    first, last = summary.get("mismatch_first"), summary.get("mismatch_last")
    if first and last:
        for name in ("gap_abs_mean", "k3_kl", "amp_imbalance", "repaired_frac"):
            rows.append((f"triage/{name} step {first['step']} -> {last['step']}", f"{first[name]:.4g} -> {last[name]:.4g}"))
    width = max(len(r[0]) for r in rows)
    lines = ["", "TRIAGE demo: SmolLM2-135M-Instruct, NVFP4 sampler + NVFP4 learner, reasoning-gym arithmetic", ""]
    lines += [f"  {name.ljust(width)}  {value}" for name, value in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    """Command line of the demo (``make demo``)."""
    parser = argparse.ArgumentParser(prog="python -m triage_trl.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="runs/demo")
    parser.add_argument("--model", default=None, help="Local folder or Hub id (default: embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: 2 steps, 8 held-out items.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", action="store_true")
    for key, value in DEMO_DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None, help=f"default {value}")
    args = vars(parser.parse_args(argv))
    logging.basicConfig(level=logging.WARNING)
    return run_demo(args.pop("output_dir"), model=args.pop("model"), quick=args.pop("quick"), seed=args.pop("seed"),
                    plots=not args.pop("no_plots"), **args)


if __name__ == "__main__":
    main()
