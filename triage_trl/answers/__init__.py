"""Answer checking: final-answer extraction and verification (math-verify), and the rewards built on it.

- ``check.py``: extraction and verification of a completion's final answer against a reference, by kind
  (``KINDS``); :func:`check_answer` / :func:`verify` end within their time limit in any thread.
- ``latex.py``: the LaTeX rewrites applied before math-verify parses an answer or a reference.
- ``worker.py``: the helper processes that run :func:`check_in_process` within a wall-clock limit.
- ``rewards.py``: TRL reward functions on these checks (``REWARD_FUNCS``; also importable as
  ``triage_trl.rewards``).

Its modules import no torch, and math-verify only when a check runs; the helper process imports them without
``triage_trl/__init__.py`` (which loads torch).
"""

from .check import *  # noqa: F403  (check.py's public names are the package's)
from .check import __all__  # noqa: F401
