"""Answer checks end within their time limit in any thread (triage_trl.answers.worker).

math-verify's own time limits use signal.alarm (main thread only); a SymPy power tower checked in a worker
thread held the GIL and never returned. Checks now run in helper processes that are killed when late.
"""

import threading
import time

import pytest

from triage_trl.answers import worker as answer_worker
from triage_trl.answers import check_answer, verify
from triage_trl.rewards import verified_answer_reward

TOWER = "So the total is \\boxed{9^{9^{9^{9}}}}"


def _in_thread(fn, join_s):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(join_s)
    assert not thread.is_alive(), f"the check did not return within {join_s} s in a worker thread"
    return result[0]


def test_power_tower_reward_is_zero_in_main_and_worker_thread():
    verify("\\boxed{1}", "1", kind="math")  # start the helper outside the timed part
    assert verified_answer_reward([TOWER], ["1"], ["math"]) == [0.0]
    # bounded by the 10 s limit (math-verify's own 5 s alarm ends it first); the join allows for a loaded machine
    assert _in_thread(lambda: verified_answer_reward([TOWER], ["1"], ["math"]), join_s=60) == [0.0]
    assert _in_thread(lambda: verify("\\boxed{\\frac{1}{2}}", "0.5", kind="math"), join_s=60) is True


def test_late_helper_is_killed_and_replaced():
    pool = answer_worker._get_pool()
    helper = pool.acquire()
    start = time.monotonic()
    # math-verify's own alarm set far away, so only the hard limit can end this check
    reply = helper.ask({"prediction_text": TOWER, "reference": "1", "kind": "math", "unit": None,
                        "step_timeout": 10_000}, timeout_seconds=1.0)
    assert reply is None and not helper.alive()
    assert time.monotonic() - start < 30
    pool.release(helper)
    assert verify("\\boxed{7}", "7", kind="math")  # a fresh helper answers


def test_helpers_serve_threads_at_once():
    refs = [str(i) for i in range(8)]
    results = [None] * 8

    def check(i):
        results[i] = check_answer(f"\\boxed{{{i}}}", refs[i], kind="gsm8k").correct

    threads = [threading.Thread(target=check, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [True] * 8
    assert answer_worker._get_pool().started <= answer_worker.MAX_WORKERS


def test_unknown_kind_is_refused_before_any_helper():
    with pytest.raises(ValueError, match="unknown answer kind"):
        check_answer("\\boxed{1}", "1", kind="mmlu")
