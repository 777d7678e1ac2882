"""launch/multinode.sh hostfile form (the DeepSpeed launcher, through tools/deepspeed_run.py): the workers' exit codes
2 and 3 reach the caller with one error line, and SIGTERM to the script reaches the workers, which save and exit 0.

Stand-in workers (tests/recipe/test_torchrun.py's; the recipe's own stop is tested through launch/run.sh in
tests/recipe/test_bad_input_launch.py). One node: a localhost hostfile, which DeepSpeed runs without pdsh after its
ssh check (a fake `ssh`). Two nodes: the fake pdsh of tests/recipe/test_multinode_env.py, which runs each node's
command here with an empty environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import ROOT, TINY
from tests.recipe.launch import script_env
from tests.recipe.test_multinode_env import fake_remote_tools
from tests.recipe.test_torchrun import WORKER
from tools.launch import free_port

pytestmark = pytest.mark.slow  # each case starts the DeepSpeed launcher and its workers (30-70 s on 2 busy cores)


def _start(tmp_path: Path, mode: str, hosts: list[str], env: dict | None = None) -> subprocess.Popen:
    bin_dir = fake_remote_tools(tmp_path)
    (tmp_path / "worker.py").write_text(WORKER)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots={2 // len(hosts)}\n" for h in hosts))
    extra = {"RECIPE": str(tmp_path / "worker.py"), "DS_ACCELERATOR": "cpu", "MASTER_PORT": str(free_port()),
             "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "TMPDIR": str(tmp_path),
             "HOME": str(tmp_path), **(env or {})}
    cmd = ["bash", str(ROOT / "launch" / "multinode.sh"), str(hostfile),
           str(ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml"), f"model.path={TINY}",
           f"output_dir={tmp_path / mode}"]  # last: the worker's mode
    return subprocess.Popen(cmd, cwd=ROOT, env=script_env(extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_ready(proc: subprocess.Popen, n: int = 2) -> None:
    seen = 0
    while seen < n:
        line = proc.stdout.readline()
        assert line, "the workers ended before they were ready"
        seen += line.strip() == "ready"


def _leftovers(tmp_path: Path) -> list[int]:
    worker = str(tmp_path / "worker.py")
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if worker in (p.info["cmdline"] or []):
            found.append(p.info["pid"])
    return found


@pytest.mark.parametrize("hosts", [["localhost"], ["localhost", "127.0.0.1"]], ids=["1 node", "2 nodes (pdsh)"])
@pytest.mark.parametrize("code", [2, 3])
def test_a_workers_exit_code_2_or_3_is_the_scripts_with_one_line(tmp_path, hosts, code):
    proc = _start(tmp_path, f"exit{code}", hosts)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error:")] == ["error: x: bad"]
    assert "Traceback" not in err


@pytest.mark.parametrize("hosts", [["localhost"], ["localhost", "127.0.0.1"]], ids=["1 node", "2 nodes (pdsh)"])
def test_sigterm_reaches_the_workers_which_save_and_exit_0(tmp_path, hosts):
    """DeepSpeed's launcher alone: exit 143 with the workers left running (1 node), or the workers terminated at once
    and exit 1 (pdsh)."""
    proc = _start(tmp_path, "save", hosts)
    _wait_ready(proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "[launch] SIGTERM: passed to 2 workers" in err
    assert "rank 0 saved" in err and "rank 1 saved" in err and "Traceback" not in err
    assert not _leftovers(tmp_path)


def test_workers_still_running_after_the_grace_period_are_killed(tmp_path):
    proc = _start(tmp_path, "stuck", ["localhost"], {"GRACE_S": "2"})
    _wait_ready(proc)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert time.monotonic() - start < 60
    assert "still running 2s after the stop signal: killed" in err
    time.sleep(1)
    assert not _leftovers(tmp_path)
