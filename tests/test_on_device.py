"""Checks on a real accelerator: Ascend NPU (marker `npu`) or CUDA (marker `cuda`). They skip cleanly elsewhere.

Run on a 910B machine (CANN sourced, torch + torch_npu from requirements-npu.txt installed):

    source launch/npu_env.sh
    python -m pytest tests/test_on_device.py -m npu -v

Each check runs in a subprocess, so DeepSpeed binds to the device there whatever the test process already chose.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "assets" / "tiny-flux" / "model_index.json"


def _npu_status() -> str | None:
    """None when an NPU is usable here, else why not."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    try:
        importlib.import_module("torch_npu")
    except (ImportError, OSError, RuntimeError) as err:
        return f"torch_npu does not import ({type(err).__name__}); source launch/npu_env.sh"
    if not torch.npu.is_available():
        return "no NPU visible"
    return None


def _cuda_status() -> str | None:
    return None if torch.cuda.is_available() else "no CUDA device"


_NPU_SKIP, _CUDA_SKIP = _npu_status(), _cuda_status()

KINDS = [
    pytest.param("npu", marks=[pytest.mark.npu, pytest.mark.skipif(_NPU_SKIP is not None, reason=str(_NPU_SKIP))]),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(_CUDA_SKIP is not None, reason=str(_CUDA_SKIP))]),
]


def _run(code: str, kind: str, timeout: float = 600) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR=kind, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_device_layer(kind: str):
    out = _run(
        """
        import json, torch
        from grpo import device as dev
        info = dev.init_distributed(timeout_s=120)
        dev.seed_everything(7)
        a = torch.randn(4, device=info.device)
        dev.seed_everything(7)
        b = torch.randn(4, device=info.device)
        x = torch.randn(8, 8, device=info.device)
        with dev.autocast(info.device, torch.bfloat16):
            y = x @ x
        with dev.autocast(info.device, torch.float32):
            z = x @ x
        dev.check_dtype_supported(torch.bfloat16)
        print(json.dumps({"device": str(info.device), "backend": info.backend, "same_seed": torch.equal(a, b),
                          "bf16": str(y.dtype), "fp32": str(z.dtype), "kind": dev.local_devices()[0]}))
        """,
        kind,
    )
    assert out == {"device": f"{kind}:0", "backend": {"npu": "hccl", "cuda": "nccl"}[kind], "same_seed": True,
                   "bf16": "torch.bfloat16", "fp32": "torch.float32", "kind": kind}


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_flux_matches_cpu_and_attention_backends_agree(kind: str):
    out = _run(
        """
        import json, torch
        from diffusers import FluxTransformer2DModel
        from diffusers.utils.torch_utils import maybe_adjust_dtype_for_device
        from grpo import device as dev

        info = dev.init_distributed(timeout_s=120)
        torch.manual_seed(0)
        model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                       pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]).eval()
        img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1)
        inputs = dict(hidden_states=torch.randn(2, 16, 4), encoder_hidden_states=torch.randn(2, 8, 32),
                      pooled_projections=torch.randn(2, 32), timestep=torch.full((2,), 0.5),
                      img_ids=img_ids.reshape(16, 3), txt_ids=torch.zeros(8, 3))
        with torch.no_grad():
            cpu = model(**inputs).sample
            model.to(info.device)
            on_dev = {k: v.to(info.device) for k, v in inputs.items()}
            fp32 = model(**on_dev).sample.cpu()
            freqs_dtype = str(maybe_adjust_dtype_for_device(torch.float64, info.device))
            model.to(torch.bfloat16)
            bf16_in = {k: (v.to(torch.bfloat16) if k != "img_ids" and k != "txt_ids" else v) for k, v in on_dev.items()}
            native = model(**bf16_in).sample.float().cpu()
            fused = None
            if info.device.type == "npu":
                dev.set_attention_backend(model, "_native_npu")
                fused = model(**bf16_in).sample.float().cpu()
                dev.set_attention_backend(model, "native")
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()
        print(json.dumps({"fp32_rel": rel(fp32, cpu), "bf16_rel": rel(native, cpu), "freqs_dtype": freqs_dtype,
                          "fused_rel": None if fused is None else rel(fused, native),
                          "finite": bool(torch.isfinite(native).all())}))
        """,
        kind,
    )
    assert out["fp32_rel"] < 1e-3  # only kernel and RoPE-table rounding differ
    assert 0 < out["bf16_rel"] < 5e-2 and out["finite"]
    # The premise of the audit's NPU view: diffusers builds Flux's RoPE table in float32 on npu, float64 elsewhere.
    assert out["freqs_dtype"] == {"npu": "torch.float32", "cuda": "torch.float64"}[kind]
    if kind == "npu":
        assert out["fused_rel"] < 2e-2  # npu_fusion_attention vs SDPA, both bf16


@pytest.mark.slow
@pytest.mark.skipif(not TINY.exists(), reason="assets/tiny-flux not built")
@pytest.mark.parametrize("kind", KINDS)
def test_tiny_recipe_runs(kind: str, tmp_path: Path):
    out_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR=kind, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "recipes/flux_grpo.py", "--config", "recipes/configs/tiny/grpo_lora.yaml", "max_steps=2",
         f"output_dir={out_dir}", f"data.cache_dir={tmp_path}/cache", "deepspeed.config=ds_configs/zero3.json"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
