"""The ``triage/`` (and ``nvfp4/``) metrics between two logging steps: reduced across processes when recorded,
over the logging window when logged.

The trainer records one value per metric per micro-batch (the objective) or per sync (the probe); ``Trainer.log``
then receives, per metric, the mean over the window, except extremes, which keep the extreme (``gap_abs_max`` is the
largest gap of the window, not a mean of maxima).
"""

from __future__ import annotations

from collections import defaultdict

import torch

MAX_METRICS = frozenset({"triage/gap_abs_max", "triage/weight_max", "triage/sync_probe_gap_max"})
MIN_METRICS = frozenset({"triage/weight_min"})


class TriageMetricsLog:
    """Buffers of metric values per mode (``"train"``/``"eval"``) until the next log.

    Args:
        accelerator: reduces each recorded value across processes (``None``: one process).
    """

    def __init__(self, accelerator=None):
        self.accelerator = accelerator
        self._buffers: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def record(self, mode: str, metrics: dict[str, float]) -> dict[str, float]:
        """Reduce ``{name: value}`` across processes (max/min for extremes, else mean) and buffer it.

        Every process must call this with the same names (it is a collective). Returns the reduced values.
        """
        names = list(metrics)
        local = torch.tensor([float(metrics[n]) for n in names], dtype=torch.float64)
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            gathered = self.accelerator.gather(local.to(self.accelerator.device)).view(-1, len(names)).cpu()
        else:
            gathered = local.view(1, -1)
        reduced = {}
        for i, name in enumerate(names):
            column = gathered[:, i]
            value = column.max() if name in MAX_METRICS else column.min() if name in MIN_METRICS else column.mean()
            reduced[name] = float(value)
            self._buffers[mode][name].append(reduced[name])
        return reduced

    def pop(self, mode: str) -> dict[str, float]:
        """The window's values per metric (extremes kept, others averaged); empties the mode's buffer."""
        out = {}
        for name, values in self._buffers[mode].items():
            if values:
                out[name] = max(values) if name in MAX_METRICS else min(values) if name in MIN_METRICS else (
                    sum(values) / len(values)
                )
        self._buffers[mode].clear()
        return out
