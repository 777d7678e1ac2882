"""Checks on a real accelerator: Ascend NPU (marker `npu`) or CUDA (marker `cuda`). They skip cleanly elsewhere.

Run on a 910B machine (CANN sourced, torch + torch_npu from requirements-npu.txt installed):

    source launch/npu_env.sh
    python -m pytest tests/recipe/test_on_device.py -m npu -v

or everything a GPU or NPU machine should show (these tests, a tiny run, alignment against the CPU, the benchmark) in
one command: bash launch/device_check.sh OUT_DIR (tools/device_check.py).

Each check runs in a subprocess, so DeepSpeed binds to the device there whatever the test process already chose; its
environment (tools.launch.launch_env) drops a surrounding job's rank variables and keeps this process's thread count.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tools.device_check import BLOCK_REL_MAX, PSNR_MIN, RATIO_MAX, REWARD_REL_MAX, worst_block
from tools.launch import launch_env

REPO = Path(__file__).resolve().parents[2]
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
    env = launch_env(accelerator=kind, job=False, threads=None, unbuffered=False)
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
        dev.check_dtype_supported(torch.bfloat16)
        print(json.dumps({"device": str(info.device), "backend": info.backend, "same_seed": torch.equal(a, b),
                          "kind": dev.local_devices()[0]}))
        """,
        kind,
    )
    assert out == {"device": f"{kind}:0", "backend": {"npu": "hccl", "cuda": "nccl"}[kind], "same_seed": True,
                   "kind": kind}


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


def _tiny_recipe(kind: str, tmp_path: Path, *overrides: str) -> Path:
    """Two bf16 steps of the tiny LoRA preset on the device, one process; returns its output_dir."""
    out_dir = tmp_path / "run"
    env = launch_env(accelerator=kind, job=False, threads=None, unbuffered=False)
    proc = subprocess.run(
        [sys.executable, "recipes/flux_grpo.py", "--config", "recipes/configs/tiny/grpo_lora.yaml", "max_steps=2",
         f"output_dir={out_dir}", f"data.cache_dir={tmp_path}/cache", "deepspeed.config=ds_configs/zero3.json",
         *overrides],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out_dir


@pytest.mark.slow
@pytest.mark.skipif(not TINY.exists(), reason="assets/tiny-flux not built")
@pytest.mark.parametrize("kind", KINDS)
def test_tiny_recipe_runs(kind: str, tmp_path: Path):
    out_dir = _tiny_recipe(kind, tmp_path)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    # model.deterministic (on in every preset): the first pass reproduces the rollout's log-probs, so the ratio is 1
    # far inside any clip_range (the health line warns above 10% of it).
    devs = [r["ratio_max_dev"] for r in rows if "ratio_max_dev" in r]
    assert len(devs) == 2 and max(devs) <= RATIO_MAX, devs


def _align(args: list[str], tmp_path: Path, timeout: float = 1800) -> str:
    """Runs `python -m tools.align ARGS` (each side picks its device with device=...); returns its table."""
    env = launch_env({"DS_ACCELERATOR": None}, accelerator=None, job=False, threads=None, unbuffered=False)
    tiny = ["recipes/configs/tiny/grpo_lora.yaml", "batch.prompts_per_step=2", "sampling.group_size=2",
            "batch.micro_batch_size=2", "sampling.num_steps=3", "data.eval_prompts=null", "logging.tensorboard=false",
            f"data.cache_dir={tmp_path}/cache"]
    proc = subprocess.run([sys.executable, "-m", "tools.align", *(tiny if args[0] != "--compare" else []),
                           *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    print(proc.stdout)  # the table: pytest -s shows it
    return proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not TINY.exists(), reason="assets/tiny-flux not built")
@pytest.mark.parametrize("kind", KINDS)
def test_align_device_against_cpu(kind: str, tmp_path: Path):
    """One GRPO step of the tiny preset on the device against the CPU: fp32 (kernels differ, nothing else), bf16."""
    _align(["--a", f"device={kind}", "--b", "device=cpu", "--keep", str(tmp_path), "--json",
            str(tmp_path / "fp32.json")], tmp_path)
    _align([f"device={kind}", "deepspeed.config=ds_configs/zero3.json", "--dump", str(tmp_path / "bf16.safetensors")],
           tmp_path)
    _align(["--compare", str(tmp_path / "bf16.safetensors"), str(tmp_path / "b.safetensors"), "--json",
            str(tmp_path / "bf16.json")], tmp_path)
    fp32, bf16 = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("fp32", "bf16"))
    assert fp32["a"]["device"] == f"{kind}:0" and fp32["b"]["device"] == "cpu"

    # fp32 on the device: only kernel rounding (and NPU HF32 / CUDA TF32 convolutions in the VAE) differs
    assert worst_block(fp32) < BLOCK_REL_MAX and fp32["outputs"]["final latent x_T"]["rel"] < BLOCK_REL_MAX
    assert fp32["reward_mean"]["rel"] < REWARD_REL_MAX and fp32["images"]["psnr_db"] > PSNR_MIN
    # bf16 on the device: ~3 significant digits per block, still a usable step
    assert 0 < worst_block(bf16) < 0.1
    assert math.isfinite(bf16["reward_mean"]["rel"]) and bf16["reward_mean"]["rel"] < 0.05


@pytest.mark.slow
@pytest.mark.skipif(not TINY.exists(), reason="assets/tiny-flux not built")
@pytest.mark.parametrize("kind", KINDS)
def test_profiler_on_device(kind: str, tmp_path: Path):
    """profile.steps traces step 1 with the device's profiler: torch_npu's *_ascend_pt folder, or CUDA kernels."""
    out_dir = _tiny_recipe(kind, tmp_path, "profile.steps=[1]", "data.eval_prompts=null")
    if kind == "npu":
        assert list((out_dir / "profile" / "step00001").glob("*_ascend_pt")), list((out_dir / "profile").rglob("*"))
    else:
        trace = json.loads((out_dir / "profile" / "step00001_rank0.pt.trace.json").read_text())
        assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])  # GPU kernels, not only CPU ops
