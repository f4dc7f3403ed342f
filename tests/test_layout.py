"""The package's layout (CONTRIBUTING.md, "Where code goes"): no import cycle between the top-level units of
``triage_trl/`` (a folder or a flat module; imports inside functions count), at most six flat modules at the root,
every unit named in CONTRIBUTING.md, and every documented import of the README, docs/ and the notebooks working."""

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

import triage_trl

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "triage_trl"
MAX_FLAT_MODULES = 6


def _unit(parts: list[str]) -> str:
    """The top-level unit of ``triage_trl.<parts>``, through :data:`triage_trl.MOVED` for an old path."""
    name = "triage_trl." + ".".join(parts)
    for old, new in triage_trl.MOVED.items():
        if name == old or name.startswith(old + "."):
            return new.split(".")[1]
    return parts[0]


def _imported_units(path: Path) -> set[str]:
    """Top-level units that ``path`` imports anywhere (module level or inside a function), the root package
    itself (``from triage_trl import __version__``) not counted: it is the facade, not a unit."""
    relative = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(relative[:-1])  # the package a relative import in this file starts from
    units = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            module = base + (node.module.split(".") if node.module else [])
            targets = [module + [alias.name] for alias in node.names] if not node.module else [module]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "triage_trl":
            module = node.module.split(".")[1:]
            targets = [module] if module else [[alias.name] for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name.split(".")[1:] for alias in node.names if alias.name.startswith("triage_trl.")]
        units |= {_unit(t) for t in targets if t and not t[0].startswith("__")}
    return units


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] in ("__init__", "__main__"):
            continue
        unit = parts[0]
        graph.setdefault(unit, set()).update(_imported_units(path) - {unit})
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a list of units, first = last), or ``None``."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = 1
        path.append(unit)
        for other in sorted(graph.get(unit, ())):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state and (found := visit(other)):
                return found
        path.pop()
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state and (found := visit(unit)):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_top_level_units():
    graph = _graph()
    assert {"answers", "eval", "models", "nvfp4", "objective", "runtime", "trainer"} <= set(graph)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


ENTRY_POINTS = {"triage_trl.cli", "triage_trl.demo", "triage_trl.env_report", "triage_trl.eval.cli",
                "triage_trl.export.cli", "triage_trl.lab.worker", "triage_trl.lab.summarize"}
"""Commands (``setup.cfg``'s console scripts, ``python -m``); ``commands.py`` dispatches to them by name and
``__main__.py`` is ``triage-grpo``. What they share lives in the library (``runs.py`` and the folders)."""


def _imported_modules(path: Path) -> set[str]:
    """Dotted names ``path`` imports (``from a import b`` gives ``a`` and ``a.b``), relative imports resolved."""
    parts = path.relative_to(REPO).with_suffix("").parts
    package = list(parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = (package[: len(package) - node.level + 1] if node.level else [])
            module = module + (node.module.split(".") if node.module else [])
            names |= {".".join(module)} | {".".join(module + [alias.name]) for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_no_entry_point_imports_another():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module in ("triage_trl.__main__", "triage_trl.commands"):
            continue
        offenders += [f"{module} -> {name}" for name in _imported_modules(path) & (ENTRY_POINTS - {module})]
    assert not offenders, offenders


def test_at_most_six_flat_modules_at_the_root():
    flat = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(flat) <= MAX_FLAT_MODULES, flat


def test_contributing_names_every_folder_and_flat_module():
    text = (REPO / "CONTRIBUTING.md").read_text()
    block = text[text.index("## Where code goes"):]
    block = block[: block.index("\n## ")]
    units = [p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    units += [p.name for p in PACKAGE.glob("*.py")]
    missing = [u for u in units if not re.search(rf"(?m)^\s+{re.escape(u)}\s", block)]
    assert not missing, f"CONTRIBUTING.md's 'Where code goes' does not name {missing}"


def test_moved_paths_import_the_new_module_itself():
    for old, new in triage_trl.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


_IMPORT_RE = re.compile(r"from (triage_trl[\w.]*) import (\([\w,\s]*\)|[\w, ]+)|import (triage_trl[\w.]*)")


def _documented_imports() -> list[tuple[str, str | None]]:
    """``(module, name)`` for every ``from triage_trl... import name`` and ``(module, None)`` for every
    ``import triage_trl...`` of README.md, docs/*.md and the notebooks' code cells."""
    texts = [(REPO / "README.md").read_text()] + [p.read_text() for p in sorted((REPO / "docs").rglob("*.md"))]
    for notebook in sorted((REPO / "examples").rglob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        texts += ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    found = []
    for text in texts:
        for match in _IMPORT_RE.finditer(text):
            if match.group(3):
                found.append((match.group(3), None))
            else:
                names = [n.strip() for n in match.group(2).strip("()").replace("\n", ",").split(",")]
                found += [(match.group(1), n) for n in names if n and n.isidentifier()]
    return sorted(set(found), key=lambda item: (item[0], item[1] or ""))


_DOTTED_RE = re.compile(r"`[^`]*?\b(triage_trl(?:\.\w+)+)")


def _documented_dotted_names() -> list[str]:
    """Every ``triage_trl.a.b`` written in backticks in README.md, docs/*.md and the notebooks (``python -m ...``
    included): a module path, or a module path and an attribute."""
    texts = [(REPO / "README.md").read_text()] + [p.read_text() for p in sorted((REPO / "docs").rglob("*.md"))]
    texts += [p.read_text() for p in sorted((REPO / "examples").rglob("*.ipynb"))]
    return sorted({m.group(1) for text in texts for m in _DOTTED_RE.finditer(text)})


def test_the_docs_import_something():
    imports = _documented_imports()
    assert ("triage_trl", "TriageConfig") in imports and ("triage_trl.runtime", "vllm_process_settings") in imports
    assert "triage_trl.sampler.vllm_engine.start_engine" in _documented_dotted_names()


@pytest.mark.parametrize("dotted", _documented_dotted_names())
def test_every_documented_dotted_name_resolves(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return
    raise AssertionError(f"{dotted} does not import")


@pytest.mark.parametrize(("module", "name"), _documented_imports())
def test_every_documented_import_works(module, name):
    imported = importlib.import_module(module)
    if name is not None:
        assert getattr(imported, name) is not None
