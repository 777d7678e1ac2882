"""The one error type for bad input, and how command lines report it."""

from __future__ import annotations

import sys
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
