"""``triage-export``: a run's trained weights as a servable NVFP4 checkpoint (compressed-tensors, what vLLM loads).

* :mod:`.run_record`: what a run folder records for its export (NVFP4 settings, calibration prompts);
* :mod:`.source`: which weights of a run folder to export (final, or a ``checkpoint-N``), checked before writing;
* :mod:`.writer`: :func:`export_run`, the sharded checkpoint written into a temporary folder and renamed;
* :mod:`.card`: the export's model card (``base_model_relation: quantized``);
* :mod:`.cli`: the ``triage-export`` / ``triage-trl export`` command.
"""

from .run_record import BUILTIN_CALIBRATION_PROMPTS, RUN_RECORD, read_run_record, run_record, write_run_record
from .source import ExportSource, find_export_source
from .writer import ExportResult, export_run

__all__ = [
    "BUILTIN_CALIBRATION_PROMPTS",
    "RUN_RECORD",
    "ExportResult",
    "ExportSource",
    "export_run",
    "find_export_source",
    "read_run_record",
    "run_record",
    "write_run_record",
]
