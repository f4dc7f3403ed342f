"""The repo's scripts and benchmarks are entry points, not a package: the tests load one as a module by its path."""

import importlib.util
import os
import sys
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(relative_path: str) -> ModuleType:
    """The file ``ROOT/relative_path`` (e.g. ``"benchmarks/bench_sync.py"``) executed as a module of its own name,
    with its folder first on ``sys.path`` while it executes, as ``python ROOT/relative_path`` runs it (so its imports
    of sibling files, e.g. bench_step.py's ``from bench_sync import timed``, resolve)."""
    path = os.path.join(ROOT, relative_path)
    name = os.path.splitext(os.path.basename(relative_path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(path))
    return module
