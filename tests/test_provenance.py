"""``triage_trl.provenance``: the code revision and environment a run records (the stability lab's ``provenance``)."""

import os
import shutil
import subprocess

import pytest

import triage_trl
from triage_trl.lab.summarize import code_md
from triage_trl.provenance import code_revision, git_revision, short_revision
from triage_trl.provenance import revision as provenance
from triage_trl.runtime import child_process_env

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(triage_trl.__file__)))


def _git(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:  # no git on this machine: as for a folder outside any work tree
        return subprocess.CompletedProcess(args, 128, "", "git not found")
    return subprocess.run(["git", *args], cwd=PACKAGE_PARENT, env=child_process_env(), capture_output=True, text=True,
                          check=False)


def test_the_revision_is_the_commit_of_the_checkout_triage_trl_is_imported_from():
    record = code_revision()
    top = _git("rev-parse", "--show-toplevel")
    assert record["triage_trl"] == triage_trl.__version__
    assert record["environment"]["triage-trl"] == triage_trl.__version__ and "torch" in record["environment"]
    if top.returncode == 0 and os.path.realpath(top.stdout.strip()) == os.path.realpath(PACKAGE_PARENT):
        assert record["git_commit"] == _git("rev-parse", "HEAD").stdout.strip() and len(record["git_commit"]) == 40
        changed = bool(_git("status", "--porcelain", "--", *provenance.CODE_PATHS).stdout.strip())
        assert record["git_dirty"] is changed
    else:  # an installed copy: no commit of its own
        assert record["git_commit"] is None and record["git_dirty"] is None


@pytest.fixture
def fresh_revision():
    git_revision.cache_clear()  # taken once per process: each case below computes its own
    yield
    git_revision.cache_clear()


def test_a_package_vendored_inside_another_repository_or_without_git_has_no_commit(monkeypatch, fresh_revision):
    monkeypatch.setattr(provenance, "_git", lambda cwd, *args: "/" if "--show-toplevel" in args else "0" * 40)
    assert code_revision()["git_commit"] is None and git_revision() == {"git_commit": None, "git_dirty": None}
    git_revision.cache_clear()
    monkeypatch.setattr(provenance, "_git", lambda cwd, *args: None)  # no git, git refused, or not a work tree
    record = code_revision()
    assert record["git_commit"] is None and record["git_dirty"] is None
    assert short_revision(record) == f"triage-trl {triage_trl.__version__}"


def test_the_status_looks_at_the_code_only_without_taking_the_index_lock(monkeypatch, fresh_revision):
    calls = []

    def fake(cwd, *args):
        calls.append(args)
        return cwd if "--show-toplevel" in args else "1" * 40 if args == ("rev-parse", "HEAD") else ""

    monkeypatch.setattr(provenance, "_git", fake)
    assert git_revision() == {"git_commit": "1" * 40, "git_dirty": False}
    git_revision()  # once per process: no second git call
    status = next(a for a in calls if "status" in a)
    assert status[0] == "--no-optional-locks" and status[status.index("--") + 1:] == provenance.CODE_PATHS
    assert len(calls) == 3


def test_git_ignores_an_inherited_repository(monkeypatch, tmp_path):
    expected = _git("rev-parse", "--show-toplevel")
    monkeypatch.setenv("GIT_DIR", str(tmp_path))  # set inside git hooks: would name another repository
    top = provenance._git(PACKAGE_PARENT, "rev-parse", "--show-toplevel")
    assert top == (expected.stdout.strip() if expected.returncode == 0 else None)


def test_short_revision_marks_changed_tracked_files():
    assert short_revision({"git_commit": "3f8a5631" + "0" * 32, "git_dirty": False}) == "3f8a563"
    assert short_revision({"git_commit": "3f8a5631" + "0" * 32, "git_dirty": True}) == "3f8a563+"
    assert short_revision({"git_commit": "3f8a5631" + "0" * 32, "git_dirty": None}) == "3f8a563?"


def test_the_lab_summary_counts_runs_per_revision():
    def run(*commits):
        return {"summary": {"provenance": [{"git_commit": c.rstrip("+") + "0" * 33, "git_dirty": c.endswith("+")}
                                           for c in commits]}}

    runs = {"bf16": [run("aaaaaaa"), run("aaaaaaa", "bbbbbbb+")], "triage@stress": [run(), run("bbbbbbb+")]}
    # the resumed run counts under both of its revisions; a run written before the lab recorded it, as not recorded
    head = "Code (git commit of each start; `+`: its code had changes, `?`: unknown): "
    assert code_md(runs) == [head + "`aaaaaaa` 2 runs, `bbbbbbb+` 2 runs, not recorded 1 run (runs from more than one "
                             "revision: compare them knowing that)."]
    assert code_md({"bf16": [run("aaaaaaa")]}) == [head + "`aaaaaaa` 1 run."]
    # started before the lab recorded it, resumed after: its first steps' code is not recorded
    resumed = {"summary": {"provenance": [{"from_step": 40, "git_commit": "c" * 40, "git_dirty": False}]}}
    assert code_md({"bf16": [resumed]}) == [head + "`ccccccc` 1 run, not recorded 1 run (runs from more than one "
                                            "revision: compare them knowing that)."]
