"""Export and eval: checkpoint weights reload in plain diffusers and reproduce the recipe's own eta = 0 samples.

Two short 2-process runs (a LoRA run with EMA, a full fine-tune without) write checkpoints. Then, in this process and
without DeepSpeed's launcher:
* tools.eval samples the held-out prompts from the base model and from the checkpoint; its scores equal the rewards
  the recipe logged for the same weights (eval/reward_mean at step 0 and at the last step); they are written beside
  the evaluated run, never over another run's;
* tools.export writes a diffusers LoRA file, a fused transformer folder and a full transformer folder; FluxPipeline
  with those weights (load_lora_weights / FluxTransformer2DModel.from_pretrained), fed the same prompts and starting
  noise, reproduces tools.eval's images within 1e-5; so does the recipe's own final export.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from grpo import checkpoint as ckpt
from grpo.config import load_config
from grpo.data import EVAL_NOISE, initial_noise
from grpo.models.flux1 import FLUX1
from tests import ROOT, TINY
from tests.recipe.launch import Run, max_abs_diff, tiny_run, torchrun, trained_weights
from tools import export
from tools.eval import evaluate_checkpoint
from tools.eval import main as eval_main

pytestmark = pytest.mark.slow

PROMPTS = ["a red circle on a cyan background", "a blue square on a yellow background"]
SEEDS = 2  # logging.eval_seeds: image j shows prompt j % 2 from eval noise j
LORA = "recipes/configs/tiny/grpo_lora.yaml"
FULL = "recipes/configs/tiny/grpo_full.yaml"


def _overrides(tmp, name: str, extra: list[str]) -> list[str]:
    return [*tiny_run(tmp), f"data.eval_prompts={tmp / 'heldout.txt'}", f"data.cache_dir={tmp / 'cache'}",
            f"output_dir={tmp / name}", "logging.tensorboard=false", f"logging.eval_seeds={SEEDS}", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    (tmp / "heldout.txt").write_text("\n".join(PROMPTS) + "\n")
    spec = {
        "lora": (LORA, _overrides(tmp, "lora", ["max_steps=2", "checkpoint.every=2", "logging.eval_every=2",
                                                 "ema.decay=0.5", "optim.lr=1e-2"])),
        "full": (FULL, _overrides(tmp, "full", ["max_steps=1", "checkpoint.every=1", "optim.lr=1e-3"])),
    }
    out = {}
    for name, (config, overrides) in spec.items():
        run = Run.start(torchrun(config, overrides), tmp / f"{name}.log")
        assert run.wait(900) == 0, run.tail()
        rows = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
        out[name] = {"cfg": load_config(ROOT / config, overrides), "dir": tmp / name, "tmp": tmp,
                     "evals": {r["step"]: r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r},
                     "ckpt": ckpt.list_checkpoints(tmp / name / "checkpoints")[0]}
    return out


@pytest.fixture(scope="module")
def evals(runs):
    return {name: evaluate_checkpoint(r["cfg"], r["ckpt"]) for name, r in runs.items()}


@pytest.fixture(scope="module")
def model(runs) -> str:
    return str(runs["lora"]["tmp"] / "tiny-flux")  # the runs' private copy of the tiny model


@pytest.fixture(scope="module")
def pipe(model):
    return FluxPipeline.from_pretrained(model, dtype=torch.float32)


def _diffusers_images(pipe: FluxPipeline, seed: int) -> torch.Tensor:
    """FluxPipeline's own sampling (Euler = our eta = 0) from tools.eval's starting noise of every eval image."""
    size = 2 * (64 // (pipe.vae_scale_factor * 2))
    channels = pipe.transformer.config.in_channels // 4
    keys = range(len(PROMPTS) * SEEDS)
    noise = torch.stack([initial_noise((channels, size, size), seed, 0, j, EVAL_NOISE) for j in keys])
    with torch.no_grad():
        return pipe(prompt=PROMPTS * SEEDS, latents=FLUX1.pack(noise), height=64, width=64, num_inference_steps=4,
                    guidance_scale=3.5, max_sequence_length=32, output_type="pt").images.float()


def test_eval_scores_equal_the_recipes_own_evals(runs, evals):
    for name in ("lora", "full"):
        r, e = runs[name], evals[name]
        last = max(r["evals"])
        assert e["base"]["reward_mean"] == pytest.approx(r["evals"][0], abs=1e-5), name
        assert e["checkpoint"]["reward_mean"] == pytest.approx(r["evals"][last], abs=1e-5), name
        scores = json.loads((r["dir"] / "eval" / r["ckpt"].name / "scores.json").read_text())
        assert scores["prompts"] == PROMPTS and set(scores) >= {"base", "checkpoint"}
        assert len(scores["base"]["per_prompt"]) == len(PROMPTS)
        assert len(scores["base"]["components"]["tiny_world"]) == len(PROMPTS) * SEEDS
        assert (r["dir"] / "eval" / r["ckpt"].name / "grid.png").stat().st_size > 100
    assert evals["lora"]["checkpoint"]["weights"] == "ema" and evals["full"]["checkpoint"]["weights"] == "model"


def test_eval_cli_rejects_a_bad_argument(runs, capsys):
    r = runs["lora"]
    rc = eval_main([str(ROOT / LORA), f"model.path={TINY}", f"output_dir={r['dir']}", "weights=best"])
    assert rc == 2 and "error: weights: 'best'" in capsys.readouterr().err


def test_eval_cli_writes_beside_the_evaluated_run(runs, tmp_path):
    """`python -m tools.eval CONFIG checkpoint=RUN` with the preset's output_dir naming another run of the preset:
    the results go to RUN/eval/<checkpoint>/, and the other run's scores stay as they were (issue 56: they were
    overwritten)."""
    r = runs["lora"]
    other = tmp_path / "other_run"
    theirs = other / "eval" / r["ckpt"].name / "scores.json"
    theirs.parent.mkdir(parents=True)
    theirs.write_text('{"the other run": 1}')
    overrides = [o for o in _overrides(r["tmp"], "lora", []) if not o.startswith("output_dir=")]
    assert eval_main([str(ROOT / LORA), *overrides, f"output_dir={other}", f"checkpoint={r['dir']}"]) == 0
    assert theirs.read_text() == '{"the other run": 1}'
    ours = json.loads((r["dir"] / "eval" / r["ckpt"].name / "scores.json").read_text())
    assert ours["checkpoint"]["path"] == str(r["ckpt"]) and ours["prompts"] == PROMPTS


def test_exported_lora_reproduces_the_samples_in_diffusers(runs, evals, pipe, tmp_path):
    r = runs["lora"]
    out = export.export(r["ckpt"], tmp_path / "lora")
    expected = evals["lora"]["images"]["checkpoint"]
    try:
        pipe.load_lora_weights(str(out), adapter_name="exported")
        got = _diffusers_images(pipe, r["cfg"].seed)
        pipe.delete_adapters("exported")
        pipe.load_lora_weights(str(r["dir"] / "final" / "lora"), adapter_name="final")  # the recipe's own export
        final = _diffusers_images(pipe, r["cfg"].seed)
    finally:
        pipe.unload_lora_weights()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, expected, atol=1e-5, rtol=0)
    base = _diffusers_images(pipe, r["cfg"].seed)
    torch.testing.assert_close(base, evals["lora"]["images"]["base"], atol=1e-5, rtol=0)
    assert (got - base).abs().max() > 1e-3  # the adapter changes the images


def test_ema_is_what_gets_exported(runs):
    ema = trained_weights(runs["lora"]["ckpt"], "ema")
    model = trained_weights(runs["lora"]["ckpt"], "model")
    assert max_abs_diff(ema, model) > 1e-6
    assert all("lora_" in k for k in ema)


def test_lora_fused_into_a_full_transformer(runs, evals, model, tmp_path):
    out = export.export(runs["lora"]["ckpt"], tmp_path / "fused", fmt="full")
    fused = FluxPipeline.from_pretrained(model, transformer=FluxTransformer2DModel.from_pretrained(str(out)),
                                         dtype=torch.float32)
    got = _diffusers_images(fused, runs["lora"]["cfg"].seed)
    torch.testing.assert_close(got, evals["lora"]["images"]["checkpoint"], atol=1e-4, rtol=0)


def test_exported_full_transformer_reproduces_the_samples(runs, evals, model, tmp_path):
    r = runs["full"]
    out = export.export(r["ckpt"], tmp_path / "full")
    expected = evals["full"]["images"]["checkpoint"]
    for folder in (out, r["dir"] / "final" / "transformer"):
        transformer = FluxTransformer2DModel.from_pretrained(str(folder))
        p = FluxPipeline.from_pretrained(model, transformer=transformer, dtype=torch.float32)
        torch.testing.assert_close(_diffusers_images(p, r["cfg"].seed), expected, atol=1e-5, rtol=0, msg=str(folder))
    assert sorted(q.name for q in out.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]


def test_export_refuses_a_non_empty_output(runs, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    assert export.main([str(runs["lora"]["ckpt"]), str(tmp_path / "taken")]) == 2
