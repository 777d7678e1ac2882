"""The one error type for bad input, and how command lines report it."""

from __future__ import annotations

import json
import os
import sys
import time
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


_MEANING = {2: "bad input", 3: "too many skipped updates"}


def rank_exit(line: str, code: int) -> int:
    """A rank's last words before exiting with a code that means something (2 bad input, 3 too many skipped updates):
    every rank finds the same problem, so rank 0 alone prints `line` on stderr. Under torchrun rank 0 also writes it
    to torchelastic's error file (TORCHELASTIC_ERROR_FILE, the format ErrorHandler.record_exception writes), so that
    a plain torchrun, which exits 1 with its ChildFailedError report, names that line and its code as the root
    cause instead of "To enable traceback see ...". Returns `code`."""
    if int(os.environ.get("RANK", "0")) != 0:
        return code
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
