"""`python -m tools [COMMAND [args]]`: the command lines, one line each (tools/cli.py's table, nothing heavy is
imported); with a command, runs it as ``flux-grpo COMMAND`` does."""

from __future__ import annotations

import sys

from tools.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tools"))
