"""triage-trl: TRIAGE (arXiv 2610.07043) for TRL, torchao NVFP4 and vLLM.

The objective and its settings import with torch alone; the trainer (which imports TRL) loads on
first use.
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

__all__ = [
    "METRICS",
    "METRIC_NAMES",
    "QUADRANTS",
    "NonFiniteSamplerLogprobsError",
    "TriageConfig",
    "TriageResult",
    "build_newline_table",
    "segment_ids",
    "triage_weights",
    "zero_reward_spread",
]
