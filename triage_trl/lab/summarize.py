"""``python -m triage_trl.lab.summarize LAB_DIR``: the stability lab's results table, overlay and observations.

Reads every finished run (``LAB_DIR/runs/<config>/seed<S>/run_summary.json`` and its ``log_history.jsonl``) and
writes into LAB_DIR:

- ``results.md``: one row per configuration, mean ± std over seeds (rules from :mod:`triage_trl.lab.metrics`,
  printed under the table), the configurations' descriptions, one row per run, and the paper's observations
  measured on ``nvfp4_naive`` (NA vs PA tail-token counts over the first steps, tail concentration per step);
- ``overlay.png``: reward and k3 KL against the optimizer step for all configurations (:mod:`.plots`);
- ``observations.png``: the observations' curves.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os

from ..run_logs import read_log_history
from .configs import CONFIGS, PLAN_FILE
from .metrics import format_mean_std, rules_text, run_metrics, step_series
from .plots import write_observations, write_overlay

RESULTS = "results.md"
OBSERVED_CONFIG = "nvfp4_naive"
OBS_FIRST_STEPS = 5
"""The "first steps" of the observations: NA vs PA tail counts are totalled over steps 1..OBS_FIRST_STEPS."""


def load_history(run_dir: str) -> list[dict]:
    """A run's log records (``triage_trl.runs.read_log_history``), or ``[]`` for a run that logged nothing."""
    try:
        return read_log_history(run_dir)
    except FileNotFoundError:
        return []


def load_runs(lab_dir: str) -> dict[str, list[dict]]:
    """Finished runs by configuration (registry order, then unknown names sorted), each sorted by seed:
    ``{"seed", "dir", "summary", "history", "metrics"}``."""
    runs: dict[str, list[dict]] = {}
    for path in glob.glob(os.path.join(lab_dir, "runs", "*", "seed*", "run_summary.json")):
        run_dir = os.path.dirname(path)
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        history = load_history(run_dir)
        config = summary.get("config") or os.path.basename(os.path.dirname(run_dir))
        runs.setdefault(config, []).append({"seed": summary.get("seed"), "dir": run_dir, "summary": summary,
                                            "history": history, "metrics": run_metrics(summary, history)})
    order = [c for c in CONFIGS if c in runs] + sorted(c for c in runs if c not in CONFIGS)
    return {c: sorted(runs[c], key=lambda r: (r["seed"] is None, r["seed"])) for c in order}


