"""The repo's scripts and benchmarks are entry points, not a package: the tests load one as a module by its path."""

import importlib.util
import os
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(relative_path: str) -> ModuleType:
    """The file ``ROOT/relative_path`` (e.g. ``"benchmarks/bench_sync.py"``) executed as a module of its own name."""
    name = os.path.splitext(os.path.basename(relative_path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
