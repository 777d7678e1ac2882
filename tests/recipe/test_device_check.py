"""tools/device_check.py with real processes: the time limit that kills a part's whole process group, and (slow) the
whole command on the CPU with tiny sizes (--cpu), the same plumbing a GPU or NPU run goes through. The verdicts and the
refusal without an accelerator: tests/unit/test_device_check.py."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from tests import ROOT
from tests.recipe.launch import script_env
from tools import device_check as dc


def test_a_part_over_its_limit_is_killed_with_everything_it_started(tmp_path):
    part = dc.Part("slow", ["bash", "-c", f"sleep 60 & echo $! > {tmp_path / 'child'}; wait"],
                   lambda log, out: (True, ""))
    start = time.monotonic()
    line = dc.run_part(part, tmp_path, 1.0, {"PATH": "/usr/bin:/bin"})
    assert time.monotonic() - start < 10
    assert line.startswith("slow   TIMEOUT") and "killed after 1 s" in line and (tmp_path / "slow.log").exists()
    child = int((tmp_path / "child").read_text())

    def alive() -> bool:
        try:
            return psutil.Process(child).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    # SIGKILL went to the whole group; the orphaned grandchild's death (and init reaping it) is asynchronous, and on
    # a loaded machine it can still show as running for a moment (seen once in CI).
    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


@pytest.mark.slow
def test_the_whole_check_on_the_cpu(tmp_path):
    """Every part through launch/device_check.sh --cpu: tiny sizes, all pass, one line each, logs in one folder."""
    out = tmp_path / "check"
    proc = subprocess.run(["bash", str(ROOT / "launch" / "device_check.sh"), str(out), "--cpu"], cwd=tmp_path,
                          env=script_env(), capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[0].startswith("device_check: cpu (deepspeed.accelerator)")
    assert [line.split()[:2] for line in lines[1:]] == [[p, "PASS"] for p in ("tests", "ratio", "align", "bench")]
    assert "ratio_max_dev max 0 over 2 steps" in lines[2] and "cpu vs cpu fp32: worst block rel 0" in lines[3]
    assert sorted(p.name for p in out.glob("*.log")) == ["align.log", "bench.log", "ratio.log", "tests.log"]
    assert proc.stdout.splitlines()[-4:] == lines[1:]
