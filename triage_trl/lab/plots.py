"""The stability lab's figures: the overlay of every configuration and the paper's observations (matplotlib, Agg).

Both take ``runs``: ``{configuration: [log history of each seed]}`` (log records as TRL writes them, with
``step``). Curves are the mean over seeds at each optimizer step, with a light min-max band.
"""

from __future__ import annotations

import math

from .metrics import step_series

OVERLAY_PANELS = (("reward", "Training reward (mean over completions)", "reward (1.0 x accuracy + 0.1 x format)"),
                  ("triage/k3_kl", "Learner-sampler mismatch: k3 KL", "nats / token"))


def seed_values_by_step(histories: list[list[dict]], key: str) -> dict[int, list[float]]:
    """``{step: [the finite values of key, one per seed that logged it]}``: the lab's one per-step aggregation over
    seeds (the figures' bands and the observations' means)."""
    by_step: dict[int, list[float]] = {}
    for history in histories:
        for step, value in zip(*step_series(history, key)):
            if math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    return by_step


def seed_band(histories: list[list[dict]], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """``(steps, mean, min, max)`` of ``key`` over seeds at each step any seed logged (finite values only)."""
    by_step = seed_values_by_step(histories, key)
    steps = sorted(by_step)
    return (steps, [sum(by_step[s]) / len(by_step[s]) for s in steps], [min(by_step[s]) for s in steps],
            [max(by_step[s]) for s in steps])


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax, histories, key, label, color):
    steps, mean, low, high = seed_band(histories, key)
    if not steps:
        return False
    ax.plot(steps, mean, color=color, label=label, marker="o" if len(steps) < 30 else None, markersize=3)
    if len(histories) > 1:
        ax.fill_between(steps, low, high, color=color, alpha=0.15, linewidth=0)
    return True


def write_overlay(runs: dict[str, list[list[dict]]], path: str) -> str:
    """Reward and k3 KL against the optimizer step for every configuration (one colour each); returns ``path``."""
    plt = _pyplot()
    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), dpi=100)
    for ax, (key, title, ylabel) in zip(axes, OVERLAY_PANELS):
        for i, (name, histories) in enumerate(runs.items()):
            n = len(histories)
            _draw(ax, histories, key, f"{name} (n={n})", colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20])
        ax.set_title(f"{title}\nmean over seeds, band: min-max", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
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
