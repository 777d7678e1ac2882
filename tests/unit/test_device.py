"""CPU tests of the device layer: accelerator selection, torch_npu guard, distributed init, seeds, dtypes.

Cases that need a fresh interpreter (a fake broken torch_npu on sys.path, DeepSpeed's cached accelerator, a process
group) or bash (launch/npu_env.sh) run in subprocesses, in tests/recipe/test_device.py.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo import device
from grpo.errors import ConfigError
from tests import tiny_flux_transformer

REPO = Path(__file__).resolve().parents[2]


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


def test_ds_accelerator_set_too_late_is_reported(monkeypatch):
    bound = device.accelerator().device_name()  # DeepSpeed is now bound for the rest of this process
    monkeypatch.setenv("DS_ACCELERATOR", "cuda" if bound != "cuda" else "cpu")
    with pytest.raises(RuntimeError, match="before anything imports deepspeed"):
        device.accelerator()


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
