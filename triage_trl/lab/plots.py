"""The stability lab's figures: the overlay of every configuration and the paper's observations (matplotlib, Agg).

Both take ``runs``: ``{configuration: [log history of each seed]}`` (log records as TRL writes them, with
``step``). Curves are the mean over seeds at each optimizer step, with a light min-max band.
"""

from __future__ import annotations

import math

from .metrics import COLLAPSE_REWARD_WINDOW, every_step_series, step_series

PROBE_K3 = "fixed_probe/k3"
"""The overlay's key for the fixed probe's k3 (``lab.probe``: the same completions re-scored by both engines every
``probe_every`` steps), merged into a run's history by :func:`with_fixed_probe`."""
OVERLAY_PANELS = (("reward", "Training reward (mean over completions)",
                   "reward (weighted sum of the run's reward functions)"),
                  ("triage/k3_kl", "Learner-sampler mismatch: k3 KL, training batch", "nats / token"),
                  (PROBE_K3, "Learner-sampler mismatch: k3 KL, fixed probe (E3: its dose)", "nats / token"),
                  ("entropy", "Policy entropy (TRL's, sampled completions)", "nats / token"))
LOG_PANELS = frozenset({"triage/k3_kl", PROBE_K3, "entropy"})
SMOOTH_MIN_POINTS = 3 * COLLAPSE_REWARD_WINDOW
"""A reward series with at least this many points is drawn as its ``COLLAPSE_REWARD_WINDOW``-point moving mean (the
collapse rule's, from the first full window on), shorter ones as logged."""


def moving_mean(values: list[float], window: int) -> list[float]:
    """Trailing moving mean over full windows, as the collapse rule reads it (``metrics.collapse_by_rule``): point
    ``j`` is the mean of ``values[j : j + window]`` (``len(values) - window + 1`` points; none when shorter)."""
    return [sum(values[j:j + window]) / window for j in range(len(values) - window + 1)]


def seed_values_by_step(histories: list[list[dict]], key: str) -> dict[int, list[float]]:
    """``{step: [the finite values of key, one per seed that logged it]}``: the lab's one per-step aggregation over
    seeds (the figures' bands and the observations' means), over the training records (the fixed probe's
    :data:`PROBE_K3` over its own records)."""
    series = every_step_series if key == PROBE_K3 else step_series
    by_step: dict[int, list[float]] = {}
    for history in histories:
        for step, value in zip(*series(history, key)):
            if math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    return by_step


def seed_band(histories: list[list[dict]], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """``(steps, mean, min, max)`` of ``key`` over seeds at each step any seed logged (finite values only)."""
    by_step = seed_values_by_step(histories, key)
    steps = sorted(by_step)
    return (steps, [sum(by_step[s]) / len(by_step[s]) for s in steps], [min(by_step[s]) for s in steps],
            [max(by_step[s]) for s in steps])


def with_fixed_probe(history: list[dict], probe: list[dict]) -> list[dict]:
    """``history`` plus one record ``{"step", PROBE_K3}`` per fixed-probe record (``fixed_probe.jsonl``: ``step``,
    ``k3`` in nats/token), for :func:`write_overlay`. An E3 record (a hot sampler) gives its ``dose_k3`` instead:
    there the engines agree to numerical noise on the probe and the mismatch is the temperature's
    (``probe.temperature_dose``)."""
    return [*history, *({"step": p["step"], PROBE_K3: p.get("dose_k3", p["k3"])} for p in probe or [] if "k3" in p)]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax, histories, key, label, color, smooth: int = 0) -> bool:
    """Draw ``key``'s mean over seeds (and its band); ``smooth``: a window, applied to a long enough series.
    Returns whether the series was smoothed."""
    steps, mean, low, high = seed_band(histories, key)
    smoothed = bool(smooth) and len(steps) >= SMOOTH_MIN_POINTS
    if smoothed:
        steps = steps[smooth - 1:]
        mean, low, high = (moving_mean(x, smooth) for x in (mean, low, high))
    if not steps:
        return False
    ax.plot(steps, mean, color=color, label=label, marker="o" if len(steps) < 30 else None, markersize=3)
    if len(histories) > 1:
        ax.fill_between(steps, low, high, color=color, alpha=0.15, linewidth=0)
    return smoothed


