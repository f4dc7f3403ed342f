"""The TRIAGE objective as pure torch: per-token weights and the ``triage/`` metrics.

``docs/objective.md`` is the spec (a reconstruction of arXiv 2610.07043 from its abstract) and lists
the choices made where it is silent. :func:`triage_weights` composes the steps of :mod:`.steps`
(one small function per step) and the metrics of :mod:`.metrics`; no TRL import.
"""

from .metrics import METRIC_NAMES, METRICS, Diagnosis, triage_metrics
from .order_statistic import kth_smallest, order_statistic_rank
from .steps import QUADRANTS, NonFiniteSamplerLogprobsError
from .weights import TriageResult, triage_weights
from .zero_signal import zero_reward_spread

__all__ = [
    "METRICS",
    "METRIC_NAMES",
    "QUADRANTS",
    "Diagnosis",
    "NonFiniteSamplerLogprobsError",
    "TriageResult",
    "kth_smallest",
    "order_statistic_rank",
    "triage_metrics",
    "triage_weights",
    "zero_reward_spread",
]
