"""The stability lab (``docs/stability.md``): TRIAGE against naive NVFP4, TRL's importance-sampling corrections and bf16.

- :mod:`~triage_trl.lab.configs`: the ordered registry of named configurations (overrides of
  ``TriageGRPOConfig``), the mismatch doses (NVFP4 layer recipes) and the scale presets (``cpu``, ``smoke``, ``gpu``).
- :mod:`~triage_trl.lab.worker`: one (configuration, dose, seed) run in its own process
  (``python -m triage_trl.lab.worker``).
- :mod:`~triage_trl.lab.summarize`: the results table, the overlay plot and the paper's observations
  (``python -m triage_trl.lab.summarize LAB_DIR``).

The one command is ``python benchmarks/stability_lab.py`` (every configuration x dose x seed, resumable).
"""

from .configs import CONFIGS, DOSES, SCALES, Dose, LabConfig, config_names, lab_config, lab_dose

__all__ = ["CONFIGS", "DOSES", "SCALES", "Dose", "LabConfig", "config_names", "lab_config", "lab_dose"]
