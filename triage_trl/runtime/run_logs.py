"""A run's log history as the demo, the lab, the CLI and ``triage-report`` read it (no torch or TRL import)."""

from __future__ import annotations

import json
import math
import os

LOG_HISTORY = "log_history.jsonl"
"""Log records appended as they are logged (``triage_trl.runs.LogHistoryWriter``): a crashed run keeps its curve."""


def read_records(path: str) -> list[dict]:
    """The records of a jsonl file, in order (``[]`` when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_log_history(run_dir: str) -> list[dict]:
    """A run's log records, in order: ``log_history.jsonl`` (written as it logs), else the ``trainer_state.json`` of
    the run folder or of its last checkpoint (``TrainerState.load_from_json``).

    Raises:
        FileNotFoundError: none of them exists (names the remedy).
    """
    from transformers import TrainerState
    from transformers.trainer_utils import get_last_checkpoint

    path = os.path.join(run_dir, LOG_HISTORY)
    if os.path.isfile(path):
        return read_records(path)
    candidates = [os.path.join(run_dir, "trainer_state.json")]
    if os.path.isdir(run_dir) and (last := get_last_checkpoint(run_dir)):
        candidates.append(os.path.join(last, "trainer_state.json"))
    for state_path in candidates:
        if os.path.isfile(state_path):
            return TrainerState.load_from_json(state_path).log_history
    raise FileNotFoundError(
        f"No {LOG_HISTORY} or trainer_state.json in {run_dir} (or its checkpoint-*/ folders): is it a training run's "
        "output_dir? Runs of triage-grpo, the demo and the lab save trainer_state.json when they finish."
    )


def log_series(history: list[dict], key: str, *, finite: bool = True) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of one log key over the records that have a ``step`` (non-finite values dropped unless
    ``finite=False``)."""
    steps, values = [], []
    for record in history:
        value = record.get(key)
        if "step" not in record or not isinstance(value, (int, float)):
            continue
        if finite and not math.isfinite(value):
            continue
        steps.append(int(record["step"]))
        values.append(float(value))
    return steps, values
