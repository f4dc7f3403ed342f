"""benchmarks/bench_step.py: exclusive phase times from nested wrappers (exact, on a fake clock), and one smoke run
of both arms on a tiny random Qwen3 (slow: two real vLLM engines and trainers)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def _bench_sync():
    spec = importlib.util.spec_from_file_location("bench_sync", os.path.join(BENCHMARKS, "bench_sync.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timed_nesting_counts_each_phase_once(monkeypatch):
    bench_sync = _bench_sync()
    clock = FakeClock()
    monkeypatch.setattr(bench_sync.time, "perf_counter", clock)

    class Work:
        def outer(self):
            clock.now += 1.0
            self.inner()
            clock.now += 0.5
            self.inner()
            return "done"

        def inner(self):
            clock.now += 2.0

    work, nesting = Work(), []
    outer_s, inner_s = [], []
    bench_sync.timed(work, "outer", outer_s, echo=False, nesting=nesting)
    bench_sync.timed(work, "inner", inner_s, echo=False, nesting=nesting)
    assert work.outer() == "done"
    work.inner()
    assert outer_s == [1.5] and inner_s == [2.0, 2.0, 2.0] and nesting == []


def test_timed_without_nesting_prints_inclusive_time(monkeypatch, capsys):
    bench_sync = _bench_sync()
    clock = FakeClock()
    monkeypatch.setattr(bench_sync.time, "perf_counter", clock)

    class Work:
        def run(self):
            clock.now += 0.25

    work, seconds = Work(), []
    bench_sync.timed(work, "run", seconds)
    work.run()
    assert seconds == [0.25] and capsys.readouterr().out == "run_s=0.250\n"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_step_smoke_prints_every_phase_and_the_ratio():
    cmd = [sys.executable, os.path.join(BENCHMARKS, "bench_step.py"), "--model", "tiny-qwen3", "--warmup", "0",
           "--steps", "1", "--prompts", "1", "--generations", "2", "--max-completion-length", "4"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=580, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for arm in ("bf16_trl", "nvfp4_triage"):
        for phase in ("generation", "sync", "logprobs", "objective", "backward", "optimizer", "other", "step"):
            assert re.search(rf"^{arm} {phase}_s=-?\d+\.\d{{3}}$", done.stdout, re.M), (arm, phase)
    last = done.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"nvfp4_triage_step_over_bf16=(\d+\.\d{3})", last)
    assert match and float(match.group(1)) > 0, last
