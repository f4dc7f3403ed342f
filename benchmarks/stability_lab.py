"""The stability lab (``docs/stability.md``): TRIAGE against naive NVFP4, TRL's importance-sampling corrections and bf16.

Runs every (configuration, dose, seed) of ``triage_trl.lab.configs`` on the same model, data, seeds and step
budget: each NVFP4 configuration at every mismatch dose (the NVFP4 layer recipe), the ablations at the ablation
dose, bf16 once. One run at a time, each in its own worker process (``python -m triage_trl.lab.worker``: a fresh
vLLM engine per run), seed-major (every run of the first seed, then the next seed), so a partial lab already has a
full table. Runs whose ``run_summary.json`` exists are skipped (resume: rerun the same command). A worker that dies
without a summary (e.g. killed for memory) is recorded as failed; delete its folder to retry it. At the end it
writes ``results.md``, ``overlay.png`` and ``observations.png`` (``python -m triage_trl.lab.summarize``).

Usage:
    python benchmarks/stability_lab.py [--scale cpu|smoke|gpu] [--output-dir DIR] [--configs A B ...]
        [--seeds 0 1 2] [--doses paper stress] [--ablation-dose paper] [--steps N] [--learning-rate LR]
        [--prompts-per-step P] [--num-generations G] [--eval-size E] [--eval-every K] [--model PATH] [--dry-run]

Layout of DIR: ``lab.json`` (the plan), ``runs/<configuration>@<dose>/seed<S>/`` (bf16: ``runs/bf16/seed<S>/``;
each with ``worker.log``, ``log_history.jsonl``, ``held_out.jsonl``, ``run_summary.json``, ``trainer_state.json``,
``plots/``), ``results.md`` and the plots.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from triage_trl.lab.configs import (PLAN_FILE, SETTING_KEYS, add_setting_arguments, plan_runs, resolve_settings,
                                    run_label, run_path, settings_to_argv)
from triage_trl.lab.worker import RUN_SUMMARY
from triage_trl.runs import TINY_MODEL, resolve_model
from triage_trl.runtime import child_process_env

PLANNED_KEYS = ("scale", *SETTING_KEYS)


def evaluations_per_run(settings: dict) -> int:
    """Held-out evaluations of one run: step 0, every ``eval_every`` steps, and the last step."""
    steps, every = settings["max_steps"], settings["eval_every"]
    return 1 + steps // every + (1 if steps % every else 0)


def estimate_run_seconds(settings: dict) -> float:
    """Estimated wall time of one run (s) from the scale's measured ``estimate`` (start-up, step, evaluation)."""
    est = settings["estimate"]
    return est["startup_s"] + settings["max_steps"] * est["step_s"] + evaluations_per_run(settings) * est["eval_s"]


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _check_plan(lab_dir: str, plan: dict) -> None:
    """Refuse to resume a lab folder made with other run settings (its finished runs would be mixed in)."""
    path = os.path.join(lab_dir, PLAN_FILE)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        old_plan = json.load(f)
    if "doses" not in old_plan:
        raise SystemExit(f"{lab_dir} holds runs made before the mismatch doses (other rewards, beta 0): use another "
                         "--output-dir, or delete the folder to start over.")
    old = old_plan.get("settings", {})
    changed = {k: (old.get(k), plan["settings"].get(k)) for k in PLANNED_KEYS
               if old.get(k) != plan["settings"].get(k)}
    if changed:
        raise SystemExit(f"{lab_dir} holds runs made with other settings {changed} (old, new): use another "
                         "--output-dir, or delete the folder to start over.")


