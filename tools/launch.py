"""Starting jobs on this machine: a free port, torchrun command lines (through tools/torchrun.py) and the one
environment of every child process, for benchmarks, tools and tests.

    cmd = torchrun_cmd(2, ["recipes/flux_grpo.py", "--config", CONFIG])   # the command line only
    proc = run_torchrun(2, [script, *args])                                # run it to the end
    env = launch_env(job=False)                      # a plain process: no surrounding job's rank variables

The port helper is the runtime's own (grpo.device fills in MASTER_PORT for a 1-process job with it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from grpo.device import free_port

__all__ = ["JOB_VARS", "ROOT", "free_port", "launch_env", "run_torchrun", "torchrun_cmd"]

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


# A surrounding job's rank and launcher variables (torchrun's, the DeepSpeed CPU accelerator's LOCAL_SIZE, the
# launch/*.sh NPROC/NNODES/NODE_RANK): a process that is not one of that job's ranks must not inherit them, or it
# joins (or waits for) a job it is not part of.
JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "NPROC", "NNODES", "NODE_RANK")


def launch_env(extra: Mapping[str, str | None] | None = None, accelerator: str | None = "cpu", *, job: bool = True,
               threads: int | None = 1, unbuffered: bool = True) -> dict[str, str]:
    """The environment of a child process (a torchrun job, launch/*.sh, a plain recipe, tool or benchmark process)
    that a test, a benchmark or a tool starts: this process's environment with

    - DS_ACCELERATOR=`accelerator`: DeepSpeed picks its accelerator once per process, from the environment, before
      anything imports it. None: as it is here (unset stays unset: DeepSpeed detects the device; the benchmarks'
      workers default it to cpu themselves);
    - OMP_NUM_THREADS=`threads`: one thread per process, the CPU cores are shared by the ranks and by other jobs.
      None: as it is here (on-device checks, whose CPU side should not be slowed down);
    - PYTHONPATH=the repository root: ``python -m tools.X``, recipes/ and benchmarks/ scripts import grpo;
    - HF_HUB_OFFLINE=1: nothing started from here touches a model hub;
    - PYTHONUNBUFFERED=1 when `unbuffered`: a killed or timed-out child's last lines still reach its log;
    - job=False: without a surrounding job's rank and launcher variables (JOB_VARS), for a process that is not one of
      its ranks (a plain recipe process, launch/*.sh, a single-process check); job=True keeps them (a torchrun
      command line sets its own for its workers);
    - then `extra`, where a None value leaves that variable out.
    """
    env = {k: v for k, v in os.environ.items() if job or k not in JOB_VARS}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    if accelerator is not None:
        env["DS_ACCELERATOR"] = accelerator
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run_torchrun(nproc: int, script: list[str], *, timeout: float = 900, extra_env: dict | None = None,
                 accelerator: str | None = "cpu", check: bool = True) -> subprocess.CompletedProcess:
    """Runs `script` under torchrun from the repository root in :func:`launch_env` and waits for it (output captured
    as text). check: raise RuntimeError with the end of stderr when the job fails."""
    proc = subprocess.run(torchrun_cmd(nproc, script), env=launch_env(extra_env, accelerator), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"torchrun {' '.join(map(str, script))} failed:\n{proc.stderr[-4000:]}")
    return proc