def _load_plan(lab_dir: str) -> dict:
    path = os.path.join(lab_dir, PLAN_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _table(runs: dict[str, list[dict]], planned: list[str]) -> list[str]:
    header = ("| configuration | seeds | held-out acc. final (%) | held-out acc. best (%) | reward AUC | "
              "k3 KL max (nats) | k3 KL final (nats) | grad-norm spikes | collapsed | failed | wall (min) |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for name in planned + [c for c in runs if c not in planned]:
        rows = runs.get(name, [])
        if not rows:
            lines.append(f"| {name} | 0 | no finished run |" + " |" * 8)
            continue
        m = [r["metrics"] for r in rows]
        n = len(rows)
        cells = [format_mean_std([x["final_acc"] * 100 for x in m], ".1f"),
                 format_mean_std([x["best_acc"] * 100 for x in m], ".1f"),
                 format_mean_std([x["reward_auc"] for x in m]),
                 format_mean_std([x["k3_max"] for x in m], ".4f"),
                 format_mean_std([x["k3_final"] for x in m], ".4f"),
                 format_mean_std([x["spikes"] for x in m], ".1f"),
                 f"{sum(x['collapsed'] for x in m)}/{n}", f"{sum(x['failed'] for x in m)}/{n}",
                 format_mean_std([x["wall_min"] for x in m], ".1f")]
        lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    return lines


def _per_run(runs: dict[str, list[dict]]) -> list[str]:
    lines = ["| configuration | seed | status | steps | held-out acc. step 0 -> final (%) | reward AUC | "
             "k3 KL final | spikes | collapsed | wall (min) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in runs.items():
        for r in rows:
            m, status = r["metrics"], r["summary"].get("status", "missing").replace("|", "/").replace("\n", " ")
            lines.append(f"| {name} | {r['seed']} | {status[:120]} | {m['steps']} | "
                         f"{_num(m['step0_acc'] * 100, '.1f')} -> {_num(m['final_acc'] * 100, '.1f')} | "
                         f"{_num(m['reward_auc'], '.3f')} | {_num(m['k3_final'], '.4f')} | {m['spikes']} | "
                         f"{'yes' if m['collapsed'] else 'no'} | {_num(m['wall_min'], '.1f')} |")
    return lines


def observations(histories: list[list[dict]], first_steps: int = OBS_FIRST_STEPS) -> dict:
    """The paper's observations on one configuration's seeds.

    Returns:
        ``per_step``: ``[{"step", "NA", "PA", "concentration"}]`` (means over seeds of ``triage/tail_count_NA``,
        ``tail_count_PA``, ``tail_concentration``); ``na_first``, ``pa_first``: those counts summed over steps
        1..``first_steps`` (mean over seeds); ``concentration_mean``: mean of the per-step concentration.
    """
    def mean_by_step(key):
        by_step: dict[int, list[float]] = {}
        for history in histories:
            for step, value in zip(*step_series(history, key)):
                if math.isfinite(value):
                    by_step.setdefault(step, []).append(value)
        return {s: sum(v) / len(v) for s, v in by_step.items()}

    na, pa = mean_by_step("triage/tail_count_NA"), mean_by_step("triage/tail_count_PA")
    conc = mean_by_step("triage/tail_concentration")
    steps = sorted(set(na) | set(pa) | set(conc))
    per_step = [{"step": s, "NA": na.get(s, math.nan), "PA": pa.get(s, math.nan),
                 "concentration": conc.get(s, math.nan)} for s in steps]
    early = [s for s in steps if s <= first_steps]
    concentrations = [v for v in conc.values() if math.isfinite(v)]
    return {"per_step": per_step, "na_first": sum(na.get(s, 0.0) for s in early),
            "pa_first": sum(pa.get(s, 0.0) for s in early), "first_steps": len(early),
            "concentration_mean": sum(concentrations) / len(concentrations) if concentrations else math.nan}


def _observations_md(obs: dict, n_seeds: int) -> list[str]:
    na, pa = obs["na_first"], obs["pa_first"]
    share = na / (na + pa) if na + pa > 0 else math.nan
    lines = [
        f"Measured on `{OBSERVED_CONFIG}` (NVFP4 sampler + learner, plain GRPO loss, TRIAGE in diagnose mode), mean "
        f"over {n_seeds} seed(s). Tail tokens: |gap| above the batch's tail threshold; counts are per loss "
        "computation (mean over the step's micro-batches).", "",
        f"- Over the first {obs['first_steps']} step(s): {na:.1f} NA vs {pa:.1f} PA amplifying tail tokens "
        f"(NA share {_pct(share)} of NA + PA).",
        f"- Share of amplifying tail tokens in the top 10% of segments, mean over steps: "
        f"{_pct(obs['concentration_mean'])} (10% if they were spread evenly).", "",
        "| step | NA tail tokens | PA tail tokens | NA / (NA + PA) | tail concentration |", "|---|---|---|---|---|"]
    for row in obs["per_step"]:
        total = row["NA"] + row["PA"]
        lines.append(f"| {row['step']} | {row['NA']:.2f} | {row['PA']:.2f} | "
                     f"{_pct(row['NA'] / total if total > 0 else math.nan)} | {_pct(row['concentration'])} |")
    return lines


def _pct(value: float) -> str:
    return _num(value, ".1%")


def _num(value: float, fmt: str) -> str:
    return format(value, fmt) if math.isfinite(value) else "n/a"


def summarize(lab_dir: str) -> str:
    """Write ``results.md``, ``overlay.png`` and (with ``nvfp4_naive`` runs) ``observations.png``; returns the
    path of ``results.md``.

    Raises:
        FileNotFoundError: ``lab_dir`` holds no finished run (names the command that makes them).
    """
    runs = load_runs(lab_dir)
    if not runs:
        raise FileNotFoundError(f"No finished run under {lab_dir}/runs/*/seed*/run_summary.json: run "
                                "`python benchmarks/stability_lab.py --output-dir LAB_DIR` first.")
    plan = _load_plan(lab_dir)
    planned = plan.get("configs") or []
    settings = plan.get("settings") or next(iter(runs.values()))[0]["summary"].get("settings", {})
    lines = ["# Stability lab results", "",
             "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()
                                      if k not in ("configs", "trainer_overrides", "estimate")), ""]
    if plan.get("seeds") is not None:
        lines += [f"Planned: {len(planned)} configurations x seeds {plan['seeds']}.", ""]
    lines += _table(runs, planned) + ["", "Rules:", ""] + rules_text()
    lines += ["", "## Configurations", ""]
    for name, rows in runs.items():
        description = CONFIGS[name].description if name in CONFIGS else rows[0]["summary"].get("description", "")
        lines.append(f"- `{name}`: {description}")
    lines += ["", "## Runs", ""] + _per_run(runs)
    write_overlay({name: [r["history"] for r in rows] for name, rows in runs.items()},
                  os.path.join(lab_dir, "overlay.png"))
    lines += ["", "## Plots", "", "![reward and k3 KL, all configurations](overlay.png)", "",
              "Per run: `runs/<configuration>/seed<S>/plots/*.png` (`triage-report`)."]
    observed = runs.get(OBSERVED_CONFIG, [])
    lines += ["", "## The paper's observations", ""]
    if observed:
        histories = [r["history"] for r in observed]
        lines += _observations_md(observations(histories), len(histories))
        write_observations(histories, os.path.join(lab_dir, "observations.png"), OBSERVED_CONFIG)
        lines += ["", "![NA vs PA tail counts and tail concentration](observations.png)"]
    else:
        lines.append(f"No finished `{OBSERVED_CONFIG}` run: add it to --configs to measure them.")
    path = os.path.join(lab_dir, RESULTS)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> str:
    """Command line: ``python -m triage_trl.lab.summarize LAB_DIR``; prints the results table."""
    parser = argparse.ArgumentParser(prog="python -m triage_trl.lab.summarize", description=__doc__.split("\n\n")[0])
    parser.add_argument("lab_dir")
    args = parser.parse_args(argv)
    path = summarize(args.lab_dir)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    print(text.split("\nRules:")[0])
    print(f"Written: {path}")
    return path


if __name__ == "__main__":
    main()
