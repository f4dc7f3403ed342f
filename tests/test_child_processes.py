"""Every child process a test starts gets an explicit environment (``child_process_env``): an xdist worker whose
in-process vLLM engine is live has ``MASTER_PORT`` set to the port its store listens on, and a child that inherits it
and starts an engine of its own fails with EADDRINUSE (CI on 2026-12-05, ``test_bench_step``)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STARTERS = {"run", "Popen", "check_output", "check_call", "call"}


def _calls_without_env(path: Path) -> list[str]:
    missing = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STARTERS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"
                and not any(k.arg == "env" for k in node.keywords)):
            missing.append(f"{path.name}:{node.lineno}")
    return missing


def test_every_subprocess_a_test_starts_passes_an_env():
    missing = [where for path in sorted(TESTS.glob("*.py")) for where in _calls_without_env(path)]
    assert missing == [], f"pass env=child_process_env(...) (triage_trl.runtime) at {missing}"


def test_the_check_finds_a_call_without_env(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import subprocess\nsubprocess.run(['true'])\nsubprocess.run(['true'], env={})\n")
    assert _calls_without_env(sample) == ["sample.py:2"]