def run_one(config: str, dose: str | None, seed: int, run_dir: str, settings: dict) -> dict:
    """Run the worker for one (configuration, dose, seed) in a subprocess (output to ``run_dir/worker.log``); returns
    its ``run_summary.json``, written here as failed when the worker left none."""
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "triage_trl.lab.worker", "--config", config, "--seed", str(seed),
           "--run-dir", run_dir, *(["--dose", dose] if dose else []), *settings_to_argv(settings)]
    start = time.perf_counter()
    with open(os.path.join(run_dir, "worker.log"), "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_process_env(), check=False).returncode
    path = os.path.join(run_dir, RUN_SUMMARY)
    if not os.path.isfile(path):
        summary = {"config": config, "dose": dose, "seed": seed, "held_out": [],
                   "wall_seconds": time.perf_counter() - start, "status": f"failed: worker exited with code {rc} and no summary (see worker.log)"}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/stability_lab.py", description=__doc__.split("\n\n")[0])
    add_setting_arguments(parser)
    parser.add_argument("--output-dir", default=None, help="lab folder (default runs/stability_lab_<scale>)")
    parser.add_argument("--configs", nargs="+", default=None, help="configuration names (default: all, in order)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds (default: the scale's)")
    parser.add_argument("--doses", nargs="+", default=None, help="mismatch doses of the NVFP4 configurations "
                        "(triage_trl.lab.configs.DOSES; default: the scale's)")
    parser.add_argument("--ablation-dose", default=None, help="the dose of the ablations (default: the scale's)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the estimated time, run nothing")
    args = parser.parse_args(argv)
    settings = resolve_settings(args)
    configs = args.configs or settings["configs"]
    seeds = args.seeds if args.seeds is not None else settings["seeds"]
    doses = args.doses if args.doses is not None else settings["doses"]
    ablation_dose = args.ablation_dose or settings["ablation_dose"]
    if args.ablation_dose is None and ablation_dose not in doses and len(doses) == 1:
        ablation_dose = doses[0]  # one dose given: the ablations run there
    try:
        plan = plan_runs(configs, seeds, doses, ablation_dose)
    except (KeyError, ValueError) as err:
        parser.error(str(err).strip("'\""))
    lab_dir = args.output_dir or os.path.join("runs", f"stability_lab_{args.scale}")
    todo = [r for r in plan if not os.path.isfile(os.path.join(run_path(lab_dir, r[0], r[2], r[1]), RUN_SUMMARY))]
    per_run = estimate_run_seconds(settings)

    print(f"Stability lab: {len(configs)} configurations, doses {doses} (ablations at {ablation_dose!r}), "
          f"{len(seeds)} seeds = {len(plan)} runs ({len(plan) - len(todo)} done, {len(todo)} to run) in {lab_dir}")
    print("Settings: " + ", ".join(f"{k}={settings.get(k)}" for k in PLANNED_KEYS))
    print(f"Estimate: {_minutes(per_run)} per run ({evaluations_per_run(settings)} held-out evaluations), "
          f"{_minutes(per_run * len(todo))} for the {len(todo)} runs to do (scale {args.scale!r} estimate "
          f"{settings['estimate']})")
    if args.dry_run:
        for i, (config, dose, seed) in enumerate(plan, 1):
            done = (config, dose, seed) not in todo
            print(f"  {i:3d}. {run_label(config, dose):<32} seed {seed}{'  (done)' if done else ''}")
        return 0

    os.makedirs(lab_dir, exist_ok=True)
    if settings["model"] == TINY_MODEL:  # built once, shared by every run of the lab
        settings["model"] = os.path.abspath(resolve_model(TINY_MODEL, lab_dir))
    record = {"settings": {k: settings.get(k) for k in (*PLANNED_KEYS, "trainer_overrides")}, "configs": configs,
              "seeds": seeds, "doses": doses, "ablation_dose": ablation_dose,
              "runs": [run_label(c, d) for c, d, s in plan if s == seeds[0]]}
    _check_plan(lab_dir, record)
    with open(os.path.join(lab_dir, PLAN_FILE), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)

    start, times = time.perf_counter(), []
    for i, (config, dose, seed) in enumerate(plan, 1):
        run_dir, label = run_path(lab_dir, config, seed, dose), run_label(config, dose)
        if (config, dose, seed) not in todo:
            print(f"[{i}/{len(plan)}] {label} seed {seed}: done earlier, skipped", flush=True)
            continue
        print(f"[{i}/{len(plan)}] {label} seed {seed}: running ...", flush=True)
        t0 = time.perf_counter()
        summary = run_one(config, dose, seed, run_dir, settings)
        times.append(time.perf_counter() - t0)
        left = len(todo) - len(times)
        eta = left * sum(times) / len(times)
        accuracies = [r["accuracy"] for r in summary.get("held_out", [])]
        acc = f", held-out {accuracies[0]:.1%} -> {accuracies[-1]:.1%}" if accuracies else ""
        print(f"[{i}/{len(plan)}] {label} seed {seed}: {summary['status']}{acc} in {_minutes(times[-1])}; "
              f"elapsed {_minutes(time.perf_counter() - start)}, ETA {_minutes(eta)} ({left} runs left)", flush=True)

    from triage_trl.lab.summarize import main as summarize_main

    summarize_main([lab_dir])
    return 0


if __name__ == "__main__":
    sys.exit(main())
