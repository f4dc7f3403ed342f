"""scripts/gpu_check.py's own steps on CPU (the whole script: `python scripts/gpu_check.py --dry-run`, about a minute)."""

from __future__ import annotations

import os
from script_module import load_script  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_check():
    return load_script("scripts/gpu_check.py")


def test_cost_step_reports_ratios_to_the_plain_linear():
    gpu_check = _gpu_check()
    gpu_check.check_learner_cost("cpu", True)
    (check, result, detail, _seconds), = gpu_check.ROWS
    assert check.startswith("learner cost") and result == "ok"
    assert detail.startswith("128x256x512 float32: fwd+bwd ") and "x bf16" in detail and "re-quantise" in detail


def test_device_tests_it_runs_read_the_device_setting():
    gpu_check = _gpu_check()
    for path in gpu_check.DEVICE_TESTS:
        with open(os.path.join(ROOT, path)) as f:
            assert "test_device" in f.read()
