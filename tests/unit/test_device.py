"""CPU tests of the device layer: accelerator selection, torch_npu guard, distributed init, seeds, dtypes.

Cases that need a fresh interpreter (a fake broken torch_npu on sys.path, DeepSpeed's cached accelerator, a process
group) run in subprocesses so that module caches do not leak between tests.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo import device
from grpo.errors import ConfigError
from tests import tiny_flux_transformer

REPO = Path(__file__).resolve().parents[2]

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
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")}
    paths = [str(REPO)] + ([str(extra_path)] if extra_path else []) + [env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.update(overrides)
    return env


def _run(code: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture()
def fake_torch_npu(tmp_path: Path) -> Path:
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(FAKE_TORCH_NPU)
    return tmp_path


def test_torch_npu_absent_selects_cuda_or_cpu():
    if device.importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    assert device.import_torch_npu() is False
    assert device.is_npu() is False
    if os.environ.get("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu") == "cuda":
        assert device.accelerator().device_name() == "cuda"
        assert device.device_for_local_rank(0) == torch.device("cuda", 0)
    else:
        assert device.accelerator().device_name() == "cpu"
        assert device.device_for_local_rank(0) == torch.device("cpu")
        assert device.device_for_local_rank(3) == torch.device("cpu")  # CPU accelerator: every rank is plain "cpu"


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


def test_ds_accelerator_set_too_late_is_reported(monkeypatch):
    bound = device.accelerator().device_name()  # DeepSpeed is now bound for the rest of this process
    monkeypatch.setenv("DS_ACCELERATOR", "cuda" if bound != "cuda" else "cpu")
    with pytest.raises(RuntimeError, match="before anything imports deepspeed"):
        device.accelerator()


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


def test_partial_launcher_env_is_an_error(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT unset"):
        device.init_distributed()


def test_seed_everything_reproduces_all_generators():
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.randn(2, generator=None).tolist()

    device.seed_everything(1234)
    first = draw()
    device.seed_everything(1234)
    assert draw() == first
    device.seed_everything(1235)
    assert draw() != first


def test_resolve_dtype():
    assert device.resolve_dtype("fp32") is torch.float32
    assert device.resolve_dtype("bf16") is torch.bfloat16
    assert device.resolve_dtype("fp16") is torch.float16
    for bad in ("float64", "bfloat16", "", None):
        with pytest.raises(ConfigError, match="dtype: unknown dtype .*use one of fp32, bf16, fp16"):
            device.resolve_dtype(bad)


class _FakeAcc:
    def __init__(self, bf16: bool, fp16: bool):
        self.bf16, self.fp16 = bf16, fp16

    def is_bf16_supported(self):
        return self.bf16

    def is_fp16_supported(self):
        return self.fp16

    def device_name(self, index=None):
        return "npu"


def test_check_dtype_supported(monkeypatch):
    device.check_dtype_supported(torch.float32)
    monkeypatch.setattr(device, "accelerator", lambda: _FakeAcc(bf16=False, fp16=True))
    device.check_dtype_supported(torch.float32)
    device.check_dtype_supported(torch.float16)
    with pytest.raises(ConfigError, match="train.dtype: torch.bfloat16 is not supported by the npu accelerator"):
        device.check_dtype_supported(torch.bfloat16, setting="train.dtype")
    with pytest.raises(ConfigError, match="not a compute dtype"):
        device.check_dtype_supported(torch.float64)


def _backends(model: torch.nn.Module) -> set:
    return {getattr(m.processor, "_attention_backend", None) for m in model.modules() if hasattr(m, "processor")}


def test_set_attention_backend():
    model = tiny_flux_transformer()
    wrapper = torch.nn.ModuleDict({"transformer": model, "head": torch.nn.Linear(2, 2)})
    assert device.set_attention_backend(wrapper, None) == "native"
    assert {str(getattr(b, "value", b)) for b in _backends(model)} == {"native"}
    with pytest.raises(ConfigError, match="_native_npu.*needs an Ascend NPU"):
        device.set_attention_backend(model, "_native_npu")
    with pytest.raises(ConfigError, match="unknown backend 'nope'; use one of .*native.*_native_npu"):
        device.set_attention_backend(model, "nope")
    with pytest.raises(ConfigError, match="no diffusers model"):
        device.set_attention_backend(torch.nn.Linear(2, 2), "native")
    if device.importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ConfigError, match="'flash' is not usable here"):
            device.set_attention_backend(model, "flash")
    assert device.set_attention_backend(model, "NATIVE") == "native"


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


def _requirements(path: Path) -> dict[str, str]:
    """name -> version specifier of a requirements file (options and comments dropped)."""
    import re

    reqs = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", line)
        reqs[match.group(1).lower().replace("_", "-")] = match.group(2).replace(" ", "")
    return reqs


def test_requirements_npu_pairs_torch_and_mirrors_the_rest():
    main, npu = _requirements(REPO / "requirements.txt"), _requirements(REPO / "requirements-npu.txt")
    torch_pin = npu["torch"].removeprefix("==")
    from packaging.specifiers import SpecifierSet

    # torch_npu X.Y.Z and its X.Y.Z.postN fix releases pair with torch X.Y.Z; nothing else does
    npu_pin = SpecifierSet(npu["torch-npu"])
    assert all(v in npu_pin for v in (torch_pin, f"{torch_pin}.post1", f"{torch_pin}.post12"))
    major, minor, patch = (int(p) for p in torch_pin.split("."))
    assert not any(v in npu_pin for v in (f"{major}.{minor}.{patch + 1}", f"{major}.{minor + 1}.0", f"{torch_pin}rc1"))
    assert "torchvision" in npu
    device_specific = {"torch", "torchvision", "torch-npu"}
    assert {k: v for k, v in main.items() if k not in device_specific} == {
        k: v for k, v in npu.items() if k not in device_specific
    }
    assert "torch-npu" not in main


def test_npu_env_hccl_determinism_only_for_alignment_runs(tmp_path: Path):
    toolkit = f"export ASCEND_TOOLKIT_HOME={_fake_cann(tmp_path / 'ascend-toolkit')}"
    assert "HCCL_DETERMINISTIC" not in _source_npu_env(tmp_path, toolkit)
    assert _source_npu_env(tmp_path, f"{toolkit}\nexport GRPO_ALIGNMENT_RUN=1")["HCCL_DETERMINISTIC"] == "true"
    out = _source_npu_env(tmp_path, f"{toolkit}\nexport GRPO_ALIGNMENT_RUN=1 HCCL_DETERMINISTIC=false")
    assert out["HCCL_DETERMINISTIC"] == "false"


class _NamedAccelerator:
    def __init__(self, name: str):
        self.name = name

    def device_name(self, index=None):
        return self.name


@pytest.mark.parametrize("kind", ["npu", "cuda", "cpu"])
def test_set_deterministic_on_accelerators_only(monkeypatch, kind: str):
    monkeypatch.setattr(device, "accelerator", lambda: _NamedAccelerator(kind))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert device.set_deterministic(False) is False and not calls
    assert device.set_deterministic(True) is (kind != "cpu")
    assert calls == ([] if kind == "cpu" else [((True,), {"warn_only": True})])  # CPU numbers stay as they were
    assert (os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8") is (kind == "cuda")
    assert torch.backends.cudnn.deterministic is (kind == "cuda")
