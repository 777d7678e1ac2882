"""Run the recipe's start-up checks for a preset (grpo/inputs.py) and exit 2 on bad input, before any rank starts.

    python -m tools.check --world-size N CONFIG [key=value ...]

launch/run.sh and launch/multinode.sh run it before torchrun, so that a bad setting costs no rank's imports. It
imports neither DeepSpeed nor (unless LoRA targets are checked) diffusers, so it takes a few seconds. ``--help`` also
lists every setting and reward option.
"""

from __future__ import annotations

import argparse
import sys

from grpo.config import describe_settings, load_config
from grpo.errors import run_command
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
    parser.add_argument("--world-size", type=int, required=True, help="processes the run will have, over all nodes")
    parser.add_argument("config", help="YAML preset, e.g. recipes/configs/tiny/grpo_lora.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. max_steps=10")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        print(f"error: --world-size: {args.world_size}; a run needs at least 1 process (launch/run.sh: set NPROC, "
              "or make the devices visible)", file=sys.stderr)
        return 2

    def body() -> None:
        check_inputs(load_config(args.config, args.overrides), args.world_size)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
