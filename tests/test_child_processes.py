"""Every child process a test starts gets an explicit environment built by ``child_process_env``: an xdist worker
whose in-process vLLM engine is live has ``MASTER_PORT`` set to the port its store listens on, and a child that
inherits it and starts an engine of its own fails with EADDRINUSE (CI on 2026-12-05, ``test_bench_step``)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STARTERS = {"run", "Popen", "check_output", "check_call", "call"}
REMEDY = "pass env=child_process_env(...) (triage_trl.runtime)"


def _inherits_environ(value: ast.expr) -> bool:
    """``env=os.environ``, ``env={**os.environ, ...}``, ``env=dict(os.environ)`` or ``env=None``: the parent's
    rendezvous variables go to the child."""
    called = getattr(value.func, "id", getattr(value.func, "attr", "")) if isinstance(value, ast.Call) else ""
    if called == "child_process_env":
        return False
    names = {node.attr for node in ast.walk(value) if isinstance(node, ast.Attribute)}
    return "environ" in names or (isinstance(value, ast.Constant) and value.value is None)


def _unsafe_starts(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "subprocess":
            found.append(f"{path.name}:{node.lineno} imports from subprocess (call subprocess.X so this check sees it)")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STARTERS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"):
            continue
        env = next((k.value for k in node.keywords if k.arg == "env"), None)
        if env is None or _inherits_environ(env):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_every_subprocess_a_test_starts_gets_a_child_env():
    found = [where for path in sorted(TESTS.rglob("*.py")) for where in _unsafe_starts(path)]
    assert found == [], f"{REMEDY} at {found}"


def test_the_check_finds_inherited_environments(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os, subprocess\nfrom subprocess import run\nsubprocess.run(['true'])\n"
                      "subprocess.run(['true'], env={**os.environ, 'A': '1'})\nsubprocess.Popen(['true'], env=None)\n"
                      "subprocess.run(['true'], env=child_process_env(A=os.environ.get('A', '')))\n")
    assert [f.split(" ")[0] for f in _unsafe_starts(sample)] == ["sample.py:2", "sample.py:3", "sample.py:4",
                                                                  "sample.py:5"]


def test_child_process_env_gives_the_child_a_port_of_its_own(monkeypatch):
    import socket

    from triage_trl.runtime import child_process_env

    with socket.socket() as held:  # the parent's rendezvous, listening (a live in-process engine's store)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        monkeypatch.setenv("MASTER_PORT", port)
        monkeypatch.setenv("RANK", "0")
        env = child_process_env(EXTRA="1")
        assert "RANK" not in env and env["EXTRA"] == "1"
        assert env["MASTER_PORT"] != port and int(env["MASTER_PORT"]) > 0
        with socket.socket() as child:  # the child can listen there
            child.bind(("127.0.0.1", int(env["MASTER_PORT"])))
    assert child_process_env(MASTER_PORT="1234")["MASTER_PORT"] == "1234"
