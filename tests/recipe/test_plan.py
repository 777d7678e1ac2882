"""The memory planner (tools/plan.py) against a measurement in a fresh process, its command line, and one memory lever
it plans, ZeRO-3 CPU offload, training on the CPU. Against closed forms, and the other levers:
tests/unit/test_plan.py."""

import json
import subprocess
import sys

import pytest

from benchmarks import zero3_memory as zm
from grpo.config import load_config
from grpo.models import family_of
from grpo.perf import forward_flops
from tools import plan as P
from tests import ROOT, TINY
from tests.unit.test_plan import TINY_LORA


# -------------------------------------------------------------------------------------------------- activations
@pytest.mark.parametrize("lora,checkpointing", [(True, 2)])
def test_activation_prediction_within_15_percent_of_cpu_measurement(tmp_path, lora, checkpointing):
    """Resident-set measurement of one update forward + backward (small preset, 128 px) vs the meta trace; more
    cases (full/LoRA x none/all/every k) in benchmarks/zero3_memory.py and its smoke test."""
    got = zm.measure_activations("small", 2, 128, lora, checkpointing, tmp_path)
    saved, peak = zm.predicted_activations("small", 2, 128, lora, checkpointing)
    assert got["after_forward"] > 20 * 2**20  # a measurement well above page-level noise
    assert abs(saved / got["after_forward"] - 1) <= 0.15, (saved, got)
    assert abs(peak / got["peak"] - 1) <= 0.15, (peak, got)


# -------------------------------------------------------------------------------------------------- the CLI
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})


def test_cli_says_what_to_change_when_it_does_not_fit():
    full_ft = ["lora=null", f"model.path={TINY}"]
    full = P.plan(load_config(TINY_LORA, full_ft), 2)
    lora = P.plan(load_config(TINY_LORA, [*full_ft, "lora.rank=128"]), 2)
    assert lora.peak < full.peak
    memory_kb = int((full.peak + lora.peak) / 2 / 0.9 / 1024)  # between the two peaks, after the 10% headroom
    proc = _cli(TINY_LORA, "--devices", "2", "--device-memory", f"{memory_kb}K", *full_ft)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for item in ("weights", "gradients", "optimizer", "activations", "VAE", "reduce bucket", "gathered weights",
                 "does NOT fit", "fits with any one of: "):
        assert item in proc.stdout, item
    fixes = next(line for line in proc.stdout.splitlines() if line.startswith("fits with any one of: "))
    assert "lora.rank=128" in fixes.split(": ", 1)[1].split(" | ")
    fits = _cli(TINY_LORA, "--devices", "2", "--device-memory", "64GB", f"model.path={TINY}")
    assert fits.returncode == 0 and ": fits" in fits.stdout and "what each change" not in fits.stdout
    # the step's model FLOPs (grpo/perf.py): one forward of the tiny FLUX.1 at 64 px (its VAE: /4, then 2x2 packing:
    # 8 x 8 tokens) and 32 text tokens
    forward = forward_flops(family_of(TINY), TINY, 8 * 8, 32)
    assert f"model FLOPs: {forward / 1e12:.4g} TFLOP per transformer forward and image" in fits.stdout


def test_cli_reports_config_errors_in_one_line():
    proc = _cli(TINY_LORA, "--devices", "3", "--device-memory", "64GB")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: batch.prompts_per_step: ")


# --------------------------------------------------------------------------------------------------- levers
_ENGINE_STEPS = r"""
import json, sys, torch
from deepspeed.utils import safe_get_full_fp32_param
from grpo import device as dev, engine as eng
from grpo.config import load_config
from grpo.models import family_of
from grpo.perf import forward_flops
from grpo.layout import derive_layout
from grpo.inputs import load_ds_config
from tools._recipe import load_recipe
from tools.plan import transformer_inputs
from benchmarks._common import build_transformer, transformer_config
dev.init_distributed()
tcfg = transformer_config("tiny")
for overrides in json.loads(sys.argv[2]):
    cfg = load_config(sys.argv[1], overrides)
    ds = load_ds_config(cfg.deepspeed.config, cfg, derive_layout(cfg, 1))
    ds.update(gradient_accumulation_steps=1, train_batch_size=ds["train_micro_batch_size_per_gpu"])
    engine, _ = load_recipe().build_policy(build_transformer(tcfg), cfg, ds)
    train = [p for p in engine.module.parameters() if p.requires_grad]
    before = [safe_get_full_fp32_param(p).clone() for p in train]
    inputs = transformer_inputs(tcfg, 2, 16, 8, eng.precision(ds), device="cpu")
    engine.backward(engine(**inputs)[0].float().square().mean())
    engine.step()
    moved = sum(not torch.equal(safe_get_full_fp32_param(p), b) for p, b in zip(train, before))
    offload = ds["zero_optimization"].get("offload_optimizer", {}).get("device")
    print(json.dumps({"moved": moved, "trainable": len(train), "offload": offload}))
"""


@pytest.mark.slow
def test_zero3_cpu_offload_and_checkpointing_train_on_the_cpu():
    """ds_configs/zero3_offload.json (optimizer and params on the CPU, bf16, torch AdamW: no DeepSpeedCPUAdam JIT
    build) + every-2nd-block checkpointing, LoRA and full: pointless on a CPU accelerator, but it must run and
    update the weights."""
    common = ["batch.prompts_per_step=1", "sampling.group_size=2", "batch.micro_batch_size=2",
              "deepspeed.config=ds_configs/zero3_offload.json", "model.gradient_checkpointing=2"]
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    runs = json.dumps([common, [*common, "lora=null"]])
    proc = subprocess.run([sys.executable, "-c", _ENGINE_STEPS, TINY_LORA, runs], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    assert len(results) == 2
    for r in results:
        assert r["offload"] == "cpu"
        assert r["moved"] == r["trainable"] > 0
