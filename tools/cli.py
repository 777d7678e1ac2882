"""`flux-grpo COMMAND [args]`: one command line for the recipe and the tools, each subcommand a tool's ``main(argv)``.

    flux-grpo                      the commands by group, one line each (nothing heavy is imported)
    flux-grpo COMMAND --help       the details of one
    flux-grpo train --config CONFIG [key=value ...]     the recipe in this process (= python recipes/flux_grpo.py)

The table below is the list: `python -m tools` prints the same and ``python -m tools.NAME`` still runs each tool.
The exit code is the command's own (2: bad input, one line on stderr). Presets name their files (assets/, ds_configs/)
relative to the working directory: run the commands from the checkout (pip install -e . is the supported install).
Several processes: ``bash launch/run.sh CONFIG`` (start-up checks, then torchrun of the recipe).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple

PROG = "flux-grpo"


class Command(NamedTuple):
    target: str  # "module:function", a function of argv returning the exit code (None = 0)
    summary: str


# Every tools/*.py with a main() is here (tests/unit/test_cli.py checks it), in the group and order it is listed in.
# The tiny worlds' builders are not: they make this repository's own fixtures (maintainer/tiny_worlds/, unpackaged).
GROUPS: dict[str, dict[str, Command]] = {
    "train and inspect": {
        "train": Command("tools.cli:train", "run the recipe (recipes/flux_grpo.py) in this process; launch/run.sh for "
                                            "several"),
        "check": Command("tools.check:main", "a preset's start-up checks (exit 2 on bad input), or --resolved "
                                             "settings"),
        "plan": Command("tools.plan:main", "per-device memory under ZeRO-3: does a config fit, what to change if not"),
        "prompts": Command("tools.prompts:main", "precompute a preset's prompt-embedding caches before training"),
    },
    "evaluate and ship": {
        "eval": Command("tools.eval:main", "evaluate a checkpoint offline on held-out prompts"),
        "bench": Command("tools.bench:main", "a prompt suite under its pinned protocol: base vs checkpoint paired, "
                                             "report.md and report.json"),
        "compare": Command("tools.compare:main", "paired gains and differences of tools.eval's scores.json files"),
        "export": Command("tools.export:main", "export a training checkpoint to plain diffusers weights"),
        "report": Command("tools.report:main", "a run's markdown page: curves, held-out table, throughput, "
                                               "manifest"),
        "rewards": Command("tools.rewards:main", "list the rewards, score a folder of images, or serve rewards over "
                                                 "HTTP"),
    },
    "porting to NPU": {
        "align": Command("tools.align:main", "precision alignment: one seeded step under two settings, block by block"),
        "npu-audit": Command("tools.npu_audit:main", "list the ops of a preset's step that would hurt on Ascend NPUs"),
        "device-check": Command("tools.device_check:main", "check your first GPU or NPU machine in one command: "
                                                           "device tests, tiny run, alignment, benchmark"),
    },
    # What launch/run.sh and launch/multinode.sh run; listed so that nothing the command runs is hidden.
    "launcher plumbing": {
        "torchrun": Command("tools.torchrun:main", "torchrun as the launchers run it: the workers' exit code, signals "
                                                   "forwarded"),
        "deepspeed-run": Command("tools.deepspeed_run:main", "the DeepSpeed launcher as launch/multinode.sh runs it"),
    },
}
COMMANDS: dict[str, Command] = {name: cmd for group in GROUPS.values() for name, cmd in group.items()}


def train(argv: Sequence[str] | None = None) -> int:
    """The recipe's own command line (``--config CONFIG [key=value ...]``), loaded as tools/_recipe.py loads it."""
    from tools._recipe import load_recipe

    return load_recipe().main(None if argv is None else list(argv))


def listing(prog: str = PROG) -> str:
    """The usage line, then the commands by group, one line each."""
    width = max(map(len, COMMANDS))
    lines = [f"usage: {prog} COMMAND [args]   ({prog} COMMAND --help for the details of one)"]
    for group, commands in GROUPS.items():
        lines += ["", f"{group}:", *(f"  {name:<{width}}  {cmd.summary}" for name, cmd in commands.items())]
    return "\n".join(lines)


def resolve(name: str):
    """The function a command runs (imports its module)."""
    module, _, func = COMMANDS[name].target.partition(":")
    return getattr(importlib.import_module(module), func)


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Runs ``argv[0]``'s command with the rest of argv and returns its exit code; no command lists them (exit 0),
    an unknown one is bad input (exit 2, one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(listing(prog))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: {prog}: unknown command {name!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    sys.argv = [f"{prog} {name}", *rest]  # what a tool's argparse shows as its program when it takes no prog=
    try:
        code = resolve(name)(rest)
    except SystemExit as e:  # argparse's exit 2 for bad usage, --help's 0, a tool's own sys.exit(code)
        code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): the message and exit 1, as the interpreter does
    return 1


if __name__ == "__main__":
    sys.exit(main())
