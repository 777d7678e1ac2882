"""The recipe on the tiny FLUX.3 world (assets/tiny-flux3, a Flux3ModularPipeline folder) under ZeRO-3: grpo + LoRA
with true CFG 4 (the base FLUX.3 samples with its guider), 2 steps on 2 processes (8 images a step, 4 steps a
trajectory), a checkpoint every step: the first-pass ratio is exactly 1, and the LoRA loads into Flux3ModularPipeline
and changes its image. With -m slow, the same run on 1 process and resumed from its step-1 checkpoint (as
tests/recipe/test_flux2_runs.py's chains); DiffusionNFT + LoRA, AWM + LoRA (with its held-out eval) and grpo with
MixGRPO's SDE windows (the tiny FLUX.1 preset on the tiny FLUX.3 base), 2 steps on 2 processes each; the full
fine-tune, whose export loads with Flux3Transformer2DModel.from_pretrained and changes the image; grpo with CFG on the
tiny edit set (a reference image a row)."""

from __future__ import annotations

import functools

import pytest
import torch
import yaml

from grpo.schema import read_preset
from tests import EDITS, ROOT, TINY_FLUX3
from tests.recipe.launch import (SMALL, assert_resumed_step_exact, assert_two_steps_agree, metrics_rows, run_recipe,
                                 train_rows, two_one_resumed)

pytestmark = pytest.mark.skipif(not (TINY_FLUX3 / "modular_model_index.json").exists(),
                                reason="tiny FLUX.3 not built")


CONFIG = "recipes/configs/tiny_flux3/grpo_lora.yaml"
CFG_ARGS = ["max_steps=2", "checkpoint.every=1", "checkpoint.keep=2", "optim.lr=1e-2", "sampling.true_cfg.scale=4.0"]


def _run(tmp, name: str, config: str, nproc: int, extra: list[str]) -> dict:
    out = tmp / name
    overrides = [*SMALL, f"model.path={TINY_FLUX3}", f"output_dir={out}", f"data.cache_dir={tmp / 'cache'}",
                 "logging.eval_every=0", "logging.sample_every=0", "logging.tensorboard=false", *extra]
    proc = run_recipe(str(ROOT / config), overrides, nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"dir": out, "rows": [r for r in train_rows(out) if "loss" in r]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return functools.partial(_run, tmp_path_factory.mktemp("flux3"))


@pytest.fixture(scope="module")
def cfg_run(run):
    return run("two", CONFIG, 2, CFG_ARGS)


@pytest.fixture(scope="module")
def chain(run, cfg_run):
    return two_one_resumed(run, CONFIG, CFG_ARGS, two=cfg_run)


def test_true_cfg_on_flux3_keeps_the_first_pass_ratio_exactly_one(cfg_run):
    assert [r["ratio_max_dev"] for r in cfg_run["rows"]] == [0.0, 0.0]


def _image(pipe) -> torch.Tensor:
    """Flux3ModularPipeline's image of one prompt from seed 0, 4 steps."""
    with torch.no_grad():
        return pipe(prompt="a red circle on a blue background", height=64, width=64, num_inference_steps=4,
                    generator=torch.Generator().manual_seed(0), output_type="pt", output="images")


def test_the_lora_loads_into_flux3_modular_pipeline_and_changes_the_guided_image(cfg_run):
    from maintainer.tiny_worlds.flux3 import sampling_pipeline

    pipe = sampling_pipeline(TINY_FLUX3, 4.0)
    base = _image(pipe)
    pipe.load_lora_weights(str(cfg_run["dir"] / "final" / "lora"))
    assert (_image(pipe) - base).abs().max() > 1e-3


@pytest.mark.slow
def test_one_and_two_processes_train_flux3_the_same(chain):
    assert_two_steps_agree(chain["one"], chain["two"])


@pytest.mark.slow
def test_a_resumed_flux3_run_ends_where_the_uninterrupted_one_does(chain):
    assert_resumed_step_exact(chain["two"], chain["resumed"])


@pytest.mark.slow
def test_diffusion_nft_trains_flux3(run):
    out = run("nft", "recipes/configs/tiny_flux3/nft_lora.yaml", 2, ["max_steps=2", "checkpoint.every=0"])
    assert [r["step"] for r in out["rows"]] == [0, 1]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in out["rows"])


@pytest.fixture(scope="module")
def full(run):
    return run("full", CONFIG, 2, ["max_steps=1", "checkpoint.every=1", "optim.lr=1e-3", "lora=null"])


@pytest.mark.slow
def test_the_full_fine_tune_of_flux3_keeps_the_first_pass_ratio(full):
    assert [r["ratio_max_dev"] for r in full["rows"]] == [0.0]


@pytest.mark.slow
def test_the_full_export_loads_as_a_flux3_transformer_and_changes_the_image(full):
    from diffusers import Flux3Transformer2DModel

    from maintainer.tiny_worlds.flux3 import sampling_pipeline

    pipe = sampling_pipeline(TINY_FLUX3, 1.0)
    base = _image(pipe)
    pipe.update_components(transformer=Flux3Transformer2DModel.from_pretrained(str(full["dir"] / "final" /
                                                                                   "transformer")))
    assert (_image(pipe) - base).abs().max() > 1e-4


@pytest.mark.slow
def test_awm_trains_flux3_and_evaluates(run):
    out = run("awm", "recipes/configs/tiny_flux3/awm_lora.yaml", 2,
              ["max_steps=2", "checkpoint.every=0", "logging.eval_every=2", "logging.eval_seeds=1"])
    assert [r["step"] for r in out["rows"]] == [0, 1]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in out["rows"])
    evals = {r["step"]: r["eval/reward_mean"] for r in metrics_rows(out["dir"]) if "eval/reward_mean" in r}
    assert 2 in evals and all(torch.isfinite(torch.tensor(v)) for v in evals.values())


@pytest.mark.slow
def test_grpo_with_sde_windows_on_flux3_keeps_the_first_pass_ratio(run, tmp_path):
    """MixGRPO's windows (tiny/mixgrpo_lora.yaml) on the tiny FLUX.3 model base, as the FLUX.2 strategy tests swap
    it (tests/recipe/test_flux2_strategies.py): every transition of the window trained, ratio exactly 1."""
    configs = ROOT / "recipes/configs"
    preset = tmp_path / "mixgrpo_flux3.yaml"
    preset.write_text(yaml.safe_dump(read_preset(configs / "tiny/mixgrpo_lora.yaml",
                                                 swap={configs / "tiny/base.yaml": configs / "tiny_flux3/base.yaml"})))
    out = run("windows", str(preset), 2, ["max_steps=2", "checkpoint.every=0", "grpo.timestep_fraction=1.0"])
    assert [r["ratio_max_dev"] for r in out["rows"]] == [0.0, 0.0]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in out["rows"])


@pytest.mark.slow
def test_flux3_trains_on_reference_images(run):
    """FLUX.3 given the edit set: each sample conditioned on its row's image (the transformer's image_cond mode, ids
    at L = -1), with true CFG 4 (the negative branch keeps the row's image, as the pipeline's guider does): the
    first-pass ratio still exactly 1 on 2 processes."""
    out = run("edit", CONFIG, 2, ["max_steps=1", "checkpoint.every=0", "sampling.true_cfg.scale=4.0",
                                  f"data.train_prompts={EDITS}"])
    assert [r["ratio_max_dev"] for r in out["rows"]] == [0.0]
