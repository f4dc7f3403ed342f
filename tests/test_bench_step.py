"""benchmarks/bench_step.py: exclusive phase times from nested wrappers (exact, on a fake clock), and one smoke run
of both arms on a tiny random Qwen3 (slow: two real vLLM engines and trainers)."""

from __future__ import annotations

import re

import pytest
from script_module import load_script  # noqa: E402


def _bench_sync():
    return load_script("benchmarks/bench_sync.py")


class Work:
    """Methods that advance a fake clock: ``outer`` calls ``inner`` twice."""

    def __init__(self):
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def outer(self):
        self.now += 1.0
        self.inner()
        self.now += 0.5
        self.inner()
        return "done"

    def inner(self):
        self.now += 2.0


@pytest.fixture
def timed_work(monkeypatch):
    """(bench_sync.timed, a Work whose clock is bench_sync's perf_counter)."""
    bench_sync, work = _bench_sync(), Work()
    monkeypatch.setattr(bench_sync.time, "perf_counter", work.clock)
    return bench_sync.timed, work


def test_timed_nesting_counts_each_phase_once(timed_work):
    timed, work = timed_work
    nesting, outer_s, inner_s = [], [], []
    timed(work, "outer", outer_s, echo=False, nesting=nesting)
    timed(work, "inner", inner_s, echo=False, nesting=nesting)
    assert work.outer() == "done"
    work.inner()
    assert outer_s == [1.5] and inner_s == [2.0, 2.0, 2.0] and nesting == []


def test_timed_without_nesting_prints_inclusive_time(timed_work, capsys):
    timed, work = timed_work
    seconds = []
    timed(work, "outer", seconds)
    assert work.outer() == "done" and work.outer.__name__ == "outer"
    assert seconds == [5.5] and capsys.readouterr().out == "outer_s=5.500\n"


def test_floor_counts_the_lm_head_on_scored_positions_only(monkeypatch):
    import torch

    step_floor = load_script("benchmarks/step_floor.py")
    monkeypatch.setattr(step_floor, "machine_rates", lambda shapes: (1e9, 1e9, None))

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(8, 16)
            self.lm_head = torch.nn.Linear(16, 100)

        def get_output_embeddings(self):
            return self.lm_head

    floor = step_floor.StepFloor(Tiny(), engine_bytes_per_param=4)
    assert (floor.linear_params, floor.head_params) == (1728, 1600)
    # 10 positions through the body, 2 of them through the head (the completion tokens)
    assert floor.forward(10, 2) == pytest.approx(2 * (128 * 10 + 1600 * 2) / 1e9)
    assert floor.forward(10) == pytest.approx(2 * 1728 * 10 / 1e9)
    assert floor.backward(10, 2) == pytest.approx(floor.forward(10, 2) * 2)  # every weight trainable


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_step_smoke_prints_every_phase_and_the_ratio(capfd, in_process_vllm):
    """The script's ``main`` with its command line, in this process (an interpreter start with vLLM's imports
    saved)."""
    argv = ["--model", "tiny-qwen3", "--warmup", "0", "--steps", "1", "--prompts", "1", "--generations", "2",
            "--max-completion-length", "4", "--lora-rank", "4", "--nvfp4-recipe", "all"]
    capfd.readouterr()
    ratio = load_script("benchmarks/bench_step.py").main(argv)
    stdout = capfd.readouterr().out
    for arm in ("bf16_trl", "nvfp4_triage"):
        for phase in ("generation", "sync", "logprobs", "objective", "backward", "optimizer", "other", "step"):
            assert re.search(rf"^{arm} {phase}_s=-?\d+\.\d{{3}}$", stdout, re.M), (arm, phase)
    for arm in ("bf16_trl", "nvfp4_triage"):
        assert re.search(rf"^{arm}: fp32 GEMM \d+\.\d GFLOP/s", stdout, re.M), arm  # the machine's rates
    for phase in ("generation", "sync", "logprobs", "backward", "optimizer", "step"):  # measured, floor, / floor
        assert re.search(rf"^\| {phase} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", stdout,
                         re.M), phase
    floor_line, ratio_line = stdout.strip().splitlines()[-2:]
    match = re.fullmatch(r"step_over_floor=(\d+\.\d{3})", floor_line)
    assert match and float(match.group(1)) > 1.0, floor_line  # nothing runs below its floor
    match = re.fullmatch(r"nvfp4_triage_step_over_bf16=(\d+\.\d{3})", ratio_line)
    assert match and float(match.group(1)) == pytest.approx(ratio, abs=5e-4) and ratio > 0, ratio_line
