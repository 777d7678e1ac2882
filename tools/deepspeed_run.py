"""The DeepSpeed launcher as launch/multinode.sh runs it: stop signals reach the workers, whose exit code is kept.

launch/multinode.sh (hostfile form) runs it in place of ``deepspeed``: on SIGTERM the workers save and exit 0, and
the job's exit code is the workers'.

    python -m tools.deepspeed_run [deepspeed arguments] SCRIPT [script arguments]

DeepSpeed 0.19's launcher alone (measured with a localhost hostfile, tests/recipe/test_multinode_signals.py):
- SIGTERM to its runner on one node ends the runner (exit 143; it installs no handler there) and leaves the workers
  training, orphaned; on several nodes (pdsh) the runner and each node's ``deepspeed.launcher.launch`` terminate the
  workers at once (SIGKILL 30 s later) and exit 1: no checkpoint for a step longer than that.
- Its exit code is the first failed worker's on each node, and pdsh -S's largest over the nodes: 2 and 3 survive,
  but a worker killed by a signal gives 256 - signal.

Here the runner starts in its own session (a terminal's Ctrl-C or a signal to this process group reaches this process
only), and:
- SIGTERM/SIGINT go to the workers on this machine (the children of ``deepspeed.launcher.launch``): they finish the
  step, agree with every other rank to stop (an all-reduce, grpo/health.py), save and exit 0, so a signal to the
  launching node stops the whole job. Workers still running GRACE_S seconds later (tools/torchrun.py) are killed and
  DeepSpeed's own teardown stops the rest (exit 1). A signal when no worker runs on this machine (not yet, or this
  machine is not in the hostfile) goes to DeepSpeed's launcher processes, which stop the job their way (exit 1).
- Exit code: 0, 2, 3 and 75 pass; 256 - signal (a worker killed by that signal, e.g. 247 for ``kill -9``) is a lost
  rank: 75 after one ``error:`` line; anything else is 1 after one ``[launch]`` line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from grpo.errors import EXIT_RETRY_LATER
from tools.torchrun import PASSED_ON, Forwarder, start_forwarding

# What DeepSpeed's launch.py exits with when a worker died by a signal is 256 - signal (sys.exit of the negative
# returncode); only these signals are read that way (SIGTERM is DeepSpeed's own stop of the other workers).
LOST_SIGNALS = {signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}
LAUNCH_MODULE = "deepspeed.launcher.launch"  # what the runner starts on every node; its children are the ranks


def is_launch(cmdline: list[str]) -> bool:
    """`cmdline` is Python running ``-m deepspeed.launcher.launch`` (pdsh's, which carries the same words as its
    remote command, is not: its first argument that is not an option is no ``-m``)."""
    for i, arg in enumerate(cmdline[1:], 1):
        if arg == "-m":
            return cmdline[i + 1:i + 2] == [LAUNCH_MODULE]
        if not arg.startswith("-"):
            return False
    return False


def launch_workers(root: int) -> list[int]:
    """The pids below `root` whose parent is a ``deepspeed.launcher.launch`` process: the ranks on this machine."""
    try:
        below = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for proc in below:
        try:
            parent = proc.parent()
            if parent is not None and is_launch(parent.cmdline()):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):  # exited meanwhile
            pass
    return found


class DeepSpeedForwarder(Forwarder):
    """Forwarder whose workers are the DeepSpeed launcher's ranks on this machine."""

    def __init__(self, grace_s: float):
        super().__init__(grace_s)
        self.runner: subprocess.Popen | None = None

    def workers(self) -> list[int]:
        return launch_workers(self.runner.pid) if self.runner is not None else []

    def _stop_launcher(self, sig: int) -> None:
        try:
            os.killpg(self.runner.pid, sig)  # its own session: the runner, pdsh and this node's launch processes
        except ProcessLookupError:
            pass

    def no_workers(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.runner is None:
            print(f"[launch] {name} before the DeepSpeed launcher started: stopping; exit 1", file=sys.stderr,
                  flush=True)
            raise SystemExit(1)
        print(f"[launch] {name}: no worker runs on this machine; passed to the DeepSpeed launcher, which stops the "
              "workers at once (resume from the last periodic checkpoint)", file=sys.stderr, flush=True)
        self.killed = True
        self._stop_launcher(signum)

    def _kill(self) -> None:
        super()._kill()
        self._stop_launcher(signal.SIGTERM)  # the runner's own teardown reaches the other nodes (pdsh pkill)


def exit_code(code: int, killed: bool) -> tuple[int, str | None]:
    """The job's exit code from the runner's, and a line to print (None: the recipe printed its own). 256 - signal,
    for the signals that kill a process from outside or on a crash (LOST_SIGNALS), is a worker killed by it: a lost
    rank, 75 as under tools/torchrun.py, but DeepSpeed's launcher says neither which rank nor its pid."""
    if killed:
        return 1, None
    if code == 0 or code in PASSED_ON:
        return code, None
    if 256 - code in LOST_SIGNALS:
        sig, name = 256 - code, signal.Signals(256 - code).name
        return EXIT_RETRY_LATER, (f"error: a worker was killed by signal {sig} ({name}; the DeepSpeed launcher exited "
                                  f"{code} and names no rank: see its output above), and the other ranks were "
                                  "stopped; rerun with checkpoint.resume=auto, which continues from the last complete "
                                  f"checkpoint (exit {EXIT_RETRY_LATER}: retry later)")
    return 1, (f"[launch] the DeepSpeed launcher exited with code {code} (a worker failed or was killed; see the "
               "output above); exit 1")


def main(argv: list[str] | None = None) -> int:
    forward = start_forwarding(DeepSpeedForwarder)
    if forward is None:
        return 2
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *(sys.argv[1:] if argv is None else argv)]
    forward.runner = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = forward.runner.wait()  # resumed after each signal handler (PEP 475)
    finally:
        if forward.timer is not None:
            forward.timer.cancel()
    code, line = exit_code(code, forward.killed)
    if line:
        print(line, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
