"""A ZeRO-3 engine on one process, in a fresh process: what the recipe sets for it and for its optimizer does not change
what is trained; the contiguous all-reduce path gives the coalesced reduce-scatter's gradients bit for bit. The
settings themselves: tests/unit/test_single_process_zero3.py."""

import json
import subprocess
import sys

import pytest

from tests import ROOT
from tests.unit.test_single_process_zero3 import LORA


_TWO_PATHS = r"""
import json, sys, torch
from deepspeed.utils import safe_get_full_fp32_param
from grpo import device as dev
from grpo.config import load_config
from grpo.layout import derive_layout
from grpo.inputs import load_ds_config
from tools._recipe import load_recipe
from tools.plan import transformer_inputs
from benchmarks._common import build_transformer, transformer_config
dev.init_distributed()
tcfg = transformer_config("tiny")
cfg = load_config(sys.argv[1], ["lora=null", "deepspeed.config=ds_configs/zero3_fp32.json"])
weights = {}
for reduce_scatter in (False, True):
    ds = load_ds_config(cfg.deepspeed.config, cfg, derive_layout(cfg, 1))
    ds["zero_optimization"]["reduce_scatter"] = reduce_scatter
    ds.update(gradient_accumulation_steps=2, train_batch_size=2 * ds["train_micro_batch_size_per_gpu"])
    engine, _ = load_recipe().build_policy(build_transformer(tcfg), cfg, ds)
    fused = engine.optimizer.optimizer.defaults["fused"]
    for seed in (1, 2):  # two micro-batches accumulated into one optimizer step
        torch.manual_seed(seed)
        inputs = transformer_inputs(tcfg, 2, 16, 8, torch.float32, device="cpu")
        engine.backward(engine(**inputs)[0].square().mean())
        engine.step()
    weights[reduce_scatter] = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
same = all(torch.equal(a, b) for a, b in zip(weights[False], weights[True]))
moved = sum(not torch.equal(a, p) for a, p in zip(weights[False], build_transformer(tcfg).parameters()))
print(json.dumps({"same": same, "moved": moved, "params": len(weights[False]), "fused": fused}))
"""


@pytest.mark.slow  # CI time (~85 s); the settings the recipe makes are tests/unit/test_single_process_zero3.py's
def test_the_contiguous_path_trains_the_same_weights_bit_for_bit():
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", _TWO_PATHS, str(LORA)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fused"] is True  # the recipe's optimizer on the CPU
    assert result["moved"] > 0.9 * result["params"]  # a real step (a few parameters may get no gradient)
    assert result["same"], "reduce_scatter false changed the trained weights on one process"
