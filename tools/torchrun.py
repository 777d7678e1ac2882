"""torchrun as the launchers run it: the workers' own exit code, and stop signals forwarded to the workers.

    python -m tools.torchrun [torchrun arguments] SCRIPT [script arguments]

launch/run.sh and launch/multinode.sh (--torchrun) exec it in place of ``python -m torch.distributed.run``, and
tools.launch.torchrun_cmd (tests, tools, benchmarks) starts it; it runs torchrun in this process with two changes:

- Exit code: torchrun turns a failed worker into exit 1 and a ChildFailedError traceback. Here a worker killed by a
  signal (``kill -9``, a segfault, the OOM killer) is a lost rank: one ``error:`` line naming it, its pid and the
  signal, and exit 75 (retry later: a requeue resumes from the last complete checkpoint). Otherwise the job exits
  with the first failed worker's code when it is 2 (bad input), 3 (too many skipped updates) or 75 (a dependency is
  down, retry later), whose one ``error:`` line the recipe printed on rank 0, and otherwise with 1 after one
  ``[launch]`` line naming the rank and its code. 0 when every worker exits 0.
- Preemption: torchrun answers SIGTERM/SIGINT by terminating its workers within 30 s, too short for a FLUX.1-dev step
  and its checkpoint. Here the signal is forwarded to the workers, which finish the step, save a checkpoint and
  exit 0 (grpo/health.py); workers still running GRACE_S seconds (environment, default 600) after the first signal
  are killed and the job exits 1. A second SIGINT is forwarded too (the workers then stop at once). A signal before
  any worker has started stops the launch (exit 1).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

import psutil

from grpo.errors import COLLECTIVE_FAILED, EXIT_RETRY_LATER

GRACE_ENV, GRACE_DEFAULT_S = "GRACE_S", 600.0
# The exit codes the recipe gives meaning to (recipes/flux_grpo.py, grpo/errors.py); every other failure becomes 1.
PASSED_ON = (2, 3, EXIT_RETRY_LATER)


def children(pid: int | None = None) -> list[int]:
    """The pids whose parent is `pid` (this process by default): torchrun's workers, which it starts in their own
    sessions, so a signal to this process group does not reach them."""
    try:
        return [child.pid for child in psutil.Process(pid).children()]  # skips those that exit meanwhile
    except psutil.NoSuchProcess:
        return []


class Forwarder:
    """The SIGTERM/SIGINT handler: pass the signal to the workers; kill them `grace_s` seconds after the first one.
    Subclasses say who the workers are (tools/deepspeed_run.py)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.timer: threading.Timer | None = None
        self.killed = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self)

    def workers(self) -> list[int]:
        return children()

    def no_workers(self, signum: int) -> None:
        """A signal before any worker has started: nothing to save, stop here (torchrun cleans up as it unwinds)."""
        print(f"[launch] {signal.Signals(signum).name} before any worker started: stopping; exit 1",
              file=sys.stderr, flush=True)
        raise SystemExit(1)

    def _send(self, sig: int) -> list[int]:
        pids = self.workers()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def __call__(self, signum: int, frame) -> None:
        pids = self._send(signum)
        if not pids and self.timer is None:
            self.no_workers(signum)
            return
        print(f"[launch] {signal.Signals(signum).name}: passed to {len(pids)} workers, which finish the step, save a "
              f"checkpoint and exit; killed if still running after {GRACE_ENV}={self.grace_s:g}s", file=sys.stderr,
              flush=True)
        if self.timer is None:
            self.timer = threading.Timer(self.grace_s, self._kill)
            self.timer.daemon = True
            self.timer.start()

    def _kill(self) -> None:
        self.killed = True
        pids = self._send(signal.SIGKILL)
        print(f"[launch] {len(pids)} workers still running {self.grace_s:g}s after the stop signal: killed; raise "
              f"{GRACE_ENV} (and the scheduler's grace period) above one step plus a checkpoint save", file=sys.stderr,
              flush=True)


def grace_seconds() -> float:
    raw = os.environ.get(GRACE_ENV, "")
    try:
        grace = float(raw) if raw else GRACE_DEFAULT_S
    except ValueError:
        grace = float("nan")
    if not grace > 0 or grace == float("inf"):
        raise ValueError(f"error: {GRACE_ENV}: {raw!r}; give the seconds the workers get after a stop signal to finish "
                         f"the step and save, e.g. {GRACE_DEFAULT_S:g}")
    return grace


def start_forwarding(cls: type[Forwarder] = Forwarder) -> Forwarder | None:
    """A `cls` for GRACE_S, installed as the SIGTERM/SIGINT handler; None after printing the error line when GRACE_S
    is bad (the launcher then exits 2)."""
    try:
        forward = cls(grace_seconds())
    except ValueError as e:
        print(e, file=sys.stderr)
        return None
    forward.install()
    return forward


