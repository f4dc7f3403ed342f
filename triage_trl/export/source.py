"""Which weights of a run folder ``triage-export`` exports, found and checked before anything is written."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .run_record import read_run_record

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_config.json")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class ExportSource:
    """The weights to export and what the run folder says about them.

    Attributes:
        run_dir: the training run's ``output_dir``.
        weights_dir: the folder holding the weights: ``run_dir`` (final) or ``run_dir/checkpoint-N``.
        checkpoint: ``"checkpoint-N"``, or ``None`` for the final weights.
        step: the optimizer step of the weights (``trainer_state.json``'s ``global_step``), ``None`` if unknown.
        record: the run's ``triage_run.json`` (``run_record.read_run_record``), ``None`` if absent.
        is_adapter: the weights are a PEFT adapter (merged into its base model before export).
    """

    run_dir: Path
    weights_dir: Path
    checkpoint: str | None
    step: int | None
    record: dict | None
    is_adapter: bool

    @property
    def run_card(self) -> Path | None:
        """The run's own ``README.md`` card, if it has one."""
        path = self.run_dir / "README.md"
        return path if path.is_file() else None


def find_export_source(run_dir: str | os.PathLike, checkpoint: str | None = None) -> ExportSource:
    """The :class:`ExportSource` of ``run_dir`` (final weights, or ``checkpoint``).

    Args:
        run_dir: a training run's ``output_dir``.
        checkpoint: ``"checkpoint-N"`` (a folder of ``run_dir``), or ``None`` for the final weights.

    Raises:
        FileNotFoundError: ``run_dir`` or the checkpoint folder does not exist, or it holds no weights (names the
            checkpoints that do).
        ValueError: ``checkpoint`` is not of the form ``checkpoint-N``; the run record is malformed.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"Run folder {run} does not exist: give the --output_dir of a training run.")
    checkpoints = sorted((p.name for p in run.iterdir() if _CHECKPOINT.match(p.name) and _has_weights(p)),
                         key=lambda name: int(name.split("-")[1]))
    available = f"checkpoints with weights: {', '.join(checkpoints)}" if checkpoints else "no checkpoint-N folders"
    if checkpoint is not None:
        name = os.path.basename(os.path.normpath(checkpoint))
        if not _CHECKPOINT.match(name):
            raise ValueError(f"--checkpoint {checkpoint!r} is not a checkpoint-N folder name ({available}).")
        weights = run / name
        if not weights.is_dir():
            raise FileNotFoundError(f"{weights} does not exist ({available}).")
    else:
        name, weights = None, run
    if not _has_weights(weights):
        remedy = "pass --checkpoint with one of them" if checkpoints and name is None else "train into it first"
        raise FileNotFoundError(f"{weights} holds no model weights ({' or '.join(WEIGHT_FILES[::2])}): {remedy} "
                                f"({available}).")
    return ExportSource(run_dir=run, weights_dir=weights, checkpoint=name, step=_global_step(weights),
                        record=read_run_record(run), is_adapter=(weights / "adapter_config.json").is_file())


def _has_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in WEIGHT_FILES)


def _global_step(folder: Path) -> int | None:
    path = folder / "trainer_state.json"
    if not path.is_file():
        return None
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["global_step"])
    except (ValueError, KeyError, TypeError):
        return None
