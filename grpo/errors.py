"""The error types that end a run with a meaning (bad input; a failure outside the run, e.g. a server or the disk),
and how command lines and ranks report them: one `error:` line and an exit code."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable


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


# sysexits.h's EX_TEMPFAIL: "a temporary failure, retry later", the code that requeueing schedulers and service
# managers already know; a small number like 4 would say nothing to them and could clash with a wrapper's own codes.
EXIT_RETRY_LATER = 75
_MEANING = {2: "bad input", 3: "too many skipped updates", EXIT_RETRY_LATER: "a dependency is down, retry later"}


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


def outside_exit(err: OutsideFailure, out: str | Path, rank: int) -> int:
    """The one way a run ends on an OutsideFailure: this rank's traceback goes to output_dir/logs/error_rank{R}.txt
    (the cause of a cause is worth keeping, not worth showing), and rank 0 prints one line naming that file."""
    where = ""
    path = Path(out) / "logs" / f"error_rank{rank}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(err)))
        where = f" (traceback: {path})"
    except OSError:  # e.g. the disk that is full: the line and the code are the contract
        pass
    return rank_exit(f"error: {err}{where}", err.code, every_rank=True)


def rank_exit(line: str, code: int, every_rank: bool = False) -> int:
    """A rank's last words before exiting with a code that means something (2 bad input, 3 too many skipped updates, 75
    retry later): every rank finds the same problem, so rank 0 alone prints `line` on stderr. Under torchrun rank 0 also
    writes it to torchelastic's error file (TORCHELASTIC_ERROR_FILE, the format ErrorHandler.record_exception writes),
    so that a plain torchrun, which exits 1 with its ChildFailedError report, names that line and its code as the root
    cause instead of "To enable traceback see ...". every_rank: a failure that this rank may have met alone (the disk,
    during its own writes): every rank writes the error file, so tools/torchrun.py can print the line when rank 0 did
    not get to (its peers were stuck in a collective and torchrun stopped them). Returns `code`."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 and not every_rank:
        return code
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        shown = f"{line} (exit {code}: {_MEANING.get(code, 'see above')}; launch/run.sh passes the code on)"
        data = {"message": {"message": line, "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))}}}
        try:
            with open(error_file, "w") as f:
                json.dump(data, f)
        except OSError:  # the report is a courtesy; the printed line and the exit code are the contract
            pass
    return code
