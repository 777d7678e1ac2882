"""The memory planner (tools/plan.py) against closed forms and measurements, and the memory levers it plans:
every-k activation checkpointing, ZeRO-3 CPU offload, the VAE's offload."""

import json
import subprocess
import sys

import pytest
import torch

from benchmarks import zero3_memory as zm
from benchmarks._common import build_transformer, transformer_config
from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.models.blocks import checkpointed_blocks, enable_checkpointing
from tools import plan as P
from tests import ROOT, TINY

TINY_LORA = str(ROOT / "recipes/configs/tiny/grpo_lora.yaml")


# ------------------------------------------------------------------------------------------------- model states
def test_model_states_closed_form():
    zero = {**P._ZERO_DEFAULTS, "stage3_param_persistence_threshold": 10}
    params = [(101, True), (10, True), (50, False)]  # 10 elements: persistent (whole on every rank)
    s = P.model_states(params, devices=2, b=2, zero=zero)
    parts_all, parts_train = 51 + 5 + 25, 51 + 5
    assert s["weights"] == parts_all * 2 + 10 * 2
    assert s["gradients"] == parts_train * 2
    assert s["master"] == parts_train * 4
    assert s["optimizer"] == parts_train * 8
    fp32 = P.model_states(params, devices=1, b=4, zero=zero)
    assert fp32["master"] == 4 * 111  # DeepSpeed keeps a separate fp32 master copy even in fp32 (measured)
    ref = P.model_states(params, devices=2, b=2, zero=zero, optimizer=False)
    assert ref["gradients"] == ref["optimizer"] == 0 and ref["weights"] == s["weights"]


def test_flux1_dev_config_is_shipped_and_has_12b_parameters():
    tcfg, vae = P.model_configs("black-forest-labs/FLUX.1-dev")
    model = P.meta_transformer(tcfg, torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 11_901_408_320
    assert vae["latent_channels"] == 16
    with pytest.raises(ConfigError, match="model.path"):
        P.model_configs("nobody/no-such-model")


def test_parse_bytes():
    assert P.parse_bytes("64GB") == 64 * 2**30
    assert P.parse_bytes("80 GiB") == 80 * 2**30
    assert P.parse_bytes("512M") == 512 * 2**20
    with pytest.raises(ConfigError, match="--device-memory"):
        P.parse_bytes("lots")


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


def test_checkpointing_lowers_the_planned_activations():
    spec = load_config(TINY_LORA).lora
    t = P.transformer_trace(transformer_config("small"), torch.float32, spec, 2, 256, 32)
    none, every2, every1 = (t.update_bytes(k)[0] for k in (False, 2, True))
    assert every1 < every2 < none


def test_block_fetch_puts_the_largest_block_in_flight():
    """deepspeed.fetch_blocks: ZeRO-3 gathers a whole block where it gathered one module: the update's in-flight
    weights grow by (largest block - largest module) elements, nothing else changes."""
    off, on = (P.plan(load_config(TINY_LORA, [f"deepspeed.fetch_blocks={v}"]), 2) for v in ("false", "true"))
    t = P.transformer_trace(transformer_config("tiny"), torch.float32, load_config(TINY_LORA).lora, 1, 16, 8)
    block = sum(p.numel() for p in t.model.transformer_blocks[0].parameters())  # a double block, with its LoRA
    assert t.largest_block == block > 5 * t.largest_module
    grown = on.phases["update"]["params in flight"] - off.phases["update"]["params in flight"]
    assert grown == (t.largest_block - t.largest_module) * 4 > 0  # fp32
    assert on.resident == off.resident


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


def test_cli_reports_config_errors_in_one_line():
    proc = _cli(TINY_LORA, "--devices", "3", "--device-memory", "64GB")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: batch.prompts_per_step: ")


# --------------------------------------------------------------------------------------------------- levers
def _grads(model, inputs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**inputs)[0].square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("every", [True, 2, 4])
def test_every_k_checkpointing_gives_the_same_gradients(every):
    tcfg = transformer_config("tiny")
    model = build_transformer(tcfg).train()
    inputs = P.transformer_inputs(tcfg, 2, 16, 8, torch.float32, device="cpu")
    plain = _grads(model, inputs)
    enable_checkpointing(model, every)
    recomputed = {id(b) for b in checkpointed_blocks(model, every)}
    calls = []
    for b in [*model.transformer_blocks, *model.single_transformer_blocks]:
        b.register_forward_pre_hook(lambda m, a: calls.append(id(m)))  # recompute may stop before the end
    ckpt = _grads(model, inputs)
    n_blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    assert len(recomputed) == -(-n_blocks // int(every))
    assert len(calls) == n_blocks + len(recomputed)  # the chosen blocks ran twice: forward and recompute
    assert plain.keys() == ckpt.keys()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=0, atol=0, msg=n)


_ENGINE_STEPS = r"""
import json, sys, torch
from deepspeed.utils import safe_get_full_fp32_param
from grpo import device as dev, engine as eng
from grpo.config import load_config
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


class _StubVAE(torch.nn.Module):
    """Records where decode() sends it; decodes to an image-shaped tensor on the latents' device."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"scaling_factor": 1.0, "shift_factor": 0.0})()
        self.dtype = torch.float32
        self.moves = []

    def to(self, device):
        self.moves.append(torch.device(device))
        return self

    def decode(self, z, return_dict=False):
        return (torch.zeros(z.shape[0], 3, z.shape[2] * 4, z.shape[3] * 4, device=z.device),)


def test_an_offloaded_vae_visits_the_latents_device_only_while_decoding():
    from grpo.models.flux1 import FLUX1

    vae = _StubVAE()
    FLUX1.decode(vae, torch.zeros(2, 16, 16), 32, 4)  # home device: nothing moves
    assert vae.moves == []
    image = FLUX1.decode(vae, torch.zeros(2, 16, 16, device="meta"), 32, 4)  # latents elsewhere: there and back
    assert vae.moves == [torch.device("meta"), torch.device("cpu")]
    assert image.shape == (2, 3, 32, 32)
