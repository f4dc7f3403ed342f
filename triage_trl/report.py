"""``triage-report RUN_DIR``: PNG plots of a TRIAGE-GRPO run from its log history.

Reads the run's log history (``triage_trl.runtime.run_logs.read_log_history``: ``log_history.jsonl``,
``trainer_state.json`` or the last ``checkpoint-*/``'s) and draws one figure per quantity against the optimizer step:

=========================  ==================================================================  ===========
figure                     series (log keys)                                                   unit
=========================  ==================================================================  ===========
reward.png                 ``reward`` (mean), ``reward_std``, ``rewards/<func>/mean``             reward
k3_kl.png                  ``triage/k3_kl`` (mean(e^gap - 1 - gap), gap = learner - sampler)   nats/token
quadrant_fractions.png     ``triage/frac_NA``, ``frac_PA``, ``frac_NC``, ``frac_PC``             share
tail_imbalance.png         ``triage/amp_imbalance`` (NA tail / (PA tail + 1))                  ratio
tail_concentration.png     ``triage/tail_concentration``, ``triage/tail_in_hot_frac``          share
hot_segment_fraction.png   ``triage/hot_segment_frac``                                         share
weight_range.png           ``triage/weight_min``, ``weight_mean``, ``weight_max``              weight
=========================  ==================================================================  ===========

Quadrants (``docs/objective.md``): N/P = negative/positive advantage, A/C = the learner
amplifies/contracts the sampler's probability of the token. A figure whose keys are absent from the log (e.g.
``triage_mode="off"``) is skipped, so the report works for any run of the trainer.
"""

from __future__ import annotations

import argparse
import os

from .runtime.run_logs import log_series, read_log_history

# name -> (title, y label, [(log key, legend label)])
FIGURES = {
    "reward": ("Training reward (mean over completions)", "reward",
               [("reward", "reward (weighted sum)"), ("reward_std", "reward std")]),
    "k3_kl": ("Learner-sampler mismatch: k3 KL, mean(e^gap - 1 - gap)", "nats / token", [("triage/k3_kl", "k3 KL")]),
    "quadrant_fractions": ("Token share per TRIAGE quadrant (N/P advantage x A/C amplify/contract)", "share of tokens",
                           [("triage/frac_NA", "NA"), ("triage/frac_PA", "PA"), ("triage/frac_NC", "NC"),
                            ("triage/frac_PC", "PC")]),
    "tail_imbalance": ("Tail imbalance: NA tail tokens / (PA tail tokens + 1)", "ratio",
                       [("triage/amp_imbalance", "amp_imbalance")]),
    "tail_concentration": ("Where the amplifying tail tokens sit", "share of amplifying tail tokens",
                           [("triage/tail_concentration", "in the top 10% of segments"),
                            ("triage/tail_in_hot_frac", "in hot segments")]),
    "hot_segment_fraction": ("Hot-segment fraction", "share of segments", [("triage/hot_segment_frac", "hot segments")]),
    "weight_range": ("TRIAGE per-token weights", "weight",
                     [("triage/weight_min", "min"), ("triage/weight_mean", "mean"), ("triage/weight_max", "max")]),
}


def figure_series(history: list[dict], name: str) -> dict[str, tuple[list[int], list[float]]]:
    """The series a figure draws: ``{legend label: (steps, values)}`` for its keys present in ``history``.

    ``reward`` also draws every ``rewards/<func>/mean`` key.

    Raises:
        KeyError: unknown figure ``name`` (see :data:`FIGURES`).
    """
    _, _, keys = FIGURES[name]
    keys = list(keys)
    if name == "reward":
        names = sorted({k for h in history for k in h if k.startswith("rewards/") and k.endswith("/mean")})
        keys += [(k, k.removeprefix("rewards/").removesuffix("/mean")) for k in names]
    out = {}
    for key, label in keys:
        steps, values = log_series(history, key)
        if steps:
            out[label] = (steps, values)
    return out


def write_plots(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Draw every figure of :data:`FIGURES` with data in the run's log; returns the PNG paths written.

    Args:
        run_dir: the run's ``output_dir``.
        out_dir: where the PNGs go (default ``RUN_DIR/plots``; created).

    Raises:
        FileNotFoundError: no log history in ``run_dir`` (see ``triage_trl.runtime.run_logs.read_log_history``).
        ValueError: the log has no training records.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = [h for h in read_log_history(run_dir) if "step" in h]
    if not history:
        raise ValueError(f"The log history of {run_dir} has no training records (did the run take a step?).")
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, (title, ylabel, _) in FIGURES.items():
        data = figure_series(history, name)
        if not data:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        for label, (steps, values) in data.items():
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> list[str]:
    """``triage-report RUN_DIR [--out DIR]``: write the plots and print their paths."""
    parser = argparse.ArgumentParser(prog="triage-report", description="PNG plots of a TRIAGE-GRPO run's log history.")
    parser.add_argument("run_dir", help="the run's output_dir (holding trainer_state.json or checkpoint-*/)")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = write_plots(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"triage-report: {err}\n")
    for path in paths:
        print(path)
    return paths


if __name__ == "__main__":
    main()
