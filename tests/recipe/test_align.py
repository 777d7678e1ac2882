"""tools.align: error arithmetic, block recording, dumps and the table; then real sides of the tiny recipe.

The last three tests run one GRPO step of the tiny preset per side on the CPU (each side in its own process, one side
on 2 processes through torchrun): fp32 against fp32 is exactly zero, 1 against 2 processes stays within 1e-5, and
fp32 against bf16 gives a non-zero, finite table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grpo.errors import ConfigError
from tools import align
from tools.align_record import BlockRecorder, block_key, parse_record_steps, recorded_modules
from tools.align_report import AlignError, Err, compare, format_table, load_dump, save_dump
from tests import ROOT, TINY


# ------------------------------------------------------------------------------------------------ error arithmetic
def test_err_closed_forms():
    e = Err.of(torch.tensor([3.0, 4.5]), torch.tensor([3.0, 4.0]))
    assert e.rel == pytest.approx(0.5 / 5.0) and e.max_abs == pytest.approx(0.5)
    # several tensors pool their squares: ||(1, 0, 2) - (0, 0, 2)|| / ||(0, 0, 2)|| ... over [a1, a2] vs [b1, b2]
    e = Err.of([torch.tensor([1.0]), torch.tensor([0.0, 2.0])], [torch.tensor([0.0]), torch.tensor([0.0, 2.0])])
    assert e.rel == pytest.approx(1.0 / 2.0) and e.max_abs == 1.0
    assert Err.of(torch.zeros(3), torch.zeros(3)) == Err(0.0, 0.0)
    assert math.isinf(Err.of(torch.ones(3), torch.zeros(3)).rel)
    assert Err.of(torch.ones(2, dtype=torch.bfloat16), torch.ones(2)).rel == 0.0  # dtypes compared by value
    with pytest.raises(AlignError, match="shape mismatch"):
        Err.of(torch.zeros(2), torch.zeros(3))


def test_record_steps_and_side_settings():
    assert parse_record_steps("0,-1", 8) == [0, 7]
    assert parse_record_steps("all", 3) == [0, 1, 2]
    assert parse_record_steps("2, 2, -8", 8) == [0, 2]
    for bad in ("8", "-9", "x", ""):
        with pytest.raises(ConfigError, match="--record-steps"):
            parse_record_steps(bad, 8)
    side = align.Side.parse(["device=npu", "env.HCCL_DETERMINISTIC=true", "sampling.num_steps=4"], 2)
    assert side == align.Side(["sampling.num_steps=4"], {"DS_ACCELERATOR": "npu", "HCCL_DETERMINISTIC": "true"}, 2)
    with pytest.raises(ConfigError, match="device: 'gpu'"):
        align.Side.parse(["device=gpu"], 1)
    with pytest.raises(ConfigError, match="expected key=value"):
        align.Side.parse(["fp32"], 1)


# ------------------------------------------------------------------------------------------------ block recording
def _tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=8, axes_dims_rope=[2, 2, 4]).eval()
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(2.0), torch.arange(2.0), indexing="ij"), -1)

    def call(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return model(hidden_states=torch.randn(2, 4, 4, generator=g),
                     encoder_hidden_states=torch.randn(2, 3, 16, generator=g),
                     pooled_projections=torch.randn(2, 8, generator=g), timestep=torch.full((2,), 0.5),
                     img_ids=ids.reshape(4, 3), txt_ids=torch.zeros(3, 3)).sample

    return model, call


def test_block_recorder_keeps_chosen_steps_of_the_first_micro_batch_only():
    model, call = _tiny_flux()
    assert list(recorded_modules(model)) == [
        "time_text_embed", "context_embedder", "x_embedder", "pos_embed", "transformer_blocks.0",
        "single_transformer_blocks.0", "single_transformer_blocks.1", "norm_out", "proj_out"]
    with torch.no_grad():
        call(99)  # before the recorder: nothing recorded
        with BlockRecorder(model, steps=[0, 2], num_steps=3) as rec:
            call(100)  # outside capture(): not recorded
            with rec.capture():  # a "rollout" of 2 micro-batches x 3 steps = 6 calls
                outs = [call(seed) for seed in range(6)]
            call(101)  # after the rollout (reference, update): not recorded
    steps = {int(k.split("/")[1]) for k in rec.outputs}
    assert steps == {0, 2}
    # patch_size 1: the model's output is proj_out's output, so the recorded value is checkable exactly
    torch.testing.assert_close(rec.outputs[block_key(0, "proj_out", 0)], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(rec.outputs[block_key(2, "proj_out", 0)], outs[2], rtol=0, atol=0)
    # the dual-stream blocks return (text, image); both are kept
    assert rec.outputs[block_key(0, "transformer_blocks.0", 0)].shape == (2, 3, 16)
    assert rec.outputs[block_key(0, "transformer_blocks.0", 1)].shape == (2, 4, 16)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# ------------------------------------------------------------------------------------------------ dumps and table
def _synthetic(path: Path, shift: float, reward: list[float], dtype=torch.float32) -> Path:
    """A dump with 4 samples whose images are 0.5 everywhere, plus `shift` on the left half of every image."""
    images = torch.full((4, 3, 4, 4), 0.5)
    images[..., :2] += shift
    cfg = {"deepspeed": {"config": "ds_configs/zero3_fp32.json"}, "seed": 1}
    meta = {"format": 1, "config": cfg, "world_size": 1, "device": "cpu", "device_name": "x", "dtype": str(dtype),
            "attention_backend": "native", "record_steps": [0], "block_samples": [0, 1],
            "modules": ["transformer_blocks.0", "proj_out"], "num_samples": 4, "samples_per_step": 4,
            "stats": {"loss": 0.0, "grad_norm": 1.0}, "weights": "recorded"}
    block = torch.ones(2, 3, 8)
    tensors = {"latents": torch.ones(4, 3, 5, 2), "x0": torch.ones(4, 5, 2), "log_probs": -torch.ones(4, 2),
               "images": images, "rewards": torch.tensor(reward), "advantages": torch.tensor([1.0, -1, 1, -1]),
               block_key(0, "transformer_blocks.0", 0): (block * (1 + shift)).to(dtype),
               block_key(0, "transformer_blocks.0", 1): block.to(dtype), block_key(0, "proj_out", 0): block,
               "weight_before/w": torch.zeros(3), "weight_after/w": torch.full((3,), 1e-3)}
    save_dump(path, tensors, meta)
    return path


def test_compare_closed_forms(tmp_path: Path):
    d = 2.0**-7  # binary fractions: every number below is exact in float32
    b = load_dump(_synthetic(tmp_path / "b.safetensors", 0.0, [0.5, 0.5, 0.5, 0.5]))
    a = load_dump(_synthetic(tmp_path / "a.safetensors", d, [0.5, 0.5, 0.5, 0.5 + 4 * d]))
    c = compare(a, b, pixel_tol=d / 2)
    # block: two outputs pooled; only the first (text stream) differs, by d: ||d * 1|| / ||(1, 1)|| = d / sqrt(2)
    assert c.blocks["transformer_blocks.0"][0].rel == pytest.approx(d / math.sqrt(2), rel=1e-12)
    assert c.blocks["transformer_blocks.0"][0].max_abs == d
    assert c.blocks["proj_out"][0] == Err(0.0, 0.0)
    assert c.reward_mean[2] == d / 0.5  # |mean_a - mean_b| / |mean_b| = (4d / 4) / 0.5
    assert c.outputs["reward (per sample)"].rel == 4 * d  # ||a - b|| / ||b||, with ||b|| = 1
    # half the pixels differ by d in every channel: MSE = d^2 / 2, PSNR = 10 log10(1 / MSE)
    assert c.images["psnr_db"] == pytest.approx(10 * math.log10(2 / d**2), rel=1e-12)
    assert c.images["within_tol"] == 0.5
    assert c.weights["weight update (after - before)"] == Err(0.0, 0.0)
    assert c.differences == []
    table = format_table(c)
    assert "transformer_blocks.0" in table and f"{100 * d / 0.5:.4f}%" in table  # the reward's relative error
    json.dumps(c.to_json())  # plain data

    identical = compare(b, b)
    assert math.isinf(identical.images["psnr_db"]) and identical.images["within_tol"] == 1.0


def test_compare_refuses_different_samples(tmp_path: Path):
    b = load_dump(_synthetic(tmp_path / "b.safetensors", 0.0, [0.5] * 4))
    a = load_dump(_synthetic(tmp_path / "a.safetensors", 0.0, [0.5] * 4))
    a.meta["num_samples"] = 8
    with pytest.raises(AlignError, match="same batch settings"):
        compare(a, b)


def test_cli_errors(tmp_path: Path, capsys):
    assert align.main(["--compare", str(tmp_path / "nope.safetensors"), str(tmp_path / "nope2.safetensors")]) == 1
    assert "no such dump" in capsys.readouterr().err
    assert align.main([]) == 2
    assert "CONFIG: missing" in capsys.readouterr().err
    preset = str(ROOT / "recipes/configs/tiny/grpo_lora.yaml")
    assert align.main([preset, "sampling.num_steps=1", "--dump", str(tmp_path / "x.safetensors")]) == 2
    assert "sampling.num_steps" in capsys.readouterr().err  # caught before any process starts
    assert align.main([preset, "batch.prompts_per_step=3", "sampling.group_size=3", "--nproc-b", "2"]) == 2  # 9 / 2


# ------------------------------------------------------------------------------------------------ real sides
TINY_STEP = [f"model.path={TINY}", "batch.prompts_per_step=2", "sampling.group_size=2", "batch.micro_batch_size=2",
             "sampling.num_steps=3", "data.eval_prompts=null", "logging.tensorboard=false",
             "device=cpu", "env.OMP_NUM_THREADS=1"]


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> dict[str, Path]:
    """fp32 twice (A/B mode), fp32 on 2 processes and bf16, each as a dump; fp32 A vs B as JSON."""
    if not (TINY / "model_index.json").exists():
        pytest.skip("assets/tiny-flux not built")
    tmp = tmp_path_factory.mktemp("align")
    preset = str(ROOT / "recipes/configs/tiny/grpo_lora.yaml")
    common = [preset, *TINY_STEP, f"data.cache_dir={tmp / 'cache'}"]
    assert align.main([*common, "--a", "deepspeed.config=ds_configs/zero3_fp32.json",
                       "--b", "deepspeed.config=ds_configs/zero3_fp32.json", "--keep", str(tmp), "--json",
                       str(tmp / "fp32.json")]) == 0
    assert align.main([*common, "--nproc", "2", "--dump", str(tmp / "two.safetensors")]) == 0
    assert align.main([*common, "deepspeed.config=ds_configs/zero3.json", "--dump", str(tmp / "bf16.safetensors")]) == 0
    return {"a": tmp / "a.safetensors", "b": tmp / "b.safetensors", "two": tmp / "two.safetensors",
            "bf16": tmp / "bf16.safetensors", "json": tmp / "fp32.json"}


def _all_errors(report: dict) -> list[tuple[str, dict]]:
    rows = [(f"{m}@{s}", e) for m, by_step in report["blocks"].items() for s, e in by_step.items()]
    return rows + list(report["outputs"].items()) + list(report["weights"].items())


@pytest.mark.slow
def test_fp32_against_fp32_is_exactly_zero(sides):
    report = json.loads(sides["json"].read_text())
    rows = _all_errors(report)
    assert len(report["blocks"]) == 2 + 4 + 6 and report["record_steps"] == [0, 2]  # tiny: 2 + 4 blocks
    assert not report["differences"], report["differences"]  # same weights (model_fingerprint), same settings
    assert rows and all(e == {"rel": 0.0, "max_abs": 0.0} for _, e in rows), rows
    assert report["reward_mean"]["rel"] == 0.0 and report["images"]["within_tol"] == 1.0
    assert report["weights"], "trainable weights were compared"


@pytest.mark.slow
def test_one_against_two_processes_within_1e_5(sides, tmp_path: Path, capsys):
    out = tmp_path / "two.json"
    assert align.main(["--compare", str(sides["two"]), str(sides["a"]), "--json", str(out)]) == 0
    assert "world_size: 2 | 1" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["a"]["world_size"] == 2 and report["b"]["world_size"] == 1
    worst = max(_all_errors(report), key=lambda row: row[1]["rel"])
    assert worst[1]["rel"] <= 1e-5, worst
    assert report["reward_mean"]["rel"] <= 1e-5


@pytest.mark.slow
def test_fp32_against_bf16_is_nonzero_and_finite(sides, capsys):
    c = compare(load_dump(sides["bf16"]), load_dump(sides["a"]))
    print(format_table(c))
    assert ("dtype", "bfloat16", "float32") in c.differences
    for module, by_step in c.blocks.items():
        for step, e in by_step.items():
            assert math.isfinite(e.rel) and math.isfinite(e.max_abs), (module, step)
            if module != "pos_embed":  # the RoPE table is built in fp32 whatever the model dtype
                assert e.rel > 0, (module, step)
    blocks = [e.rel for m, by_step in c.blocks.items() if "transformer_blocks" in m for e in by_step.values()]
    assert max(blocks) < 0.1  # bf16 keeps ~3 significant digits; a broken cast would be O(1)
    assert 0 < c.reward_mean[2] < 0.05 and math.isfinite(c.images["psnr_db"])
    assert "reward relative error (step mean)" in capsys.readouterr().out


def test_model_fingerprint_flags_different_weights(tmp_path: Path):
    from tools.align_record import model_fingerprint

    (tmp_path / "transformer").mkdir()
    weights = tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"\0" * 1000)
    before = model_fingerprint(tmp_path)
    weights.write_bytes(b"\0" * 999 + b"\1")  # a rebuilt model: same size, other bytes
    assert model_fingerprint(tmp_path) != before

    b = load_dump(_synthetic(tmp_path / "b.safetensors", 0.0, [0.5] * 4))
    a = load_dump(_synthetic(tmp_path / "a.safetensors", 0.0, [0.5] * 4))
    a.meta["model_fingerprint"], b.meta["model_fingerprint"] = "1234", "abcd"
    c = compare(a, b)
    assert ("model_fingerprint", "1234", "abcd") in c.differences
    assert "different transformer weights" in format_table(c)


@pytest.mark.slow
def test_flux2_fp32_against_bf16(tmp_path: Path):
    """The align tool on the tiny FLUX.2 [klein]: every block and FLUX.2's shared modulations recorded, bf16 against
    fp32 finite and small."""
    from tests import TINY_FLUX2

    if not (TINY_FLUX2 / "model_index.json").exists():
        pytest.skip("assets/tiny-flux2 not built")
    common = [str(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml"), *TINY_STEP, f"model.path={TINY_FLUX2}",
              f"data.cache_dir={tmp_path / 'cache'}"]
    assert align.main([*common, "--a", "deepspeed.config=ds_configs/zero3_fp32.json",
                       "--b", "deepspeed.config=ds_configs/zero3.json", "--json", str(tmp_path / "c.json")]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert {"time_guidance_embed", "single_stream_modulation", "transformer_blocks.1",
            "single_transformer_blocks.3"} <= set(report["blocks"])
    assert 0 < report["reward_mean"]["rel"] < 0.05
    assert all(math.isfinite(e["rel"]) for _, e in _all_errors(report))
