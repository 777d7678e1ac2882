"""tools/torchrun.py, the launchers' torchrun: the workers' exit code passed on, stop signals passed to the workers and
waited for (GRACE_S), with stand-in workers (a few seconds each; the recipe itself:
tests/recipe/test_bad_input_launch.py); the processes it signals. Its pieces in-process: tests/unit/test_torchrun.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import ROOT
from tools.launch import free_port, launch_env
from tools.torchrun import children

# A stand-in worker: its mode is the last argument's last path part (exit2, exit3, save, stuck; under launch/*.sh the
# output_dir=... override, which is all the recipe's command line carries through to every node).
WORKER = """
import os, signal, sys, time
from grpo.errors import rank_exit
rank, mode = int(os.environ["RANK"]), os.path.basename(sys.argv[-1].split("=")[-1])
if mode.startswith("exit"):
    sys.exit(rank_exit("error: x: bad", int(mode[4:])))  # what the recipe does on a bad input every rank finds
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
os.write(1, b"ready\\n")  # one write: the two workers share the pipe
while not got:
    time.sleep(0.05)
if mode == "stuck":
    time.sleep(600)
time.sleep(1)
print(f"rank {rank} saved", file=sys.stderr, flush=True)
"""


def _start(tmp_path, mode, env=None, launcher="tools.torchrun"):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", launcher, "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), mode]
    return subprocess.Popen(cmd, cwd=ROOT, env=launch_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_ready(proc, n=2):
    seen = ""
    while seen.count("ready") < n:
        line = proc.stdout.readline()
        assert line, "the workers ended before they were ready"
        seen += line


@pytest.mark.parametrize("code", [2, 75])  # bad input; a dependency is down, retry later
def test_worker_exit_2_is_the_launchers_with_one_line(tmp_path, code):
    proc = _start(tmp_path, f"exit{code}")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == "error: x: bad" and err.count("error:") == 1
    assert "Traceback" not in err and "ChildFailedError" not in err


@pytest.mark.slow
def test_plain_torchrun_exits_1_with_the_line_once_and_as_root_cause(tmp_path):
    """What a user's direct torchrun does with a rank's exit 2 (why the launchers use tools.torchrun): exit 1 and
    torchrun's traceback, but the error line is printed once and its report's root cause is that line."""
    proc = _start(tmp_path, "exit2", launcher="torch.distributed.run")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == ["error: x: bad"]
    root = err.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2" in root and "traceback : error: x: bad (exit 2: bad input;" in root


def test_sigterm_reaches_the_workers_and_is_waited_for(tmp_path):
    proc = _start(tmp_path, "save")
    _wait_ready(proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "rank 0 saved" in err and "rank 1 saved" in err and "Traceback" not in err


def test_workers_still_running_after_the_grace_period_are_killed(tmp_path):
    proc = _start(tmp_path, "stuck", {"GRACE_S": "1"})
    _wait_ready(proc)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert time.monotonic() - start < 60
    assert "still running 1s after the stop signal: killed" in err and "Traceback" not in err


def test_children_are_the_direct_children_still_running():
    """The workers the signals go to: this process's children, not their own children; gone once reaped."""
    nested = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
             "time.sleep(60)"
    parent, done = (subprocess.Popen([sys.executable, "-c", code]) for code in (nested, "pass"))
    try:
        done.wait()
        deadline = time.monotonic() + 30
        while not (below := children(parent.pid)):
            assert time.monotonic() < deadline, "the grandchild did not start"
            time.sleep(0.05)
        assert len(below) == 1
        mine = children()
        assert parent.pid in mine and done.pid not in mine and below[0] not in mine  # direct and running only
        assert children(2 ** 22 + 1) == []  # above Linux's largest pid: no such process
    finally:
        for pid in children(parent.pid) + [parent.pid]:
            os.kill(pid, signal.SIGKILL)
        parent.wait()
