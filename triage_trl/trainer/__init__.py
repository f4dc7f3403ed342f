"""The TRL side of triage-trl: ``TriageGRPOConfig`` and ``TriageGRPOTrainer``."""

from .grpo_config import TriageGRPOConfig
from .grpo_trainer import TriageGRPOTrainer
from .sync_probe import StaleSamplerError

__all__ = ["StaleSamplerError", "TriageGRPOConfig", "TriageGRPOTrainer"]
