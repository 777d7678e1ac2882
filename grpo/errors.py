"""The error types that end a run with a meaning (bad input; a failure outside the run, e.g. a server or the disk),
and how command lines and ranks report them: one `error:` line and an exit code."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, NoReturn


class ConfigError(ValueError):
    """A bad setting: the message names the setting and the fix."""


def run_command(body: Callable[[], str | None]) -> int:
    """A command line's body: what it returns is printed on stdout; a ConfigError becomes one `error: ...` line on
    stderr and exit code 2, the code every bad input gets before heavy work."""
    try:
        out = body()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out is not None:
        print(out)
    return 0


# How grpo.health.comm_failure's diagnosis starts: a rank that ended because a peer had (tools/torchrun.py tells
# those from the cause by it).
COLLECTIVE_FAILED = "a collective failed"

# sysexits.h's EX_TEMPFAIL: "a temporary failure, retry later", the code that requeueing schedulers and service
# managers already know; a small number like 4 would say nothing to them and could clash with a wrapper's own codes.
EXIT_RETRY_LATER = 75
_MEANING = {2: "bad input", 3: "too many skipped updates",
            EXIT_RETRY_LATER: "retry later: a dependency is down or a rank was lost"}


class OutsideFailure(RuntimeError):
    """Something outside the run failed (a server, the disk), not the run itself: the message is one line naming the
    thing, the cause and the fix, and the run ends with :func:`outside_exit`'s line and `code` instead of a
    traceback. The last complete checkpoint is untouched, so checkpoint.resume=auto continues once it is fixed."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code
        self.agreed = False  # every rank raised it together (grpo.distributed.agreed_outside_failure)


class DependencyDown(OutsideFailure):
    """A service the run depends on stopped answering: retry later (exit EXIT_RETRY_LATER)."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_RETRY_LATER)


# The errnos of a file system that refuses writes for another reason than space: remounted read-only (EROFS),
# permissions or ownership changed (EACCES; EPERM from some network file systems and immutable files).
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def refused_write(err: BaseException, path: str | Path) -> OSError | None:
    """The OSError saying why the file system refuses writes under `path`, when that is what `err` is, else None.

    Python's and safetensors' writers raise an OSError with its errno; torch.save's C++ writer (DeepSpeed's
    checkpoint files) says only "Parent directory ... does not exist" or "cannot be opened", so then a probe file is
    written in `path` (or its nearest existing parent) and its own error taken."""
    if isinstance(err, OSError) and err.errno in UNWRITABLE:
        return err
    if not isinstance(err, (OSError, RuntimeError)):
        return None
    folder = Path(path)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as probe:  # named after the folder, not the probe's random name
        return OSError(probe.errno, probe.strerror, str(folder)) if probe.errno in UNWRITABLE else None


def unwritable(refused: OSError, path: str | Path, what: str, kept: str = "the files written before are intact") -> str:
    """The message of an OutsideFailure for a write under output_dir that the file system refused (exit 1: a
    read-only remount or a permission change does not undo itself, so not "retry later")."""
    where = refused.filename or path
    return (f"output_dir: cannot write {where} ({what}): {os.strerror(refused.errno)} "
            f"({errno.errorcode[refused.errno]}); {kept}. Make it writable again (remount it read-write, restore its "
            "permissions) or copy output_dir to a writable disk, then rerun with checkpoint.resume=auto")


@contextlib.contextmanager
def writes_under(out: str | Path, what: str) -> Iterator[None]:
    """A write the file system refuses inside the block (see :func:`refused_write`) becomes one OutsideFailure."""
    try:
        yield
    except Exception as err:
        refused = refused_write(err, out)
        if refused is None:
            raise
        raise OutsideFailure(unwritable(refused, out, what)) from err


def keep_traceback(err: BaseException, out: str | Path, rank: int) -> str:
    """Write `err`'s traceback to output_dir/logs/error_rank{R}.txt (the cause of a cause is worth keeping, not worth
    showing), or to the temporary directory when output_dir cannot be written; returns " (traceback: PATH)" for the
    line, or "" when neither could be written."""
    text = "".join(traceback.format_exception(err))
    path = Path(out) / "logs" / f"error_rank{rank}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return f" (traceback: {path})"
    except OSError:  # e.g. the disk that is full or read-only
        pass
    try:
        with tempfile.NamedTemporaryFile("w", prefix=f"flux_grpo-error_rank{rank}-", suffix=".txt",
                                         delete=False) as f:
            f.write(text)
        return f" (traceback: {f.name}, output_dir being unwritable)"
    except OSError:  # the line and the code are the contract
        return ""


def outside_exit(err: OutsideFailure, out: str | Path, rank: int) -> int:
    """The one way a run ends on an OutsideFailure: this rank's traceback goes to output_dir/logs/ and rank 0 prints
    one line naming that file."""
    return rank_exit(f"error: {err}{keep_traceback(err, out, rank)}", err.code)


def peer_lost_exit(err: BaseException, line: str, out: str | Path, rank: int, release: Callable[[], None]) -> NoReturn:
    """The end of a rank whose collective failed because a peer died or hung (`line`: health.comm_failure's
    diagnosis). Only the launcher knows which rank died and how, so it prints the run's one `error:` line
    (tools/torchrun.py); this rank logs its side, leaves `error: <line>` in its error file (the line a launcher prints
    when the lost rank ran on another machine) and exits EXIT_RETRY_LATER: a lost machine or process is
    infrastructure, a requeue on the last complete checkpoint continues the run.

    The process ends with os._exit after `release` (the output_dir lock): the process group is broken, and
    finalising it can abort the process (gloo, pytorch#190489) or hang (torchtitan#1342), either of which would
    replace the code."""
    # the launcher stops the survivors with SIGTERM as soon as it sees the lost rank: not before this is written
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    where = keep_traceback(err, out, rank)
    log = logging.getLogger("grpo.errors")
    log.error("rank %d: %s%s", rank, line, where)
    _error_file(f"error: {line}{where}", EXIT_RETRY_LATER)
    release()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_RETRY_LATER)


def rank_exit(line: str, code: int) -> int:
    """A rank's last words before exiting with a code that means something (2 bad input, 3 too many skipped updates, 75
    retry later): every rank finds the same problem, so rank 0 alone prints `line` on stderr. Under torchrun every rank
    also writes it to torchelastic's error file (TORCHELASTIC_ERROR_FILE, the format ErrorHandler.record_exception
    writes): a plain torchrun, which exits 1 with its ChildFailedError report, then names that line and its code as the
    root cause instead of "To enable traceback see ...", and tools/torchrun.py prints the line when rank 0 did not get
    to (another rank exited first and torchrun stopped rank 0, or rank 0 runs on another machine, or this rank met the
    failure alone: the disk, during its own writes). Returns `code`."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)
    _error_file(line, code)
    return code


def _error_file(line: str, code: int) -> None:
    """`line` and `code` in torchelastic's error file (TORCHELASTIC_ERROR_FILE), when a torchrun runs this rank."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    shown = f"{line} (exit {code}: {_MEANING.get(code, 'see above')}; launch/run.sh passes the code on)"
    data = {"message": {"message": line, "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))}}}
    try:
        with open(error_file, "w") as f:
            json.dump(data, f)
    except OSError:  # the report is a courtesy; the printed line and the exit code are the contract
        pass
