"""The stability lab (``docs/stability.md``): TRIAGE against naive NVFP4, TRL's importance-sampling corrections and bf16.

- :mod:`~triage_trl.lab.configs`: the ordered registry of named configurations (overrides of
  ``TriageGRPOConfig``) and the scale presets (``cpu``, ``smoke``, ``gpu``).
- :mod:`~triage_trl.lab.worker`: one (configuration, seed) run in its own process
  (``python -m triage_trl.lab.worker``).
- :mod:`~triage_trl.lab.summarize`: the results table, the overlay plot and the paper's observations
  (``python -m triage_trl.lab.summarize LAB_DIR``).

The one command is ``python benchmarks/stability_lab.py`` (every configuration x seed, resumable).
"""

from .configs import CONFIGS, SCALES, LabConfig, config_names, lab_config

__all__ = ["CONFIGS", "SCALES", "LabConfig", "config_names", "lab_config"]
