"""One writer per output_dir (grpo/lock.py): a live holder is refused with one line naming it, the lock goes away on
release (and so does an output_dir the run created and left empty). A stale lock's holder (a dead pid, a reused one,
a zombie) is a real process: tests/recipe/test_lock.py."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from grpo import lock
from grpo.errors import ConfigError


def _write_lock(out, pid, pid_start=None):
    out.mkdir(exist_ok=True)
    (out / lock.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "pid_start": pid_start,
                                             "time": 0}))


def test_acquire_release_and_an_empty_created_dir_goes_away(tmp_path):
    out = tmp_path / "run"
    held = lock.acquire(out)
    info = json.loads((out / lock.LOCK).read_text())
    assert info["pid"] > 0 and info["host"] == socket.gethostname()
    assert [p.name for p in out.iterdir()] == [lock.LOCK]
    held.release()
    assert not out.exists()


def test_live_holder_is_refused_with_its_name(tmp_path):
    out = tmp_path / "run"
    _write_lock(out, 1, lock._process_start(1))  # pid 1: alive on every machine
    with pytest.raises(ConfigError, match=r"^output_dir: .* is in use by host .* pid 1 "):
        lock.acquire(out)
    with pytest.raises(ConfigError, match="pid 1 "):
        lock.check_free(out)


def test_what_a_starting_rank_writes_does_not_make_output_dir_non_empty(tmp_path):
    # Rank 0 links the lock from `.lock.HOST.PID` and probes writability with a folder, while the other ranks check
    # that a new run's output_dir is empty: those entries must not count, or a rank fails alone (exit 2, silent) and
    # rank 0 dies in the lock's broadcast with gloo's "connection closed by peer" (seen twice in ~45 launches).
    from grpo.checkpoint import resume_point
    from grpo.config import load_config

    out = tmp_path / "run"
    out.mkdir()
    (out / f"{lock.LOCK}.{socket.gethostname()}.4242").write_text("{}")
    (out / f"{lock.WRITE_PROBE}x1y2").mkdir()
    _write_lock(out, pid=4242)
    preset = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "tiny" / "grpo_lora.yaml"
    cfg = load_config(str(preset), [f"output_dir={out}"])
    assert resume_point(cfg, 1) is None
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="is not empty"):
        resume_point(cfg, 1)


def test_the_start_time_tells_a_reused_pid_apart_in_both_formats(tmp_path):
    """psutil's create time ("%.2f" seconds) since the move from /proc; a lock an earlier version wrote holds /proc's
    clock ticks since boot, and its live holder is still refused (converted), while another start time is not it."""
    import os

    held = lock.acquire(tmp_path / "run")
    recorded = json.loads((tmp_path / "run" / lock.LOCK).read_text())["pid_start"]
    assert recorded == lock._process_start(os.getpid()) and "." in recorded
    held.release()
    now = lock._process_start(1)
    assert lock._same_start(now, now) and not lock._same_start(f"{float(now) - 5:.2f}", now)
    assert not lock._same_start("12345678", now) and not lock._same_start("garbage", now)
    stat = Path("/proc/1/stat")
    if stat.exists():  # Linux: the format of earlier locks
        ticks = stat.read_text().rsplit(")", 1)[1].split()[19]
        assert lock._same_start(ticks, now)
        _write_lock(tmp_path / "old", 1, ticks)
        with pytest.raises(ConfigError, match="pid 1 "):
            lock.check_free(tmp_path / "old")
