"""``python -m triage_trl.lab.summarize LAB_DIR``: the stability lab's results table, overlay and observations.

Reads every finished run (``LAB_DIR/runs/<config>@<dose>/seed<S>/run_summary.json`` and its
``log_history.jsonl``) and writes into LAB_DIR:

- ``results.md``: one row per configuration and dose, mean ± std over seeds (rules from
  :mod:`triage_trl.lab.metrics`, printed under the table); the cost / gain / stability table (step-0 cost against
  bf16 and training gain paired by item with bootstrap intervals, greedy and avg@N; the slope of ln k3 on the
  training batch and on the fixed probe; the pre-registered collapse rule per seed); each correction against its
  uncorrected arm, and TRIAGE against TIS and OPSM (:func:`head_to_head_md`); per dose, the runs against
  bf16 and the goal (:data:`GOAL_RATIO`); the descriptions, one row per run, the code revisions the runs came from
  (:func:`code_md`), and the paper's observations measured on ``nvfp4_naive`` (NA vs PA tail-token counts over the
  first steps, tail concentration per step);
- ``overlay.png``: reward, k3 KL (training batch and fixed probe) and entropy against the optimizer step for all
  configurations (:mod:`.plots`);
- ``observations_<dose>.png``: the observations' curves, one per dose of ``nvfp4_naive``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os

from ..provenance import short_revision
from ..runtime.run_logs import read_log_history, read_records
from .configs import CONFIGS, DOSES, PLAN_FILE, PUBLISHED_CORRECTIONS, run_label, split_label, uncorrected_arm
from .metrics import (collapse_rule_text, cost_gain_stability, format_mean_std, gain_difference, mean_std, rules_text,
                      run_collapse, run_metrics, step_series)
from .plots import seed_values_by_step, with_fixed_probe, write_observations, write_overlay

RESULTS = "results.md"
OBSERVED_CONFIG = "nvfp4_naive"
OBS_FIRST_STEPS = 5
"""The "first steps" of the observations: NA vs PA tail counts are totalled over steps 1..OBS_FIRST_STEPS."""
BASELINE_CONFIG, GOAL_CONFIG = "bf16", "triage"
GOAL_RATIO = 0.98
"""The goal at each dose (the lab's first goal line): TRIAGE's final held-out accuracy >= GOAL_RATIO x bf16's (means over seeds), no
collapsed seed, and above naive NVFP4."""


def load_history(run_dir: str) -> list[dict]:
    """A run's log records (``triage_trl.runtime.run_logs.read_log_history``), or ``[]`` for a run that logged nothing."""
    try:
        return read_log_history(run_dir)
    except FileNotFoundError:
        return []


def load_runs(lab_dir: str) -> dict[str, list[dict]]:
    """Finished runs by label ``<configuration>@<dose>`` (``bf16`` alone; configuration registry order, then doses
    in :data:`DOSES` order, then unknown names sorted), each sorted by seed:
    ``{"seed", "dir", "summary", "history", "metrics"}``."""
    runs: dict[str, list[dict]] = {}
    for path in glob.glob(os.path.join(lab_dir, "runs", "*", "seed*", "run_summary.json")):
        run_dir = os.path.dirname(path)
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        history = load_history(run_dir)
        label = (run_label(summary["config"], summary.get("dose")) if summary.get("config")
                 else os.path.basename(os.path.dirname(run_dir)))
        runs.setdefault(label, []).append({"seed": summary.get("seed"), "dir": run_dir, "summary": summary,
                                           "history": history, "metrics": run_metrics(summary, history),
                                           "probe": read_records(os.path.join(run_dir, "fixed_probe.jsonl"))})
    known = [run_label(c, d) for c in CONFIGS for d in (None, *DOSES)]
    order = [c for c in known if c in runs] + sorted(c for c in runs if c not in known)
    return {c: sorted(runs[c], key=lambda r: (r["seed"] is None, r["seed"])) for c in order}


def _describe(label: str, rows: list[dict]) -> str:
    config, dose = split_label(label)
    text = CONFIGS[config].description if config in CONFIGS else rows[0]["summary"].get("description", "")
    if dose:
        text += f"; dose `{dose}`: " + (DOSES[dose].description if dose in DOSES else "unknown dose")
    return text


def _load_plan(lab_dir: str) -> dict:
    path = os.path.join(lab_dir, PLAN_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _table(runs: dict[str, list[dict]], planned: list[str]) -> list[str]:
    header = ("| run | seeds | held-out acc. final (%) | held-out acc. best (%) | reward AUC | "
              "k3 KL max (nats) | k3 KL final (nats) | grad-norm spikes | collapsed (acc. rule) | failed | wall (min) |")
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


def _interval(value: dict, scale: float = 100.0) -> str:
    if not math.isfinite(value["mean"]):
        return "n/a"
    text = f"{value['mean'] * scale:+.1f}"
    return text + (f" [{value['low'] * scale:+.1f}, {value['high'] * scale:+.1f}]" if math.isfinite(value["low"])
                   else "")


def _is_hot(label: str) -> bool:
    """A run at one of E3's hot-sampler doses, where k3 rises by design (docs/stability.md, "Pre-registered rules")."""
    dose = split_label(label)[1]
    return dose in DOSES and DOSES[dose].sampler_temperature is not None


def _collapse_step(label: str, verdict: dict) -> int | None:
    """The step a run collapsed at (``run_collapse``), by reward or grad norm only at E3's hot-sampler doses."""
    criteria = {k: v for k, v in verdict["criteria"].items() if not (_is_hot(label) and k == "k3")}
    return min(criteria.values()) if criteria else None


def cost_gain_md(runs: dict[str, list[dict]], reference: str = BASELINE_CONFIG) -> list[str]:
    """The cost / gain / stability table (:func:`triage_trl.lab.metrics.cost_gain_stability`), one row per run label."""
    ref = [{"seed": r["seed"], "held_out": r["summary"].get("held_out")} for r in runs.get(reference, [])] or None
    samples_key = next((k for rows in runs.values() for r in rows for e in (r["summary"].get("held_out") or [])
                        for k in e if k.startswith("avg_at_")), None)
    held = next((r["summary"] for rows in runs.values() for r in rows), {})
    lines = ["## Cost, gain and stability", "",
             f"Held-out items: {held.get('held_out_items', 'n/a')}, of which among the run's training items: "
             f"{held.get('held_out_shared_with_train', 'n/a')}. Cost: {reference}'s step-0 greedy accuracy minus "
             "the run's (points, paired by item); gain: final minus step 0 (points, paired by item); in brackets a "
             "percentile bootstrap 95% interval over (seed, item) pairs. k3 slope: least-squares slope of ln k3 per "
             "optimizer step (training batch; fixed probe).", "",
             f"| run | seeds | step-0 cost (greedy) | gain (greedy) | gain ({samples_key or 'avg@N'}) | "
             "k3 slope / step | probe k3 slope / step | collapsed (rule) |", "|---|---|---|---|---|---|---|---|"]
    learner_rows = []
    for label, rows in runs.items():
        result = cost_gain_stability(
            [{"seed": r["seed"], "held_out": r["summary"].get("held_out"), "history": r["history"],
              "probe": r.get("probe")} for r in rows], ref, samples_key=samples_key)
        if result["gain_learner"]["n"]:
            learner_rows.append(f"| {label} | {len(rows)} | {_interval(result['gain_learner'])} | "
                                f"{_interval(result['gain_learner_sampled'])} |")
        fell = [f"seed {r['seed']}: " + ", ".join(f"{why}@{step}" for why, step in
                                                 sorted(c["criteria"].items(), key=lambda kv: kv[1]))
                for r, c in zip(rows, result["collapses"]) if c["collapsed"]]
        count = sum(_collapse_step(label, c) is not None for c in result["collapses"])
        verdict = f"{count}/{len(rows)}" + (" by reward or grad norm" if _is_hot(label) else "")
        lines.append(f"| {label} | {len(rows)} | {_interval(result['cost'])} | {_interval(result['gain'])} | "
                     f"{_interval(result['gain_sampled'])} | {_num(result['k3_slope'], '+.4f')} | "
                     f"{_num(result['probe_k3_slope'], '+.4f')} | {verdict}"
                     f"{' (' + '; '.join(fell) + ')' if fell else ''} |")
    lines += ["", "- " + collapse_rule_text(), ""]
    if learner_rows:
        lines += ["The learner's own weights (full precision, transformers `generate`), for runs whose sampler computes "
                  "in NVFP4: the gain without the sampler's quantisation cost, paired by item as above.", "",
                  f"| run | seeds | gain (greedy, learner) | gain ({samples_key or 'avg@N'}, learner) |",
                  "|---|---|---|---|", *learner_rows, ""]
    return lines


def corrections_md(runs: dict[str, list[dict]]) -> list[str]:
    """Each correction's training gain minus its uncorrected arm's at the same dose
    (:func:`triage_trl.lab.configs.uncorrected_arm`, :func:`triage_trl.lab.metrics.gain_difference`); nothing
    when no run has its uncorrected arm in the folder."""
    table = []
    for label, rows in runs.items():
        config, dose = split_label(label)
        reference = uncorrected_arm(config) if config in CONFIGS else None
        ref_label = run_label(reference, dose) if reference else None
        if ref_label not in runs:
            continue
        cells = [gain_difference(_records(rows), _records(runs[ref_label]), key)
                 for key in ("outcomes", "item_scores", "learner_outcomes")]
        seeds = _paired_seeds(_records(rows), _records(runs[ref_label]))
        table.append(f"| {label} | {ref_label} | {len(seeds)} | " + " | ".join(_interval(c) for c in cells) + " |")
    if not table:
        return []
    return ["## Corrections against their uncorrected arm", "",
            "A correction's training gain minus the gain of the same engines under the plain GRPO loss, at the same "
            "dose (points; per (seed, item) over the seeds both ran, percentile bootstrap 95% interval): positive, the "
            "correction gained more. Arms with the same engines share their step-0 evaluation, so this is the "
            "difference of their final outcomes. Learner: the full-precision learner's own weights (bf16-learner "
            "arms only).", "",
            "| run | against | seeds | gain difference (greedy) | gain difference (avg@N) | "
            "gain difference (greedy, learner) |", "|---|---|---|---|---|---|", *table, ""]


def head_to_head_md(runs: dict[str, list[dict]]) -> list[str]:
    """Each TRIAGE arm's training gain minus each published correction's on the same engines and dose
    (:data:`triage_trl.lab.configs.PUBLISHED_CORRECTIONS`), paired by (seed, item) over the seeds both ran
    (:func:`triage_trl.lab.metrics.gain_difference`); nothing when no such pair of arms is in the folder."""
    table = []
    for label, rows in runs.items():
        config, dose = split_label(label)
        for other in PUBLISHED_CORRECTIONS.get(config, ()):
            other_label = run_label(other, dose)
            if other_label not in runs:
                continue
            mine, theirs = _records(rows), _records(runs[other_label])
            cells = [gain_difference(mine, theirs, key) for key in ("outcomes", "item_scores")]
            seeds = _paired_seeds(mine, theirs)
            table.append(f"| {label} | {other_label} | {len(seeds)} | " + " | ".join(map(_interval, cells)) + " |")
    if not table:
        return []
    return ["## TRIAGE against the published corrections", "",
            "TRIAGE's training gain minus TIS's or OPSM's on the same engines and dose (points; per (seed, item) over "
            "the seeds both ran, percentile bootstrap 95% interval): positive, TRIAGE gained more. Not a "
            "pre-registered comparison.", "",
            "| run | against | seeds | gain difference (greedy) | gain difference (avg@N) |", "|---|---|---|---|---|",
            *table, ""]


def _records(rows: list[dict]) -> list[dict]:
    return [{"seed": r["seed"], "held_out": r["summary"].get("held_out")} for r in rows]


def _paired_seeds(runs: list[dict], reference: list[dict], key: str = "outcomes") -> set:
    """The seeds both arms ran to a final evaluation carrying ``key`` (the pairs ``gain_difference`` uses)."""
    def usable(records):
        return {r["seed"] for r in records
                if len(r.get("held_out") or []) >= 2 and key in r["held_out"][0] and key in r["held_out"][-1]}

    return usable(runs) & usable(reference)


def _per_run(runs: dict[str, list[dict]]) -> list[str]:
    lines = ["| run | seed | status | steps | held-out acc. step 0 -> final (%) | reward AUC | "
             "k3 KL final | spikes | collapsed (acc. rule) | wall (min) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in runs.items():
        for r in rows:
            m, status = r["metrics"], r["summary"].get("status", "missing").replace("|", "/").replace("\n", " ")
            lines.append(f"| {name} | {r['seed']} | {status[:120]} | {m['steps']} | "
                         f"{_num(m['step0_acc'] * 100, '.1f')} -> {_num(m['final_acc'] * 100, '.1f')} | "
                         f"{_num(m['reward_auc'], '.3f')} | {_num(m['k3_final'], '.4f')} | {m['spikes']} | "
                         f"{'yes' if m['collapsed'] else 'no'} | {_num(m['wall_min'], '.1f')} |")
    return lines


def code_md(runs: dict[str, list[dict]]) -> list[str]:
    """One line naming the code revisions behind the runs (``provenance`` of each ``run_summary.json``: one record
    per start, ``provenance.short_revision``) and how many runs each produced, a resumed run counted under
    every revision it ran; runs written before the lab recorded it, or started before it did and resumed after
    (first record past step 0), count as not recorded too."""
    counts: dict[str, int] = {}
    for rows in runs.values():
        for r in rows:
            starts = r["summary"].get("provenance") or []
            revisions = dict.fromkeys(short_revision(p) for p in starts)
            if not starts or min(p.get("from_step", 0) for p in starts) > 0:
                revisions["not recorded"] = None
            for revision in revisions:
                counts[revision] = counts.get(revision, 0) + 1
    listed = ", ".join(f"`{rev}` {n} run{'s' if n > 1 else ''}" if rev != "not recorded"
                       else f"not recorded {n} run{'s' if n > 1 else ''}" for rev, n in counts.items())
    mixed = " (runs from more than one revision: compare them knowing that)" if len(counts) > 1 else ""
    return [f"Code (git commit of each start; `+`: its code had changes, `?`: unknown): {listed}{mixed}."]


def dose_report(runs: dict[str, list[dict]], dose: str) -> dict:
    """One dose against bf16 and the goal.

    Returns:
        ``rows``: per run label at ``dose`` (and ``bf16``), ``{"label", "n", "final", "best", "step0", "collapsed",
        "k3_first", "k3_final", "k3_mean", "ratio"}`` (accuracies: mean over seeds, 0-1; ``ratio``: final /
        bf16's final; k3 in nats/token, mean over seeds); ``goal``: ``{"ratio", "collapsed", "n", "over_naive",
        "met"}`` for TRIAGE (``None`` without both TRIAGE and bf16 runs).
    """
    def mean(rows, key):
        return mean_std([r["metrics"][key] for r in rows])[0]

    base = runs.get(BASELINE_CONFIG, [])
    base_final = mean(base, "final_acc") if base else math.nan
    labels = [BASELINE_CONFIG] if base else []
    labels += [label for label in runs if split_label(label)[1] == dose]
    rows = []
    for label in labels:
        rs = runs[label]
        final = mean(rs, "final_acc")
        rows.append({"label": label, "n": len(rs), "final": final, "best": mean(rs, "best_acc"),
                     "step0": mean(rs, "step0_acc"), "collapsed": sum(r["metrics"]["collapsed"] for r in rs),
                     "k3_first": mean(rs, "k3_first"), "k3_final": mean(rs, "k3_final"),
                     "k3_mean": mean(rs, "k3_mean"),
                     "ratio": final / base_final if base_final > 0 else math.nan})
    by_label = {r["label"]: r for r in rows}
    goal = None
    triage, naive = by_label.get(run_label(GOAL_CONFIG, dose)), by_label.get(run_label("nvfp4_naive", dose))
    if triage and base:
        over_naive = triage["final"] - naive["final"] if naive else math.nan
        goal = {"ratio": triage["ratio"], "collapsed": triage["collapsed"], "n": triage["n"], "over_naive": over_naive,
                "met": triage["ratio"] >= GOAL_RATIO and triage["collapsed"] == 0 and over_naive > 0}
    return {"rows": rows, "goal": goal}


def _dose_md(runs: dict[str, list[dict]], doses: list[str]) -> list[str]:
    lines = ["## Per dose, against bf16", "",
             f"Goal: `{GOAL_CONFIG}` ends at >= {GOAL_RATIO:g}x `{BASELINE_CONFIG}`'s final held-out "
             "accuracy (means over seeds), no collapsed seed, and above `nvfp4_naive`. k3: learner-sampler "
             "`triage/k3_kl`, nats/token, mean over seeds at the first and last step and over all steps.", ""]
    for dose in doses:
        report = dose_report(runs, dose)
        lines += [f"### Dose `{dose}`", "", "| run | seeds | held-out step 0 (%) | final (%) | best (%) | final / bf16 | "
                  "collapsed | k3 first step | k3 last step | k3 mean |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["rows"]:
            lines.append(f"| {r['label']} | {r['n']} | {_num(r['step0'] * 100, '.1f')} | "
                         f"{_num(r['final'] * 100, '.1f')} | {_num(r['best'] * 100, '.1f')} | "
                         f"{_num(r['ratio'], '.3f')} | {r['collapsed']}/{r['n']} | "
                         f"{_num(r['k3_first'], '.4f')} | {_num(r['k3_final'], '.4f')} | {_num(r['k3_mean'], '.4f')} |")
        goal = report["goal"]
        if goal is None:
            lines += ["", f"Goal not measurable at this dose: it needs `{BASELINE_CONFIG}` and "
                      f"`{run_label(GOAL_CONFIG, dose)}` runs."]
        else:
            lines += ["", f"Goal {'met' if goal['met'] else 'not met'}: `{run_label(GOAL_CONFIG, dose)}` / bf16 = "
                      f"{_num(goal['ratio'], '.3f')} (goal >= {GOAL_RATIO:g}), "
                      f"collapsed {goal['collapsed']}/{goal['n']}, "
                      f"{_num(goal['over_naive'] * 100, '+.1f')} points over naive NVFP4."]
        lines += _dose_calibration_md(runs, dose)
        lines.append("")
    return lines


def _dose_calibration_md(runs: dict[str, list[dict]], dose: str) -> list[str]:
    """E3: each run's dose on the fixed probe's text (``dose_k3`` of ``fixed_probe.jsonl``), first and last record,
    mean over seeds; nothing for a dose without a hot sampler."""
    if dose not in DOSES or DOSES[dose].sampler_temperature is None:
        return []
    lines = []
    for label, rows in runs.items():
        if split_label(label)[1] != dose:
            continue
        series = [{p["step"]: p for p in r.get("probe") or [] if "dose_k3" in p} for r in rows]
        series = [s for s in series if s]
        common = sorted(set.intersection(*(set(s) for s in series))) if series else []
        if not common:
            continue
        ends = []
        for step in (common[0], common[-1]):  # the first and last steps every seed recorded: means of like with like
            k3 = mean_std([s[step]["dose_k3"] for s in series])[0]
            factor = mean_std([s[step]["dose_factor"] for s in series])[0]
            ends.append(f"{_num(k3, '.4f')} (x{_num(factor, '.2f')}, step {step})")
        lines.append(f"- `{label}`: {' -> '.join(ends)}, {len(series)} seed(s)")
    if not lines:
        return []
    return ["", "Calibration on the fixed probe's text (`dose_k3`: k3 of the learner at T against itself at factor x T "
            "on the probe's tokens, nats/token, mean over seeds at the first and last steps all of them recorded; the "
            "temperature's share of the mismatch, the engines' own being the `bf16` arm's fixed-probe k3):", "",
            *lines]


def observations(histories: list[list[dict]], first_steps: int = OBS_FIRST_STEPS) -> dict:
    """The paper's observations on one configuration's seeds.

    Returns:
        ``per_step``: ``[{"step", "NA", "PA", "concentration"}]`` (means over seeds of ``triage/tail_count_NA``,
        ``tail_count_PA``, ``tail_concentration``); ``na_first``, ``pa_first``: those counts summed over steps
        1..``first_steps`` (mean over seeds); ``concentration_mean``: mean of the per-step concentration.
    """
    def mean_by_step(key):
        return {s: sum(v) / len(v) for s, v in seed_values_by_step(histories, key).items()}

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


def _observations_md(obs: dict, n_seeds: int, label: str = OBSERVED_CONFIG) -> list[str]:
    na, pa = obs["na_first"], obs["pa_first"]
    share = na / (na + pa) if na + pa > 0 else math.nan
    lines = [
        f"Measured on `{label}` (NVFP4 sampler + learner, plain GRPO loss, TRIAGE in diagnose mode), mean "
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
    """Write ``results.md``, ``overlay.png`` and (with ``nvfp4_naive`` runs) ``observations_<dose>.png``; returns
    the path of ``results.md``.

    Raises:
        FileNotFoundError: ``lab_dir`` holds no finished run (names the command that makes them).
    """
    runs = load_runs(lab_dir)
    if not runs:
        raise FileNotFoundError(f"No finished run under {lab_dir}/runs/*/seed*/run_summary.json: run "
                                "`python benchmarks/stability_lab.py --output-dir LAB_DIR` first.")
    plan = _load_plan(lab_dir)
    planned = plan.get("runs") or plan.get("configs") or []
    doses = plan.get("doses") or [d for d in DOSES if any(split_label(label)[1] == d for label in runs)]
    settings = plan.get("settings") or next(iter(runs.values()))[0]["summary"].get("settings", {})
    lines = ["# Stability lab results", "",
             "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()
                                      if k not in ("configs", "trainer_overrides", "estimate")), ""]
    if plan.get("seeds") is not None:
        lines += [f"Planned: {len(planned)} runs (configuration@dose) x seeds {plan['seeds']}.", ""]
    lines += _table(runs, planned) + ["", "Rules:", ""] + rules_text() + [""]
    lines += cost_gain_md(runs)
    lines += corrections_md(runs)
    lines += head_to_head_md(runs)
    lines += _dose_md(runs, doses)
    lines += ["## Runs and doses", ""]
    for name, rows in runs.items():
        lines.append(f"- `{name}`: {_describe(name, rows)}")
    lines += ["", "## Runs", ""] + _per_run(runs) + [""] + code_md(runs)
    collapse_steps = {}
    for name, rows in runs.items():
        steps = (_collapse_step(name, run_collapse(r["history"])) for r in rows)
        collapse_steps[name] = [s for s in steps if s is not None]
    write_overlay({name: [with_fixed_probe(r["history"], r.get("probe")) for r in rows] for name, rows in runs.items()},
                  os.path.join(lab_dir, "overlay.png"), collapse_steps)
    lines += ["", "## Plots", "",
              "![reward, k3 KL (training batch, fixed probe) and entropy, all configurations](overlay.png)", "",
              "Per run: `runs/<configuration>/seed<S>/plots/*.png` (`triage-report`)."]
    observed = [label for label in runs if split_label(label)[0] == OBSERVED_CONFIG]
    lines += ["", "## The paper's observations", ""]
    for label in observed:
        histories = [r["history"] for r in runs[label]]
        dose = split_label(label)[1]
        png = f"observations_{dose}.png" if dose else "observations.png"
        lines += [f"### `{label}`", ""] + _observations_md(observations(histories), len(histories), label)
        write_observations(histories, os.path.join(lab_dir, png), label)
        lines += ["", f"![NA vs PA tail counts and tail concentration]({png})", ""]
    if not observed:
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
