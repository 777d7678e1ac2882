"""launch/multinode.sh hostfile mode: every variable launch/npu_env.sh exports reaches a rank on the other nodes.

The DeepSpeed launcher starts the other nodes' workers through pdsh + ssh with only the variables of its export
prefixes and those of a ".deepspeed_env" file. Here two "nodes" (localhost and 127.0.0.1) run on this machine: a fake
`ssh` answers the launcher's reachability check and a fake `pdsh` runs each node's command with `env -i` (an empty
environment, as a fresh ssh login would give), so only what the launcher exports arrives. The ranks run a tiny
script (RECIPE) that records its environment, not the recipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import ROOT
from tests.recipe.launch import run_script

FAKE_PDSH = f"""#!{sys.executable}
# pdsh -S -f FANOUT -w HOST,HOST... COMMAND...: runs COMMAND once per host (%n = the host's index), here, with an
# empty environment.
import subprocess, sys
args = sys.argv[1:]
hosts = args[args.index("-w") + 1].split(",")
command = " ".join(args[args.index("-w") + 2:])
env = {{"HOME": "{Path.home()}", "PATH": "/usr/bin:/bin"}}
procs = [subprocess.Popen(["bash", "-c", command.replace("%n", str(i))], env=env) for i in range(len(hosts))]
sys.exit(max(p.wait() for p in procs))
"""

RANK_SCRIPT = """
import json, os, sys
out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("output_dir="))
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
"""

# What a CANN set_env.sh exports besides PATH/LD_LIBRARY_PATH/PYTHONPATH (which the launcher forwards by prefix on NPU
# and which are the node's own business elsewhere).
FAKE_SET_ENV = ('export ASCEND_OPP_PATH=/fake/opp TOOLCHAIN_HOME=/fake/toolkit ASCEND_AICPU_PATH=/fake\n'
                'export LD_LIBRARY_PATH="/fake/lib64:${LD_LIBRARY_PATH:-}"\n')
HOST_PATHS = {"PATH", "LD_LIBRARY_PATH", "PYTHONPATH"}


def _npu_env_exports(tmp_path: Path) -> dict[str, str]:
    """The variables launch/npu_env.sh sets or changes (a fake CANN tree, alignment-run switch on)."""
    (tmp_path / "cann").mkdir()
    (tmp_path / "cann" / "set_env.sh").write_text(FAKE_SET_ENV)
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GRPO_ASCEND_ROOT": str(tmp_path / "none"),
            "ASCEND_HOME_PATH": str(tmp_path / "cann"), "GRPO_ALIGNMENT_RUN": "1"}
    script = f"env -0 > {tmp_path}/before; source {ROOT / 'launch' / 'npu_env.sh'}; env -0 > {tmp_path}/after"
    subprocess.run(["bash", "-c", script], env=base, check=True, timeout=30)
    read = lambda name: dict(e.split("=", 1) for e in (tmp_path / name).read_text().split("\0") if "=" in e)
    before, after = read("before"), read("after")
    return {k: v for k, v in after.items() if before.get(k) != v and k not in HOST_PATHS and k != "_"}


def fake_remote_tools(tmp_path: Path) -> Path:
    """A folder with the fake `ssh` (answers the launcher's "ssh HOST hostname" check) and `pdsh`, to put first on
    PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ssh").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "pdsh").write_text(FAKE_PDSH)
    for tool in ("ssh", "pdsh"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def test_every_npu_env_variable_reaches_the_ranks_of_every_node(tmp_path: Path):
    exported = _npu_env_exports(tmp_path)
    assert {"PYTORCH_NPU_ALLOC_CONF", "TASK_QUEUE_ENABLE", "CPU_AFFINITY_CONF", "HCCL_BUFFSIZE",
            "TOOLCHAIN_HOME"} <= exported.keys()
    bin_dir = fake_remote_tools(tmp_path)
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    home = tmp_path / "home"  # the user's own ~/.deepspeed_env is kept, and wins
    home.mkdir()
    (home / ".deepspeed_env").write_text("USER_VAR=mine\nTASK_QUEUE_ENABLE=1")
    out = tmp_path / "out"
    env = {**exported, "MALLOC_MMAP_THRESHOLD_": "65536", "RECIPE": str(tmp_path / "rank.py"), "HOME": str(home),
           "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "DS_ACCELERATOR": "cpu",
           "MASTER_PORT": "29731", "TMPDIR": str(tmp_path)}
    proc = run_script("multinode.sh", [str(hostfile), str(ROOT / "recipes/configs/tiny/grpo_lora.yaml"),
                                       f"output_dir={out}"], extra_env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = {**exported, "MALLOC_MMAP_THRESHOLD_": "65536", "USER_VAR": "mine", "TASK_QUEUE_ENABLE": "1"}
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert {k: seen.get(k) for k in expected} == expected, rank
    assert (home / ".deepspeed_env").read_text() == "USER_VAR=mine\nTASK_QUEUE_ENABLE=1"  # not rewritten
