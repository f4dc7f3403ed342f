"""triage-trl: TRIAGE (arXiv 2610.07043) for TRL, torchao NVFP4 and vLLM.

The objective and its settings import with torch alone; the trainer (which imports TRL) loads on
first use: ``from triage_trl import TriageGRPOTrainer, TriageGRPOConfig`` imports ``triage_trl.trainer``
then (module ``__getattr__``, PEP 562), and ``import triage_trl`` alone imports neither TRL nor vLLM.

Modules that moved into concept folders keep their old import paths: ``MOVED`` maps each old path to its new
home, and importing the old path returns the new module itself (one module object, so ``monkeypatch`` through
either path patches the same thing). CONTRIBUTING.md's "Where code goes" lists what lives where.
"""

import importlib
import importlib.abc
import importlib.util
import sys

from .objective import (
    METRIC_NAMES,
    METRICS,
    QUADRANTS,
    NonFiniteSamplerLogprobsError,
    TriageResult,
    triage_weights,
    zero_reward_spread,
)
from .objective.config import TriageConfig
from .objective.segments import build_newline_table, segment_ids

__version__ = "0.2.0.dev0"

# Old module path -> new module path (see CHANGELOG.md). Old paths import lazily, like the new ones.
MOVED = {
    "triage_trl.answer_latex": "triage_trl.answers.latex",
    "triage_trl.answer_worker": "triage_trl.answers.worker",
    "triage_trl.model_blocks": "triage_trl.models.blocks",
    "triage_trl.nvfp4.export": "triage_trl.nvfp4.checkpoint_tensors",
    "triage_trl.nvfp4.experts_export": "triage_trl.nvfp4.checkpoint_experts",
    "triage_trl.preflight": "triage_trl.runtime.preflight",
    "triage_trl.progress": "triage_trl.runtime.progress",
    "triage_trl.rewards": "triage_trl.answers.rewards",
    "triage_trl.run_folder": "triage_trl.runtime.run_folder",
    "triage_trl.run_logs": "triage_trl.runtime.run_logs",
    "triage_trl.sampler.engine": "triage_trl.sampler.vllm_generation",
    "triage_trl.segments": "triage_trl.objective.segments",
    "triage_trl.testing": "triage_trl.models.tiny",
    "triage_trl.triage_config": "triage_trl.objective.config",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path of :data:`MOVED` as its new module: the placeholder module made for the old name is
    replaced in ``sys.modules`` by the new one, which the import statement then returns (importlib's own
    ``_load_unlocked`` reads the module back from ``sys.modules``)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())

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
