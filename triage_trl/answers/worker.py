"""Answer checks in helper processes, so that every check ends within its time limit, in any thread.

math-verify bounds its parse and compare steps with ``signal.alarm``, which works only in the main
thread, and a step such as SymPy evaluating ``9^{9^{9^{9}}}`` holds the GIL for as long as it runs: in
a worker thread (an async reward, a threaded evaluator) nothing in the process can stop it. So
:func:`run_check` sends each check to a helper process over a pipe and waits at most
``timeout_seconds``; a helper that has not answered by then is killed (the check counts as not
correct, with a warning) and a fresh one starts on the next call. The helper runs math-verify in its
own main thread with math-verify's alarms set to half the limit, so most slow checks end there and the
helper survives.

Cost: a helper starts in the time it takes to import math-verify and SymPy (2-3 s, once per process
and after each kill; not counted in the limit) and holds about 150 MB; a check adds one pipe round
trip to math-verify's own time. Helpers start on demand, one per concurrent caller up to
:data:`MAX_WORKERS`; a forked child process starts its own. The helper imports the answer modules
without the package's ``__init__`` (which loads torch).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

MAX_WORKERS = max(1, min(4, os.cpu_count() or 1))
"""Helper processes at most per process (one per thread checking at the same time)."""

STARTUP_TIMEOUT_S = 300.0
"""How long a helper may take to import math-verify before :func:`run_check` raises."""

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the triage_trl folder
_BOOTSTRAP = (
    "import sys, types\n"
    "pkg = types.ModuleType('triage_trl'); pkg.__path__ = [sys.argv[1]]; sys.modules['triage_trl'] = pkg\n"
    "from triage_trl.answers.worker import serve\n"
    "serve()\n"
)


class _Helper:
    """One helper process and its pipes; a request is one JSON line, so is the reply."""

    def __init__(self):
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, _PACKAGE_DIR],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
        )
        self._buffer = b""
        if self._read_line(time.monotonic() + STARTUP_TIMEOUT_S) != b"ready":
            self.kill()
            self._stderr.seek(0)
            tail = self._stderr.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"The answer-check helper process did not start (is math-verify installed?):\n{tail}")

    def _read_line(self, deadline: float) -> bytes | None:
        """The next reply line, or ``None`` when the deadline passes or the helper has exited."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def ask(self, request: dict, timeout_seconds: float) -> dict | None:
        """Send ``request``; the reply, or ``None`` (helper killed) when none came within ``timeout_seconds``."""
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        line = self._read_line(time.monotonic() + timeout_seconds)
        if line is None:
            self.kill()
            return None
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            stream.close()


class _Pool:
    """Idle helpers, started on demand up to ``size``; belongs to the process that made it."""

    def __init__(self, size: int):
        self.size, self.pid, self.started = size, os.getpid(), 0
        self.idle: list[_Helper] = []
        self.running: set[_Helper] = set()
        self.cond = threading.Condition()

    def acquire(self) -> _Helper:
        with self.cond:
            while not self.idle and self.started >= self.size:
                self.cond.wait()
            if self.idle:
                return self.idle.pop()
            self.started += 1
        try:
            helper = _Helper()
        except BaseException:
            self.release(None)
            raise
        with self.cond:
            self.running.add(helper)
        return helper

    def release(self, helper: _Helper | None) -> None:
        """Give ``helper`` back (``None`` or a dead one: it is gone, a new one may start)."""
        with self.cond:
            if helper is not None and helper.alive():
                self.idle.append(helper)
            else:
                self.started -= 1
                self.running.discard(helper)
            self.cond.notify()

    def close(self) -> None:
        """Kill every helper (at exit; also those a thread still waits on)."""
        if os.getpid() == self.pid:
            with self.cond:
                for helper in self.running:
                    helper.kill()
                self.running.clear()
                self.idle.clear()


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _get_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():  # a forked child must not share its parent's pipes
            _pool = _Pool(MAX_WORKERS)
            atexit.register(_pool.close)
        return _pool


def run_check(request: dict, *, timeout_seconds: float) -> dict | None:
    """Run ``triage_trl.answers`` checking ``request`` in a helper process, within ``timeout_seconds``.

    Args:
        request: ``{"prediction_text", "reference", "kind", "unit"}`` (already validated).
        timeout_seconds: wall-clock limit from sending the request to the reply (seconds, > 0).

    Returns:
        ``{"correct": bool, "extracted": str | None}``, or ``None`` when the helper did not answer in
        time or died (it is then killed and replaced; a warning is logged).

    Raises:
        RuntimeError: a helper process could not start.
    """
    pool = _get_pool()
    step_timeout = max(1, int(timeout_seconds / 2))
    for attempt in range(2):
        helper = pool.acquire()
        try:
            reply = helper.ask({**request, "step_timeout": step_timeout}, timeout_seconds)
        except (BrokenPipeError, OSError):  # died while idle (e.g. killed from outside): retry once on a new one
            helper.kill()
            pool.release(None)
            if attempt == 0:
                continue
            raise
        pool.release(helper)
        if reply is None:
            logger.warning("Answer check stopped after %.3g s and counted as not correct: %r",
                           timeout_seconds, request["prediction_text"][-200:])
        elif "error" in reply:
            logger.warning("Answer check failed (%s) and counted as not correct: %r",
                           reply["error"], request["prediction_text"][-200:])
        return reply
    return None


def serve() -> None:
    """The helper's loop: one JSON request per stdin line, one JSON reply per stdout line, until stdin closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which then closes our stdin
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from .check import check_in_process

    check_in_process("\\boxed{1}", "1", "math", None, None)  # import and compile everything before "ready"
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the replies
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            check = check_in_process(request["prediction_text"], request["reference"], request["kind"], request["unit"],
                                request["step_timeout"])
            reply = {"correct": check.correct, "extracted": check.extracted}
        except Exception as error:  # a check that raises is not correct; the helper keeps serving
            reply = {"correct": False, "extracted": None, "error": repr(error)}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


__all__ = ["MAX_WORKERS", "STARTUP_TIMEOUT_S", "run_check"]
