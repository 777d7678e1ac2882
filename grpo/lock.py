"""One writer per output_dir: ``output_dir/.lock`` names the job writing it (host, pid, start time).

The recipe's rank 0 takes the lock before anything is written to output_dir (recipes/flux_grpo.py, the one caller of
:func:`acquire`) and removes it when the process exits; a second job on the same output_dir stops with exit code 2
and one line naming the holder (the launchers' start-up checks report it too, through :func:`check_free`, before
torchrun). A lock whose process is gone (same host, pid dead or reused by another program) is stale: it is reported
and taken over. A lock from another host cannot be checked from here: remove it by hand once that job is gone.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch.distributed as dist

from grpo.errors import ConfigError

log = logging.getLogger(__name__)

LOCK = ".lock"
# The writability probe grpo/inputs.py makes in output_dir and removes at once.
WRITE_PROBE = ".grpo-write-probe-"


def is_startup_entry(name: str) -> bool:
    """Whether an entry of output_dir is one that a starting job makes there: the lock, the file it is linked from
    (`.lock.HOST.PID`, present for an instant), or the writability probe. Another rank checking that output_dir is
    empty must not count them: it would fail alone and exit quietly while rank 0 waits in the lock's broadcast."""
    return name == LOCK or name.startswith(LOCK + ".") or name.startswith(WRITE_PROBE)


def _process_start(pid: int) -> str | None:
    """When `pid` started (psutil's create time, seconds since the epoch, as "%.2f": tells a reused pid apart), None
    if it is gone (a zombie counts as gone: a container's PID 1 may never reap it). "" where psutil cannot tell."""
    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return f"{proc.create_time():.2f}"
    except (psutil.NoSuchProcess, ValueError):  # ZombieProcess is a NoSuchProcess; ValueError: a negative pid
        return None
    except (psutil.AccessDenied, OSError):  # another user's process on a hardened host: alive, start unknown
        return "" if psutil.pid_exists(pid) else None


def _same_start(recorded: str, start: str) -> bool:
    """Whether a lock's recorded start time is `start`'s process. Earlier versions recorded /proc's clock ticks since
    boot (digits, no point): those are converted, so a lock of a job started before an upgrade is still honoured."""
    try:
        then = float(recorded)
    except (TypeError, ValueError):
        return False
    if "." not in str(recorded):  # /proc/PID/stat's starttime in clock ticks (grpo/lock.py before psutil)
        try:
            then = psutil.boot_time() + then / os.sysconf("SC_CLK_TCK")
        except (AttributeError, ValueError, OSError):
            return False
    return abs(then - float(start)) < 1.0  # one process's create time is fixed; the boot time may move by a second


def _holder(path: Path) -> dict | None:
    """The lock's content; None when there is no lock. Unreadable content counts as a live holder of unknown name."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        info = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return info if isinstance(info, dict) else {}


def _live(info: dict) -> bool:
    """Whether the lock's holder still runs (a lock from another host is taken as live: it cannot be checked)."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return True
    start = _process_start(info["pid"])
    return start is not None and (not info.get("pid_start") or not start or _same_start(info["pid_start"], start))


def _describe(info: dict) -> str:
    if not info:
        return "an unknown job (unreadable lock)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("time", 0)))
    return f"host {info.get('host')} pid {info.get('pid')} (since {since})"


def _refuse(out: Path, info: dict) -> ConfigError:
    return ConfigError(f"output_dir: {out} is in use by {_describe(info)}; wait for that job to end or stop it, or "
                       f"choose another output_dir (if that job is gone for good, delete {out / LOCK})")


def check_free(out: str | Path) -> None:
    """Raise the one-line ConfigError when a live job holds output_dir's lock; never writes."""
    out = Path(out)
    info = _holder(out / LOCK)
    if info is not None and _live(info):
        raise _refuse(out, info)


@dataclass
class Lock:
    path: Path
    created_dir: bool  # output_dir did not exist before: removed again on release when empty

    def release(self) -> None:
        info = _holder(self.path)
        if info and info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
            try:
                self.path.unlink(missing_ok=True)
            except OSError:  # output_dir turned read-only: the run's error line said so, the next start reports it
                pass
        if self.created_dir:
            try:
                self.path.parent.rmdir()  # only when empty: a run that wrote nothing leaves nothing
            except OSError:
                pass


def acquire(out: str | Path) -> Lock:
    """Take output_dir's lock for this process (released at exit); raise a one-line ConfigError when a live job
    holds it. A stale lock is reported and taken over."""
    out = Path(out)
    check_free(out)  # before the link file below: a refused start leaves output_dir as it was, to its mtime
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
          "time": time.time()}
    tmp = out / f"{LOCK}.{me['host']}.{me['pid']}"
    tmp.write_text(json.dumps(me))
    try:
        for _ in range(3):
            try:
                os.link(tmp, path)  # atomic, and the lock is complete the moment it exists
                break
            except FileExistsError:
                info = _holder(path)
                if info and info.get("pid") == me["pid"] and info.get("host") == me["host"]:
                    break  # this process holds it already (a second recipe object in one process)
                if info is not None and _live(info):
                    raise _refuse(out, info) from None
                if info is not None:
                    log.warning("output_dir: %s held a stale lock of %s (that process is gone); taking it over", out,
                                _describe(info))
                    path.unlink(missing_ok=True)
        else:
            raise _refuse(out, _holder(path) or {})
    finally:
        tmp.unlink(missing_ok=True)
    lock = Lock(path, created)
    atexit.register(lock.release)
    return lock


def take(out: str | Path, rank: int) -> Lock | None:
    """Collective under torch.distributed: rank 0 takes output_dir's lock (see :func:`acquire`), and every rank raises
    the same one-line ConfigError when a live job holds it. Returns rank 0's lock, None on the other ranks."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = acquire(out)
        except ConfigError as e:
            error = str(e)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(error)
    return lock
