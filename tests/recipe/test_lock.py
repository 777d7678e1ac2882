"""One writer per output_dir (grpo/lock.py), with real processes as holders: a stale lock (a dead pid, a reused one)
is reported and taken over, and a zombie holder is stale. The rest: tests/unit/test_lock.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from grpo import lock
from tests.unit.test_lock import _write_lock


@pytest.mark.parametrize("case", ["dead pid", "reused pid"])
def test_stale_lock_is_reported_and_taken_over(tmp_path, caplog, case):
    out = tmp_path / "run"
    if case == "dead pid":
        done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        _write_lock(out, int(done.stdout))
    else:
        _write_lock(out, 1, "12345678")  # pid 1, but started at another time: a different process
    lock.check_free(out)  # not refused
    held = lock.acquire(out)
    assert "stale lock" in caplog.text
    assert json.loads((out / lock.LOCK).read_text())["pid"] != 1
    held.release()
    assert out.is_dir() and not (out / lock.LOCK).exists()  # it existed before: kept


def test_a_zombie_holder_is_stale(tmp_path):
    """A killed job's rank 0 left unreaped (a container's PID 1 may never reap it) does not hold the lock."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while lock._process_start(child.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)  # exits, stays a zombie until waited for
    out = tmp_path / "run"
    _write_lock(out, child.pid)
    try:
        lock.check_free(out)
    finally:
        child.wait()
