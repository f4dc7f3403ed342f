"""The examples run as written (offline, seconds)."""

import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_objective_walkthrough(capsys):
    runpy.run_path(str(EXAMPLES / "objective_walkthrough.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "triage/beta                 0.2500" in out  # the clustered NA line is rebalanced to the floor
    assert "triage/repaired_frac" in out and "nan" not in out
