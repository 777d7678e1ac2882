"""The two tiers stay apart: no module under tests/unit starts a process. A unit test runs in the pytest process
(threads, such as a local HTTP server, are fine); one that starts an interpreter, a launcher, a server process or
bash belongs in tests/recipe, whose launch helper is tests/recipe/launch.py. Checked on the source (AST): a module
here imports no process-starting module, calls no os function that starts or replaces a process, and uses neither
tools.launch's run helpers nor the recipe tier's launch helper. Also the one environment those processes get,
tools.launch.launch_env."""

from __future__ import annotations

import ast

from tests import ROOT

UNIT = ROOT / "tests" / "unit"

# Modules whose import means a child process (multiprocessing's pools and queues start one too).
PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "pty", "concurrent.futures.process")
# os functions that start or replace a process.
OS_CALLS = {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", *(
    f"{base}{tail}" for base in ("spawn", "exec") for tail in ("l", "le", "lp", "lpe", "v", "ve", "vp", "vpe"))}
# The run helpers of tools/launch.py (its command-line builders and environment are fine: they start nothing).
LAUNCH_RUNNERS = {"run_torchrun"}
# Every helper of the recipe tier's launch module starts or drives a process.
RECIPE_LAUNCH = "tests.recipe.launch"


def _is_process_module(name: str) -> bool:
    return any(name == m or name.startswith(f"{m}.") for m in PROCESS_MODULES)


def process_uses(source: str, filename: str = "<source>") -> list[str]:
    """What in a module's source starts processes, one `line N: what` each (imports inside functions included)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if _is_process_module(a.name) or a.name == RECIPE_LAUNCH]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = {a.name for a in node.names}
            bad = (_is_process_module(node.module) or node.module == RECIPE_LAUNCH
                   or any(_is_process_module(f"{node.module}.{n}") for n in names)  # from torch import multiprocessing
                   or (node.module == "concurrent.futures" and "ProcessPoolExecutor" in names)
                   or (node.module == "tools.launch" and LAUNCH_RUNNERS & names)
                   or (node.module == "tests.recipe" and "launch" in names))
            if bad:
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "os" and node.attr in OS_CALLS:
                found.append(f"line {node.lineno}: os.{node.attr}")
            elif node.attr in LAUNCH_RUNNERS:  # launch.run_torchrun after `from tools import launch`
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_the_check_finds_each_way_to_start_a_process():
    planted = {
        "import subprocess": 1, "import multiprocessing.pool": 1, "import torch.multiprocessing as mp": 1,
        "from torch import multiprocessing": 1, "from multiprocessing import Process": 1,
        "from concurrent.futures.process import ProcessPoolExecutor": 1,
        "from concurrent.futures import ProcessPoolExecutor, wait": 1,
        "def f():\n    from subprocess import run": 1, "import os\nos.system('true')": 1, "os.execv(a, b)": 1,
        "from tools.launch import free_port, run_torchrun": 1,
        "from tools import launch\nlaunch.run_torchrun(2, [])": 1,
        "from tests.recipe.launch import script_env": 1, "from tests.recipe import launch": 1,
        # Fine: threads, the command-line and environment builders, the os module itself.
        "import threading\nimport os\nos.environ.get('X')": 0, "from tools.launch import free_port, launch_env": 0,
        "from concurrent.futures import ThreadPoolExecutor": 0, "from grpo.device import free_port": 0,
    }
    assert {src: len(process_uses(src)) for src in planted} == planted


def test_no_unit_module_starts_a_process():
    found = [f"{path.relative_to(ROOT)} {use}" for path in sorted(UNIT.rglob("*.py"))
             for use in process_uses(path.read_text(), str(path))]
    assert not found, "tests/unit runs in-process only; move these to tests/recipe:\n" + "\n".join(found)


def test_the_child_environment_of_tools_launch(monkeypatch):
    """tools.launch.launch_env, the one environment of the processes the recipe tier, the tools and the benchmarks
    start: the repository importable, no hub, one thread, the CPU accelerator by default, each part optional."""
    from tools.launch import JOB_VARS, launch_env

    for name in JOB_VARS:
        monkeypatch.setenv(name, "7")
    monkeypatch.setenv("OMP_NUM_THREADS", "16")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    env = launch_env({"GRACE_S": "1"})
    assert (env["PYTHONPATH"], env["HF_HUB_OFFLINE"], env["DS_ACCELERATOR"], env["OMP_NUM_THREADS"],
            env["PYTHONUNBUFFERED"], env["GRACE_S"], env["RANK"]) == (str(ROOT), "1", "cpu", "1", "1", "1", "7")
    plain = launch_env({"HOME": None}, accelerator=None, job=False, threads=None, unbuffered=False)
    assert not set(JOB_VARS) & set(plain) and "HOME" not in plain
    assert "DS_ACCELERATOR" not in plain and "PYTHONUNBUFFERED" not in plain and plain["OMP_NUM_THREADS"] == "16"
