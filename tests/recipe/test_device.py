"""The device layer where a test needs a fresh interpreter or bash: a fake broken torch_npu on sys.path, DeepSpeed's
cached accelerator, a process group (one process, two gloo processes), local_devices' stdout that launch/run.sh
reads, and launch/npu_env.sh sourced with a fake CANN and npu-smi. They run in subprocesses so that module caches do
not leak between tests; the in-process cases are in tests/unit/test_device.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from grpo import device
from tests import ROOT as REPO
from tools.launch import launch_env

LIBHCCL = "libhccl.so: cannot open shared object file: No such file or directory"

# The errors a real torch_npu raises on import when CANN is missing, a .so cannot load, or torch is a CUDA build.
FAKE_TORCH_NPU = textwrap.dedent(
    f"""
    import os
    kind = os.environ.get("FAKE_TORCH_NPU_ERROR", "import")
    if kind == "import":
        raise ImportError({LIBHCCL!r} + ". Please run 'source set_env.sh' in the CANN installation path.\\n"
                          "ERR00008 PTA resource not found")
    if kind == "os":
        raise OSError("libascendcl.so: cannot open shared object file")
    raise RuntimeError("Two accelerators cannot be used at the same time in PyTorch: npu and cuda.")
    """
)


def _env(extra_path: Path | None = None, **overrides: str) -> dict[str, str]:
    """A fresh interpreter's environment: no DS_ACCELERATOR unless `overrides` sets it (the cases choose it or let
    the device layer detect it), no rank variables, `extra_path` (a fake torch_npu) importable after the repository
    and before this process's PYTHONPATH."""
    paths = [str(REPO)] + ([str(extra_path)] if extra_path else []) + [os.environ.get("PYTHONPATH", "")]
    return launch_env({"DS_ACCELERATOR": None, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **overrides},
                      accelerator=None, job=False, unbuffered=False)


