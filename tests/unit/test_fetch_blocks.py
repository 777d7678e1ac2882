"""deepspeed.fetch_blocks: ZeRO-3 gathers each FLUX block as one unit (DeepSpeed leaf modules). It must train what
the module-by-module path trains (bit for bit with checkpointing, to rounding without), and the keyword inputs must
reach the blocks positionally (else DeepSpeed's leaf gradient hook fires before the block's backward and crashes)."""

import json
import subprocess
import sys

import pytest
import torch

from grpo.config import load_config
from tests import ROOT

LORA = ROOT / "recipes/configs/tiny/grpo_lora.yaml"


def test_keyword_inputs_reach_the_blocks_by_position():
    from benchmarks._common import build_transformer, transformer_config
    from grpo.engine import _inputs_by_position

    model = build_transformer(transformer_config("tiny")).requires_grad_(False)
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    h, e, temb = torch.randn(1, 4, 128), torch.randn(1, 2, 128), torch.randn(1, 128)
    args, kwargs = _inputs_by_position(double, (), dict(hidden_states=h, encoder_hidden_states=e, temb=temb,
                                                        image_rotary_emb=None, joint_attention_kwargs=None))
    assert args[:3] == (h, e, temb) and kwargs == {}
    args, kwargs = _inputs_by_position(single, (h,), dict(encoder_hidden_states=e, temb=temb))
    assert args == (h, e, temb) and kwargs == {}
    # A trainable block fed by frozen layers (LoRA's first block): its hidden states are made to require a gradient,
    # so that DeepSpeed's hook waits for the block's backward; nothing changes without grad or when one is required.
    single.requires_grad_(True)
    with torch.enable_grad():
        (x, *rest), _ = _inputs_by_position(single, (h, e, temb), {})
        assert x.requires_grad and torch.equal(x, h) and not h.requires_grad and rest == [e, temb]
        temb.requires_grad_(True)
        assert _inputs_by_position(single, (h, e, temb), {})[0][0] is h
    with torch.no_grad():
        assert _inputs_by_position(single, (h, e, temb.detach()), {})[0][0] is h


def test_the_presets_keep_it_off_and_a_resume_may_change_it():
    import dataclasses

    from grpo.config import DeepSpeedConfig

    for preset in sorted((ROOT / "recipes/configs").glob("*/*.yaml")):
        if preset.name == "base.yaml":  # not runnable: no objective
            continue
        prompts = ["data.train_prompts=assets/prompts/tiny_train.txt"] if preset.parent.name == "flux1_dev" else []
        assert load_config(preset, prompts).deepspeed.fetch_blocks is False, preset
    assert load_config(LORA, ["deepspeed.fetch_blocks=true"]).deepspeed.fetch_blocks is True
    field = next(f for f in dataclasses.fields(DeepSpeedConfig) if f.name == "fetch_blocks")
    assert field.metadata["resume"] == "free"  # the same training up to rounding: not part of a run's identity


_TWO_PATHS = r"""
import json, sys, torch
from deepspeed.utils import get_z3_leaf_modules, safe_get_full_fp32_param
from grpo import device as dev
from grpo.config import load_config
from grpo.layout import derive_layout
from grpo.inputs import load_ds_config
from tools._recipe import load_recipe
from tools.plan import transformer_inputs
from benchmarks._common import build_transformer, transformer_config
dev.init_distributed()
tcfg = transformer_config("tiny")
lora, checkpointing = sys.argv[2], sys.argv[3]
weights, leaves, norms = {}, {}, {}
for fetch_blocks in ("false", "true"):
    cfg = load_config(sys.argv[1], [f"model.gradient_checkpointing={checkpointing}", "optim.lr=1e-2",
                                    f"deepspeed.fetch_blocks={fetch_blocks}",
                                    *([] if lora == "lora" else ["lora=null"])])
    ds = load_ds_config(cfg.deepspeed.config, cfg, derive_layout(cfg, 1))
    ds.update(gradient_accumulation_steps=2, train_batch_size=2 * ds["train_micro_batch_size_per_gpu"])
    engine, _ = load_recipe().build_policy(build_transformer(tcfg), cfg, ds)
    leaves[fetch_blocks] = len(get_z3_leaf_modules(engine.module))
    trained = [p for p in engine.module.parameters() if p.requires_grad]
    before = [safe_get_full_fp32_param(p).clone() for p in trained]
    for seed in (1, 2):  # two micro-batches accumulated into one optimizer step
        torch.manual_seed(seed)
        inputs = transformer_inputs(tcfg, 2, 16, 8, torch.float32, device="cpu")
        engine.backward(engine(**inputs)[0].square().mean())
        engine.step()
    norms[fetch_blocks] = float(engine.get_global_grad_norm())
    weights[fetch_blocks] = [safe_get_full_fp32_param(p).clone() for p in trained]
a, b = weights["false"], weights["true"]
print(json.dumps({"leaves": leaves, "norms": norms, "same": all(torch.equal(x, y) for x, y in zip(a, b)),
                  "max_diff": max((x - y).abs().max().item() for x, y in zip(a, b)),
                  "max_step": max((x - w).abs().max().item() for x, w in zip(a, before))}))
"""


@pytest.mark.parametrize("lora,checkpointing", [("full", "true"), ("full", "false"), ("lora", "true"),
                                                ("lora", "false")])
def test_block_fetch_trains_what_module_fetch_trains(lora, checkpointing):
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", _TWO_PATHS, str(LORA), lora, checkpointing], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["leaves"] == {"false": 0, "true": 6}, r  # the tiny model's 2 double and 4 single blocks
    assert r["max_step"] > 1e-4, r  # the step moved the weights
    if checkpointing == "true":
        assert r["same"], r
    else:
        # Without checkpointing the gradients agree to rounding (their norm to 1.2e-10), and AdamW's first step, which
        # moves every weight by ~lr whatever the gradient's size, turns the rounding of near-zero gradients into
        # visible differences: measured 2.2e-5 against a 1e-2 step. A block whose gradients were lost or zeroed
        # would differ by the whole step.
        assert r["norms"]["true"] == pytest.approx(r["norms"]["false"], rel=1e-6), r
        assert r["max_diff"] <= 0.01 * r["max_step"], r
