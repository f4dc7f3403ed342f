"""triage-trl: TRIAGE (arXiv 2610.07043) for TRL, torchao NVFP4 and vLLM.

The objective and its settings import with torch alone; the trainer (which imports TRL) loads on
first use: ``from triage_trl import TriageGRPOTrainer, TriageGRPOConfig`` imports ``triage_trl.trainer``
then (module ``__getattr__``, PEP 562), and ``import triage_trl`` alone imports neither TRL nor vLLM.
"""

from .objective import (
    METRIC_NAMES,
    METRICS,
    QUADRANTS,
    NonFiniteSamplerLogprobsError,
    TriageResult,
    triage_weights,
    zero_reward_spread,
)
from .segments import build_newline_table, segment_ids
from .triage_config import TriageConfig

__version__ = "0.2.0.dev0"

_LAZY = {"TriageGRPOTrainer", "TriageGRPOConfig", "StaleSamplerError"}


def __getattr__(name: str):
    if name in _LAZY:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _LAZY)


__all__ = [
    "METRICS",
    "METRIC_NAMES",
    "QUADRANTS",
    "NonFiniteSamplerLogprobsError",
    "StaleSamplerError",
    "TriageConfig",
    "TriageGRPOConfig",
    "TriageGRPOTrainer",
    "TriageResult",
    "build_newline_table",
    "segment_ids",
    "triage_weights",
    "zero_reward_spread",
]
