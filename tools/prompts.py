"""Precompute a preset's prompt-embedding caches (train and eval prompt files) before training.

    python -m tools.prompts CONFIG [key=value ...]
"""

from __future__ import annotations

import logging
import sys

from grpo.config import load_config
from grpo.device import device_for_local_rank
from grpo.errors import run_command
from grpo.inputs import resolve_model_path
from grpo.prompts import ensure_cache


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.prompts CONFIG [key=value ...]`: precompute the embedding caches of a preset."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0 if argv else 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def body() -> str:
        cfg = load_config(argv[0], argv[1:])
        model_path = resolve_model_path(cfg.model.path, cfg.model.revision)
        device = device_for_local_rank(0)  # NPU, GPU or CPU, as the recipe picks it
        files = [("data.train_prompts", cfg.data.train_prompts), ("data.eval_prompts", cfg.data.eval_prompts)]
        return "\n".join(str(ensure_cache(model_path, f, setting, cfg.data, device))
                         for setting, f in files if f)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