def _recipe_line(failure) -> str | None:
    """The `error:` line grpo.errors.rank_exit left in a worker's error file (torchelastic's format), else None."""
    message = getattr(failure, "message", None)
    text = message.get("message") if isinstance(message, dict) else message
    return text if isinstance(text, str) and text.startswith("error: ") else None


def lost_rank(failures: dict) -> str | None:
    """The `error:` line for a worker that died by a signal, e.g. ``kill -9`` or a segfault, else None.

    Which one: torchrun records the workers that failed by themselves first and those it then stopped after them
    (SIGTERM, SIGKILL 30 s later: torch/distributed/elastic/multiprocessing/api.py, _poll), and the dict keeps that
    order; SIGTERM is torchrun's own stop (the recipe turns an outside one into a clean stop), and a worker that
    left a recipe line in its error file ended by itself (its peer's death reached it, grpo.errors.peer_lost_exit)."""
    for rank, failure in failures.items():
        if _follow_on(failure) or failure.exitcode == -signal.SIGTERM:
            continue
        if failure.exitcode >= 0 or _recipe_line(failure) is not None:
            return None  # the first cause ended by itself; a peer stuck in a collective was SIGKILLed after it
        sig = signal.Signals(-failure.exitcode)
        return (f"error: rank {rank} (pid {failure.pid} on {socket.gethostname()}) was killed by signal "
                f"{sig.value} ({sig.name}), and the other ranks were stopped; rerun with checkpoint.resume=auto, "
                f"which continues from the last complete checkpoint (exit {EXIT_RETRY_LATER}: retry later)")
    return None


def _follow_on(failure) -> bool:
    """The worker ended because a peer had: its collective failed (grpo.errors.peer_lost_exit's line)."""
    line = _recipe_line(failure)
    return line is not None and line.startswith(f"error: {COLLECTIVE_FAILED}")


def _rank_zero_said(failures: dict) -> bool:
    """Rank 0 printed its recipe line (grpo.errors.rank_exit prints it before it writes its error file). Not when
    torchrun stopped rank 0 before it got there (a peer exited first), nor when rank 0 runs on another machine."""
    zero = failures.get(0)
    return zero is not None and _recipe_line(zero) is not None and not _follow_on(zero)


def exit_code(failures: dict, killed: bool = False) -> tuple[int, str | None]:
    """The job's exit code from torchrun's failures {rank: ProcessFailure}, and a line to print (None: the recipe
    printed its own). A worker killed by a signal is a lost rank (:func:`lost_rank`): 75, retry later, whatever its
    peers then did (unless `killed`: this launcher killed them after the grace period). Else a worker's 2, 3 or 75
    wins over the others' failures, which follow from it (a rank that left breaks its peers' collectives, then
    they end or torchrun stops them)."""
    lost = None if killed else lost_rank(failures)
    if lost:
        return EXIT_RETRY_LATER, lost
    # the ranks that ended because a peer had, or that torchrun stopped (SIGTERM), are no cause, unless they are all
    # there is (the peer that ended first ran on another machine): then a follow-on's line is the one to print, which
    # it did not
    causes = {r: f for r, f in failures.items() if not _follow_on(f) and f.exitcode != -signal.SIGTERM} or failures
    ranked = sorted(causes.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    for rank, failure in ranked:
        if failure.exitcode in PASSED_ON:
            return failure.exitcode, None if _rank_zero_said(failures) else _recipe_line(failure)
    # An outside failure that some rank met alone (grpo.errors.outside_exit): rank 0 printed its line if it met it
    # too; else the line of the first rank that did, instead of a [launch] line about a code 1.
    said = [line for line in (_recipe_line(f) for _, f in ranked) if line]
    if said:
        return 1, None if _rank_zero_said(failures) else said[0]
    rank, failure = next(((r, f) for r, f in ranked if f.exitcode > 0), ranked[0])
    how = (f"was killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0
           else f"exited with code {failure.exitcode}")
    return 1, f"[launch] rank {rank} {how} (see its output above); exit 1"


def main(argv: list[str] | None = None) -> int:
    forward = start_forwarding()
    if forward is None:
        return 2
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    # torchrun would answer SIGTERM/SIGINT with its own 30 s shutdown; it keeps its handling of the others.
    args.signals_to_handle = "SIGHUP,SIGQUIT"
    try:
        run(args)
    except ChildFailedError as e:
        # torchrun's own log of the failure would follow the recipe's error line; ours replaces it
        code, line = exit_code(e.failures, forward.killed)
        if forward.killed:
            code = 1
        if line:
            print(line, file=sys.stderr)
        return code
    finally:
        if forward.timer is not None:
            forward.timer.cancel()
    return 0


if __name__ == "__main__":
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    sys.exit(main())
