"""Shared test helpers: the tiny model's location and a 2-process launcher."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(os.environ.get("GRPO_TINY_MODEL", ROOT / "assets" / "tiny-flux"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(config: str, overrides: list[str], nproc: int, timeout: int = 600, extra_env: dict | None = None,
               script: list[str] | None = None) -> subprocess.CompletedProcess:
    """Launch recipes/flux_grpo.py (or `script`) with torchrun on the CPU accelerator; returns the finished process."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           *(script or [str(ROOT / "recipes" / "flux_grpo.py")]), "--config", config, *overrides]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
