"""Which code produced a run: the triage-trl version, the git commit of its source tree when it runs from a checkout
(and whether its code differed from that commit), and the environment ``triage-trl env`` reports (library versions,
the CPU's bf16 support, the compute dtype), which decide the last bits of every result.

The stability lab records one entry per start of a run (``lab.worker``; a run resumed from a checkpoint may span two
commits) and ``lab.summarize`` lists the commits behind a table; ``triage_run.json`` records the commit too.
"""

from __future__ import annotations

import functools
import os
import subprocess

CODE_PATHS = ("triage_trl", "benchmarks", "scripts", "pyproject.toml", "setup.cfg")
"""What ``git_dirty`` looks at: the code a run executes (changes and untracked files there), not the lab's outputs or
docs kept in the same checkout."""


def code_revision() -> dict:
    """``{"triage_trl", "git_commit", "git_dirty", "environment"}`` of this process (:func:`git_revision`, and
    ``environment.environment_info()``); never raises."""
    from .. import __version__
    from .environment import environment_info

    return {"triage_trl": __version__, **git_revision(), "environment": environment_info()}


@functools.cache
def git_revision() -> dict:
    """``{"git_commit", "git_dirty"}``: the commit (40 hex digits) of the checkout the ``triage_trl`` package was
    imported from, and whether the code there (:data:`CODE_PATHS`) differed from it. Taken once per process (a run's
    later records name the code it started with, whatever is committed meanwhile); never raises.

    Both are ``None`` when the package is not at the top of a git work tree (an installed copy, or one vendored inside
    another repository) or git is missing or refused (e.g. a checkout owned by another user); ``git_dirty`` alone is
    ``None`` when only the status failed.
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # triage_trl/
    root = os.path.dirname(package)  # the folder holding it: a checkout's top
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or not _same_folder(top, root):
        return {"git_commit": None, "git_dirty": None}
    commit = _git(root, "rev-parse", "HEAD")
    # --no-optional-locks: never take the index lock a concurrent `git commit` in this checkout needs
    status = _git(root, "--no-optional-locks", "status", "--porcelain", "--untracked-files=normal", "--", *CODE_PATHS)
    return {"git_commit": commit, "git_dirty": None if commit is None or status is None else bool(status)}


def short_revision(record: dict) -> str:
    """A :func:`code_revision` record as ``3f8a563`` (``3f8a563+``: its code had changes; ``3f8a563?``: unknown), or
    ``triage-trl <version>`` without a commit."""
    commit = record.get("git_commit")
    if not commit:
        return f"triage-trl {record.get('triage_trl', '?')}"
    dirty = record.get("git_dirty")
    return commit[:7] + ("?" if dirty is None else "+" if dirty else "")


def _same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _git(cwd: str, *args: str) -> str | None:
    # an inherited GIT_DIR / GIT_WORK_TREE (set in hooks and some wrappers) would point git at another repository
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, encoding="utf-8",
                              errors="surrogateescape", timeout=10, check=False)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
