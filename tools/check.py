"""Run the recipe's start-up checks for a preset (grpo/inputs.py) and exit 2 on bad input, before any rank starts.

    python -m tools.check --world-size N CONFIG [key=value ...]
    python -m tools.check --resolved CONFIG [key=value ...]

--resolved prints the whole preset as the run sees it (its `extends:` chain merged, the overrides applied), each key
under its help text: YAML that loads back to the same settings, to read or to copy and edit.

launch/run.sh and launch/multinode.sh run it before torchrun, so that a bad setting costs no rank's imports. It
imports neither DeepSpeed nor (unless LoRA targets are checked) diffusers, so it takes a few seconds. ``--help`` also
lists every setting and reward option.
"""

from __future__ import annotations

import argparse
import sys

from grpo.config import describe_settings, load_config, to_dict
from grpo.errors import run_command
from grpo.schema import annotated
from grpo.inputs import check_inputs
from grpo.rewards.registry import describe_rewards


class _SettingsHelpParser(argparse.ArgumentParser):
    """--help also lists every setting (from the schema) and every reward option (from the reward registry)."""

    def format_help(self) -> str:
        rewards = ["Reward options (rewards.NAME.OPTION; NAME@label to use a reward twice):",
                   *("  " + line for line in describe_rewards())]
        return "\n".join([super().format_help(), describe_settings(), "", *rewards, ""])


def main(argv: list[str] | None = None) -> int:
    parser = _SettingsHelpParser(prog="python -m tools.check",
                                 description="Run the recipe's start-up checks for a preset; exit 2 on bad input.")
    parser.add_argument("--world-size", type=int, help="processes the run will have, over all nodes")
    parser.add_argument("--resolved", action="store_true",
                        help="print every setting of the preset (extends merged, overrides applied) with its help, "
                             "as YAML; no --world-size needed")
    parser.add_argument("config", help="YAML preset, e.g. recipes/configs/tiny/grpo_lora.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. max_steps=10")
    args = parser.parse_args(argv)
    if args.resolved:
        return run_command(lambda: resolved(args.config, args.overrides))
    if args.world_size is None:
        parser.error("the following arguments are required: --world-size (or --resolved to print the settings)")
    if args.world_size < 1:
        print(f"error: --world-size: {args.world_size}; a run needs at least 1 process (launch/run.sh: set NPROC, "
              "or make the devices visible)", file=sys.stderr)
        return 2

    def body() -> None:
        check_inputs(load_config(args.config, args.overrides), args.world_size)

    return run_command(body)


def resolved(config: str, overrides: list[str]) -> str:
    """The settings `load_config(config, overrides)` returns, as commented YAML that loads back to them."""
    cfg = load_config(config, overrides)
    command = " ".join(["python -m tools.check --resolved", config, *overrides])
    header = [f"# {command}",
              "# Every setting of the run, each under its help; loads back as a preset (no extends) with the same "
              "settings."]
    return "\n".join([*header, *annotated(cfg, order=list(to_dict(cfg)))])  # the objective's section after algorithm


if __name__ == "__main__":
    sys.exit(main())
