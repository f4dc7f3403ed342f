"""``from triage_trl import TriageGRPOTrainer, TriageGRPOConfig`` works, and ``import triage_trl`` alone loads
neither TRL nor vLLM (the names load on first use through the package's module ``__getattr__``)."""

import subprocess
import sys

from triage_trl.runtime import child_process_env


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=child_process_env(), check=True, capture_output=True,
                          text=True)
    return done.stdout.strip()


def test_import_triage_trl_loads_neither_trl_nor_vllm():
    out = _run("import sys, triage_trl; print(sorted(m for m in ('trl', 'vllm', 'transformers', 'triage_trl.trainer')"
               " if m in sys.modules))")
    assert out == "[]"


def test_trainer_names_import_lazily_from_the_package():
    out = _run(
        "import sys, triage_trl\n"
        "from triage_trl import TriageGRPOTrainer, TriageGRPOConfig, StaleSamplerError\n"
        "from triage_trl.trainer import TriageGRPOTrainer as T, TriageGRPOConfig as C\n"
        "print(TriageGRPOTrainer is T, TriageGRPOConfig is C, 'trl' in sys.modules,\n"
        "      'TriageGRPOTrainer' in dir(triage_trl))"
    )
    assert out.splitlines()[-1] == "True True True True"


def test_unknown_name_still_raises():
    import pytest

    import triage_trl

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        triage_trl.NoSuchThing  # noqa: B018