def _run(code: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture()
def fake_torch_npu(tmp_path: Path) -> Path:
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(FAKE_TORCH_NPU)
    return tmp_path


def test_broken_torch_npu_gives_one_line_cann_hint(fake_torch_npu: Path):
    code = """
        import json, os
        from grpo import device
        out = {}
        for kind in ("import", "os", "runtime"):
            os.environ["FAKE_TORCH_NPU_ERROR"] = kind
            try:
                device.import_torch_npu()
                out[kind] = None
            except RuntimeError as err:
                out[kind] = [str(err), type(err.__cause__).__name__]
        os.environ["FAKE_TORCH_NPU_ERROR"] = "import"
        os.environ["DS_ACCELERATOR"] = "cpu"  # an explicit non-NPU accelerator never touches torch_npu
        out["ds_cpu"] = device.accelerator().device_name()
        del os.environ["DS_ACCELERATOR"]
        try:
            device.accelerator()
            out["auto"] = None
        except RuntimeError as err:
            out["auto"] = str(err)
        print(json.dumps(out))
    """
    proc = _run(code, _env(fake_torch_npu))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind, cause in (("import", "ImportError"), ("os", "OSError"), ("runtime", "RuntimeError")):
        message, cause_type = out[kind]
        assert "\n" not in message
        assert "set_env.sh" in message and "torch_npu" in message
        assert cause_type == cause
    assert LIBHCCL in out["import"][0]
    assert "libascendcl.so" in out["os"][0]
    assert "Two accelerators" in out["runtime"][0]
    assert out["ds_cpu"] == "cpu"
    assert out["auto"] is not None and LIBHCCL in out["auto"]


def test_broken_torch_npu_uncaught_error_ends_with_the_hint(fake_torch_npu: Path):
    proc = _run("from grpo.device import init_distributed; init_distributed()", _env(fake_torch_npu))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: torch_npu is installed but failed to import (ImportError: libhccl.so")
    assert "source CANN's set_env.sh" in last


def test_init_distributed_single_process_fills_env():
    code = """
        import json, os
        from grpo.device import init_distributed
        info = init_distributed(timeout_s=60)
        again = init_distributed()
        import torch.distributed as dist
        print(json.dumps({"info": [info.rank, info.world_size, info.local_rank, str(info.device), info.backend],
                          "same": again == info, "env": {k: os.environ[k] for k in
                          ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
                          "init": dist.is_initialized()}))
    """
    proc = _run(code, _env(DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["info"] == [0, 1, 0, "cpu", "gloo"]
    assert out["same"] and out["init"]
    env = out["env"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("0", "1", "0", "127.0.0.1")
    assert 0 < int(env["MASTER_PORT"]) < 65536


@pytest.mark.slow
def test_init_distributed_two_processes_gloo(tmp_path: Path):
    code = """
        import json, os, sys
        import torch.multiprocessing as mp

        def work(rank, port, queue):
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port), LOCAL_SIZE="2")
            import torch, torch.distributed as dist
            from grpo.device import init_distributed
            info = init_distributed(timeout_s=120)
            t = torch.tensor([float(info.rank + 1)])
            dist.all_reduce(t)
            queue.put([info.rank, info.world_size, info.local_rank, str(info.device), info.backend, t.item()])
            dist.destroy_process_group()

        if __name__ == "__main__":
            from grpo.device import free_port
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            mp.start_processes(work, args=(free_port(), queue), nprocs=2, start_method="spawn")
            print(json.dumps(sorted(queue.get() for _ in range(2))))
    """
    path = tmp_path / "two_proc_init.py"  # spawn re-imports __main__, so it must be a real file
    path.write_text(textwrap.dedent(code))
    proc = subprocess.run([sys.executable, str(path)], env=_env(DS_ACCELERATOR="cpu"), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == [[0, 2, 0, "cpu", "gloo", 3.0], [1, 2, 1, "cpu", "gloo", 3.0]]


def test_local_devices_stdout_is_only_the_answer():
    # launch/run.sh reads this line with `read -r kind count`; DeepSpeed's import-time warning must not precede it.
    proc = _run("from grpo.device import local_devices; print(*local_devices())", _env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    if device.importlib.util.find_spec("torch_npu") is None and not torch.cuda.is_available():
        assert proc.stdout == "cpu 1\n"
    kind, count = proc.stdout.split()
    assert kind in ("npu", "cuda", "cpu") and int(count) >= 0


NPU_SMI_M = """\
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        0                              0                              0                              Ascend 910B3
        0                              1                              -                              Mcu
        1                              0                              1                              Ascend 910B3
        1                              1                              -                              Mcu
"""


def _fake_cann(folder: Path, marker: str = "1") -> Path:
    """A CANN install folder whose set_env.sh exports FAKE_CANN_SOURCED=marker."""
    folder.mkdir(parents=True, exist_ok=True)
    # Like CANN's real script it reads unset variables and ends non-zero; sourcing must survive both.
    (folder / "set_env.sh").write_text(f"export FAKE_CANN_SOURCED={marker}\n"
                                       'export LD_LIBRARY_PATH="x:$LD_LIBRARY_PATH"\nfalse\n')
    return folder


def _source_npu_env(tmp_path: Path, exports: str | None = None, with_npu_smi: bool = True) -> dict[str, str]:
    """Sources launch/npu_env.sh under `set -euo pipefail` with a fake npu-smi on PATH and GRPO_ASCEND_ROOT (the
    install root) at tmp_path/Ascend. By default a fake CANN toolkit is named by ASCEND_TOOLKIT_HOME; `exports`
    replaces that line."""
    if exports is None:
        exports = f"export ASCEND_TOOLKIT_HOME={_fake_cann(tmp_path / 'ascend-toolkit')}"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if with_npu_smi:
        (bin_dir / "npu-smi").write_text(f"#!/bin/sh\ncat <<'TABLE'\n{NPU_SMI_M}TABLE\n")
        (bin_dir / "npu-smi").chmod(0o755)
    script = (f"set -euo pipefail\nunset LD_LIBRARY_PATH\n{exports}\n"
              f"source {REPO / 'launch' / 'npu_env.sh'}\n"
              'echo "OPTS=$-"\nset -o | grep -E "^pipefail" | tr -s " \\t" "=" | sed "s/^/PIPE/"\nenv\n')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "GRPO_ASCEND_ROOT": str(tmp_path / "Ascend")}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    out["STDERR"] = proc.stderr
    return out


def test_npu_env_defaults_and_cann(tmp_path: Path):
    out = _source_npu_env(tmp_path)
    assert out["FAKE_CANN_SOURCED"] == "1"
    assert "e" in out["OPTS"] and "u" in out["OPTS"]  # the caller's strict mode is restored after set_env.sh
    assert out["PIPEpipefail"] == "on"
    assert out["HCCL_CONNECT_TIMEOUT"] == "1200"
    assert out["HCCL_BUFFSIZE"] == "800"
    assert out["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in out
    assert out["TASK_QUEUE_ENABLE"] == "2"
    assert out["CPU_AFFINITY_CONF"] == "1"
    # npu-smi is there, but its ids may be host ids in a container: device visibility is the runtime's.
    assert "ASCEND_RT_VISIBLE_DEVICES" not in out


def test_npu_env_keeps_user_values(tmp_path: Path):
    toolkit = _fake_cann(tmp_path / "ascend-toolkit")
    out = _source_npu_env(tmp_path, f"export ASCEND_TOOLKIT_HOME={toolkit} HCCL_BUFFSIZE=123 TASK_QUEUE_ENABLE=0 "
                                    "ASCEND_RT_VISIBLE_DEVICES=4,5")
    assert (out["HCCL_BUFFSIZE"], out["TASK_QUEUE_ENABLE"], out["ASCEND_RT_VISIBLE_DEVICES"]) == ("123", "0", "4,5")
    bare = tmp_path / "no_npu_smi"
    bare.mkdir()
    out = _source_npu_env(bare, with_npu_smi=False)
    assert "ASCEND_RT_VISIBLE_DEVICES" not in out


@pytest.mark.parametrize("layout", ["home_path", "home_path_latest", "toolkit_latest", "newest_cann", "none"])
def test_npu_env_finds_cann(tmp_path: Path, layout: str):
    root = tmp_path / "Ascend"
    exports = ""
    if layout == "home_path":  # ASCEND_HOME_PATH names the folder holding set_env.sh
        exports = f"export ASCEND_HOME_PATH={_fake_cann(tmp_path / 'custom' / 'cann-9.1.0', 'home')}"
    elif layout == "home_path_latest":  # ...or .../ascend-toolkit/latest, whose set_env.sh is one level up
        _fake_cann(tmp_path / "custom" / "ascend-toolkit", "home")
        (tmp_path / "custom" / "ascend-toolkit" / "latest").mkdir()
        exports = f"export ASCEND_HOME_PATH={tmp_path / 'custom' / 'ascend-toolkit' / 'latest'}"
    elif layout == "toolkit_latest":
        _fake_cann(root / "ascend-toolkit" / "latest", "toolkit")
    elif layout == "newest_cann":  # CANN >= 8.5 installs side by side; version order, not string order
        for version in ("8.5.0", "9.1.0", "10.0.0"):
            _fake_cann(root / f"cann-{version}", version)
    out = _source_npu_env(tmp_path, exports)
    expected = {"home_path": "home", "home_path_latest": "home", "toolkit_latest": "toolkit",
                "newest_cann": "10.0.0", "none": None}[layout]
    assert out.get("FAKE_CANN_SOURCED") == expected
    assert ("CANN set_env.sh not found" in out["STDERR"]) is (expected is None)


@pytest.mark.parametrize(("user", "expected"), [
    ("", {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}),
    ("export PYTORCH_ALLOC_CONF=expandable_segments:False", {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}),
    ("export PYTORCH_NPU_ALLOC_CONF=a:1", {"PYTORCH_NPU_ALLOC_CONF": "a:1"}),
    ("export PYTORCH_NPU_ALLOC_CONF=a:1 PYTORCH_ALLOC_CONF=b:2", {"PYTORCH_NPU_ALLOC_CONF": "a:1"}),
])
def test_npu_env_exports_one_allocator_variable(tmp_path: Path, user: str, expected: dict):
    toolkit = _fake_cann(tmp_path / "ascend-toolkit")
    out = _source_npu_env(tmp_path, f"export ASCEND_TOOLKIT_HOME={toolkit}\n{user}")
    assert {k: v for k, v in out.items() if k in ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF")} == expected


def test_npu_env_hccl_determinism_only_for_alignment_runs(tmp_path: Path):
    toolkit = f"export ASCEND_TOOLKIT_HOME={_fake_cann(tmp_path / 'ascend-toolkit')}"
    assert "HCCL_DETERMINISTIC" not in _source_npu_env(tmp_path, toolkit)
    assert _source_npu_env(tmp_path, f"{toolkit}\nexport GRPO_ALIGNMENT_RUN=1")["HCCL_DETERMINISTIC"] == "true"
    out = _source_npu_env(tmp_path, f"{toolkit}\nexport GRPO_ALIGNMENT_RUN=1 HCCL_DETERMINISTIC=false")
    assert out["HCCL_DETERMINISTIC"] == "false"