def write_overlay(runs: dict[str, list[list[dict]]], path: str,
                  collapse_steps: dict[str, list[int]] | None = None) -> str:
    """Reward, the training batch's and the fixed probe's k3 KL and policy entropy (log scale) against the
    optimizer step for every configuration (one colour each; a reward series of :data:`SMOOTH_MIN_POINTS` points or
    more as the collapse rule's moving mean; no probe panel when no run has probe records); a
    ``collapse_steps[name]`` step (one per collapsed seed, :func:`triage_trl.lab.metrics.run_collapse`) is drawn as a
    dotted vertical line in the configuration's colour on every panel; returns ``path``."""
    plt = _pyplot()
    colors = plt.get_cmap("tab20").colors
    probed = any(PROBE_K3 in h for histories in runs.values() for history in histories for h in history)
    panels = [p for p in OVERLAY_PANELS if probed or p[0] != PROBE_K3]  # no empty probe panel (probe_every=0)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), dpi=100)
    smoothed = False
    for ax, (key, title, ylabel) in zip(axes, panels):
        for i, (name, histories) in enumerate(runs.items()):
            n = len(histories)
            color = colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20]
            smooth = COLLAPSE_REWARD_WINDOW if key == "reward" else 0
            smoothed |= _draw(ax, histories, key, f"{name} (n={n})", color, smooth)
            for step in (collapse_steps or {}).get(name, []):
                ax.axvline(step, color=color, linestyle=":", linewidth=1.2)
        log = key in LOG_PANELS
        if log and ax.lines:
            ax.set_yscale("log")
        marks = ", dotted: collapse (pre-registered rule)" if any((collapse_steps or {}).values()) else ""
        window = f", {COLLAPSE_REWARD_WINDOW}-step moving mean" if key == "reward" and smoothed else ""
        band = "moving mean of the min and max" if window else "min-max"
        ax.set_title(f"{title}{' (log scale)' if log else ''}{window}\nmean over seeds, band: {band}{marks}",
                     fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.89, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def write_observations(histories: list[list[dict]], path: str, config: str = "nvfp4_naive") -> str:
    """The paper's observations on ``config``'s seeds: NA vs PA tail-token counts, and the share of amplifying tail
    tokens in the top 10% of segments, per optimizer step; returns ``path``."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), dpi=100)
    _draw(left, histories, "triage/tail_count_NA", "NA: negative advantage, learner amplifies", "tab:red")
    _draw(left, histories, "triage/tail_count_PA", "PA: positive advantage, learner amplifies", "tab:blue")
    left.set_title(f"{config}: amplifying tail tokens per quadrant\nmean over {len(histories)} seed(s), band: min-max",
                   fontsize=10)
    left.set_ylabel("tail tokens per loss computation")
    _draw(right, histories, "triage/tail_concentration", "in the top 10% of segments", "tab:purple")
    right.axhline(0.1, color="gray", linestyle="--", linewidth=1, label="spread evenly (10%)")
    right.set_ylim(0, 1.05)
    right.set_title(f"{config}: concentration of amplifying tail tokens\n"
                    f"mean over {len(histories)} seed(s), band: min-max", fontsize=10)
    right.set_ylabel("share of amplifying tail tokens")
    for ax in (left, right):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_e1_quadrants(table: dict[str, dict], path: str) -> str:
    """E1's figure: per arm, the mean change over one optimizer step of the gap in each quadrant (NA, PA, NC, PC),
    and the paired difference of each arm's k3 change with naive's; bars are means over batches, whiskers the
    percentile bootstrap 95% intervals. ``table`` is ``benchmarks/mechanism_e1.py``'s report (``{arm: {measure:
    {"mean", "low", "high"}, f"{measure}_vs_naive": ...}}``); returns ``path``."""
    plt = _pyplot()
    arms = list(table)
    quadrants = ("NA", "PA", "NC", "PC")
    colors = {"NA": "tab:red", "PA": "tab:blue", "NC": "tab:orange", "PC": "tab:green"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6), dpi=100, gridspec_kw={"width_ratios": (2, 1)})
    width = 0.8 / len(quadrants)
    for j, q in enumerate(quadrants):
        cells = [table[a].get(f"gap_{q}", {}) for a in arms]
        means = [c.get("mean", math.nan) for c in cells]
        errors = [[max(m - c.get("low", m), 0.0) if math.isfinite(c.get("low", math.nan)) else 0.0
                   for m, c in zip(means, cells)],
                  [max(c.get("high", m) - m, 0.0) if math.isfinite(c.get("high", math.nan)) else 0.0
                   for m, c in zip(means, cells)]]
        xs = [i + (j - 1.5) * width for i in range(len(arms))]
        left.bar(xs, means, width, yerr=errors, color=colors[q], label=q, capsize=2)
    left.axhline(0.0, color="gray", linewidth=1)
    n = max((table[a].get("batches", 0) for a in arms), default=0)
    left.set_title(f"E1: change of the mean learner - sampler gap per quadrant over one step\n"
                   f"mean over {n} batch(es), whiskers: bootstrap 95%", fontsize=10)
    left.set_ylabel("after - before (nats / token)")
    left.set_xticks(range(len(arms)), arms, rotation=20, fontsize=8)
    left.legend(fontsize=8)
    others = [a for a in arms if "k3_vs_naive" in table[a]]
    cells = [table[a]["k3_vs_naive"] for a in others]
    means = [c["mean"] for c in cells]
    errors = [[max(c["mean"] - c["low"], 0.0) if math.isfinite(c["low"]) else 0.0 for c in cells],
              [max(c["high"] - c["mean"], 0.0) if math.isfinite(c["high"]) else 0.0 for c in cells]]
    right.bar(range(len(others)), means, yerr=errors, color="tab:purple", capsize=3)
    right.axhline(0.0, color="gray", linewidth=1)
    right.set_yscale("symlog", linthresh=0.1)  # k3 is a tail statistic: one token's gap can move it by 100x
    right.set_title("change of k3 minus naive's, paired by batch (symlog)\n(below 0: the arm widens the mismatch "
                    "less)", fontsize=10)
    right.set_ylabel("nats / token")
    right.set_xticks(range(len(others)), others, rotation=20, fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
