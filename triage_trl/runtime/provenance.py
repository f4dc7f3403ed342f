"""Which code produced a run: the triage-trl version, the git commit of its source tree when it runs from a checkout
(and whether tracked files differed from it), and the environment ``triage-trl env`` reports (library versions, the
CPU's bf16 support, the compute dtype), which decide the last bits of every result.

The stability lab records one entry per start of a run (``lab.worker``; a run resumed from a checkpoint may span two
commits) and ``lab.summarize`` lists the commits behind a table.
"""

from __future__ import annotations

import os
import subprocess


def code_revision() -> dict:
    """``{"triage_trl", "git_commit", "git_dirty", "environment"}`` of this process; never raises.

    ``git_commit`` (40 hex digits) and ``git_dirty`` (tracked files changed since it) are ``None`` unless the
    ``triage_trl`` package imported here sits at the top of a git work tree (an installed copy, or one vendored inside
    another repository, has no commit of its own). ``environment``: ``env_report.environment_info()``.
    """
    from .. import __version__
    from ..env_report import environment_info

    return {"triage_trl": __version__, **git_revision(), "environment": environment_info()}


def git_revision() -> dict:
    """``{"git_commit", "git_dirty"}`` of :func:`code_revision` alone (no environment probes); never raises."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # triage_trl/
    root = os.path.dirname(package)  # the folder holding it: a checkout's top
    top = _git(root, "rev-parse", "--show-toplevel")
    commit = dirty = None
    if top is not None and os.path.realpath(top) == os.path.realpath(root):
        commit = _git(root, "rev-parse", "HEAD")
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        dirty = None if commit is None or status is None else bool(status)
    return {"git_commit": commit, "git_dirty": dirty}


def short_revision(record: dict) -> str:
    """A :func:`code_revision` record as ``3f8a563`` (``3f8a563+`` with changed tracked files), or
    ``triage-trl <version>`` without a commit."""
    commit = record.get("git_commit")
    if not commit:
        return f"triage-trl {record.get('triage_trl', '?')}"
    return commit[:7] + ("+" if record.get("git_dirty") else "")


def _git(cwd: str, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
