"""``triage-eval --to-card``: a ``results.json`` of ``triage-eval`` put into a training run's card, as ``model-index``
metadata (the Hub's evaluation results) and an Evaluation table. The card itself is the trainer's
(``triage_trl/trainer/model_card.py``); the shared helpers are ``triage_trl/hub/card.py``.
"""

from __future__ import annotations

import json
import os
import re

from huggingface_hub import EvalResult, ModelCard

from ..hub.card import md_cell, md_row
from .benchmarks import HUB_SOURCES

EVAL_SECTION_START = "<!-- triage-eval results: start -->"
EVAL_SECTION_END = "<!-- triage-eval results: end -->"


def eval_results_from_json(results: dict) -> list[EvalResult]:
    """One ``EvalResult`` per benchmark and metric of a ``triage-eval`` ``results.json``.

    Args:
        results: the parsed file (``config``, ``metrics`` as fractions in [0, 1], ``records`` per benchmark).

    Returns:
        Entries with ``task_type="text-generation"``, the benchmark's Hub dataset (id, config, split) where
        ``triage_trl.eval`` knows it, ``metric_type`` like ``"pass@1"`` and ``metric_value`` in percent (two
        decimals); ``metric_name`` states sampling, precision, backend and problem count.

    Raises:
        ValueError: the file has no ``config`` or no ``metrics``.
    """
    if not isinstance(results.get("config"), dict) or not isinstance(results.get("metrics"), dict):
        raise ValueError("This is not a triage-eval results.json (no `config` / `metrics`): pass the file that "
                         "`triage-eval --output-dir DIR` wrote as DIR/results.json.")
    config = results["config"]
    sampling = "greedy" if not config.get("temperature") else f"T={config['temperature']}, n={config.get('n')}"
    entries = []
    for bench, metrics in results["metrics"].items():
        dataset_id, dataset_config, split = HUB_SOURCES.get(bench, (bench, None, None))
        problems = len(results.get("records", {}).get(bench, []))
        for metric, value in metrics.items():
            entries.append(EvalResult(
                task_type="text-generation",
                dataset_type=dataset_id,
                dataset_name=bench,
                dataset_config=dataset_config,
                dataset_split=split,
                metric_type=metric,
                metric_value=round(100.0 * float(value), 2),
                metric_name=f"{metric} ({sampling}, {config.get('precision')} {config.get('backend')}, "
                            f"{problems} problems)",
            ))
    return entries


def eval_section(entries: list[EvalResult]) -> str:
    """Markdown table of ``entries`` between :data:`EVAL_SECTION_START` and :data:`EVAL_SECTION_END`."""
    lines = [EVAL_SECTION_START, "## Evaluation", "", "Measured with `triage-eval` (percent).", "",
             "| benchmark | metric | value |", "|---|---|---:|"]
    for e in entries:
        lines.append(md_row(md_cell(e.dataset_name), md_cell(e.metric_name or e.metric_type), md_cell(e.metric_value)))
    return "\n".join(lines + [EVAL_SECTION_END]) + "\n"


def add_eval_results_to_card(run_dir: str, results_json: str) -> ModelCard:
    """Put a ``triage-eval`` ``results.json`` into the run's card: ``model-index`` metadata and an Evaluation table.

    Entries for the same benchmark, metric and settings are replaced, others kept, so re-adding a file is a no-op.

    Args:
        run_dir: the training run's ``output_dir``, holding its ``README.md`` card.
        results_json: the ``results.json`` that ``triage-eval`` wrote.

    Returns:
        The updated card, already saved to ``run_dir/README.md``.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``README.md`` or ``results_json`` does not exist.
        ValueError: ``results_json`` is not a ``triage-eval`` results file.
    """
    card_path = os.path.join(run_dir, "README.md")
    for path, remedy in ((card_path, "train into it first (the trainer writes the card)"),
                         (results_json, "run `triage-eval --output-dir DIR` and pass DIR/results.json")):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} does not exist: {remedy}.")
    with open(results_json, encoding="utf-8") as f:
        new = eval_results_from_json(json.load(f))
    card = ModelCard.load(card_path)
    card.data.model_name = card.data.model_name or os.path.basename(os.path.normpath(run_dir))

    def key(e):
        return (e.dataset_type, e.dataset_config, e.dataset_split, e.metric_type, e.metric_name)

    replaced = {key(e) for e in new}
    card.data.eval_results = [e for e in (card.data.eval_results or []) if key(e) not in replaced] + new
    body = re.sub(re.escape(EVAL_SECTION_START) + r".*?" + re.escape(EVAL_SECTION_END) + r"\n?", "", card.text,
                  flags=re.S)
    anchor = "## Training procedure"
    section = eval_section(card.data.eval_results)
    body = body.replace(anchor, f"{section}\n{anchor}", 1) if anchor in body else body.rstrip("\n") + "\n\n" + section
    card.text = body
    card.save(card_path)
    return card
