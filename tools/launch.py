"""Starting jobs on this machine: a free port and torchrun command lines (through tools/torchrun.py), for benchmarks,
tools and tests.

    cmd = torchrun_cmd(2, ["recipes/flux_grpo.py", "--config", CONFIG])   # the command line only
    proc = run_torchrun(2, [script, *args])                                # run it to the end

The port helper is the runtime's own (grpo.device fills in MASTER_PORT for a 1-process job with it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from grpo.device import free_port

__all__ = ["ROOT", "free_port", "launch_env", "run_torchrun", "torchrun_cmd"]

ROOT = Path(__file__).resolve().parents[1]


def torchrun_cmd(nproc: int, script: list[str], *, nnodes: int = 1, node_rank: int = 0, port: int | None = None,
                 addr: str = "127.0.0.1") -> list[str]:
    """``python -m tools.torchrun ... SCRIPT``: `nproc` processes per node meeting at addr:port (a free port when
    None). `script` is a file with its arguments, or ``["-m", "package.module", ...]``. tools.torchrun is torchrun
    with the workers' exit code (2, 3) passed on and stop signals forwarded, as launch/run.sh runs it; it needs the
    repository importable (launch_env)."""
    return [sys.executable, "-m", "tools.torchrun", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
            "--nproc_per_node", str(nproc), "--master_addr", addr, "--master_port", str(port or free_port()),
            *script]


def launch_env(extra: dict | None = None, accelerator: str | None = "cpu") -> dict:
    """The environment of a launched job: DeepSpeed's `accelerator` (None: keep DS_ACCELERATOR, default cpu), one
    thread per process (the CPU cores are shared), the repository importable, no model hub, unbuffered output."""
    return {**os.environ, "DS_ACCELERATOR": accelerator or os.environ.get("DS_ACCELERATOR", "cpu"),
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            **(extra or {})}


def run_torchrun(nproc: int, script: list[str], *, timeout: float = 900, extra_env: dict | None = None,
                 accelerator: str | None = "cpu", check: bool = True) -> subprocess.CompletedProcess:
    """Runs `script` under torchrun from the repository root in :func:`launch_env` and waits for it (output captured
    as text). check: raise RuntimeError with the end of stderr when the job fails."""
    proc = subprocess.run(torchrun_cmd(nproc, script), env=launch_env(extra_env, accelerator), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"torchrun {' '.join(map(str, script))} failed:\n{proc.stderr[-4000:]}")
    return proc
