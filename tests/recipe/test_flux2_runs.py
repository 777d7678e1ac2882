"""The recipe on the tiny FLUX.2 [klein] world (assets/tiny-flux2) under ZeRO-3: exact first-pass ratio, the same
run on 1 and 2 processes, an exact resume, and exports that load into diffusers' own FLUX.2 classes.

Short runs of the real recipe through torchrun (8 images a step, 4 steps a trajectory):

    two     grpo + LoRA, 2 steps, 2 processes, a checkpoint every step (-m slow: the cfg run below takes the same
            family path in the default tier, its conditional branch being this run's call)
    nft     DiffusionNFT + LoRA (the lagging policy), 2 steps, 2 processes (-m slow)
    cfg     grpo + LoRA with true CFG (sampling.true_cfg), 2 steps, 2 processes, a checkpoint every step, a held-out
            eval
    awm_cfg AWM + LoRA with true CFG training the guided velocity, the same
    full    grpo, full fine-tune, 1 step, 2 processes (-m slow)
    one     two's run (and each cfg run) on 1 process (-m slow)
    resumed 2 processes from two's (each cfg run's) step-1 checkpoint to step 2 (-m slow)
    cfg_full grpo, full fine-tune with true CFG, 1 step, 2 processes (-m slow)
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import ROOT, TINY_FLUX2
from tests.recipe.launch import (SMALL, assert_resumed_step_exact, assert_two_steps_agree, metrics_rows, run_recipe,
                                 train_rows, two_one_resumed)

pytestmark = pytest.mark.skipif(not (TINY_FLUX2 / "model_index.json").exists(), reason="tiny FLUX.2 not built")
GRPO, FULL, NFT, AWM = (f"recipes/configs/tiny_flux2/{n}.yaml" for n in ("grpo_lora", "grpo_full", "nft_lora",
                                                                          "awm_lora"))


def _run(tmp, name: str, config: str, nproc: int, extra: list[str]) -> dict:
    out = tmp / name
    overrides = [*SMALL, f"model.path={TINY_FLUX2}", f"output_dir={out}", f"data.cache_dir={tmp / 'cache'}",
                 "logging.eval_every=0", "logging.sample_every=0", "logging.tensorboard=false", *extra]
    proc = run_recipe(str(ROOT / config), overrides, nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"dir": out, "rows": [r for r in train_rows(out) if "loss" in r]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return functools.partial(_run, tmp_path_factory.mktemp("flux2"))


GRPO_ARGS = ["max_steps=2", "checkpoint.every=1", "checkpoint.keep=2", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def runs(run):
    return {"two": run("two", GRPO, 2, GRPO_ARGS), "nft": run("nft", NFT, 2, ["max_steps=2", "checkpoint.every=0"])}


@pytest.fixture(scope="module")
def full(run):
    return run("full", FULL, 2, ["max_steps=1", "checkpoint.every=1", "optim.lr=1e-3"])




@pytest.mark.slow
def test_the_first_pass_ratio_is_exactly_one(runs):
    assert [r["ratio_max_dev"] for r in runs["two"]["rows"]] == [0.0, 0.0]


# True CFG as Flux2KleinPipeline guides klein base (guidance_scale 4, negative prompt ""): grpo trains the guided
# transitions; AWM here the guided velocity (sampling.true_cfg.train, AWM's train.cfg True), so both branches are
# under grad in its update. Every step checkpointed, for the 1-vs-2 and resume chains.
CFG = {"grpo": (GRPO, [*GRPO_ARGS, "sampling.true_cfg.scale=4.0", "logging.eval_every=2"]),
       "awm": (AWM, ["max_steps=2", "checkpoint.every=1", "checkpoint.keep=2", "optim.lr=1e-2",
                     "sampling.true_cfg.scale=4.0", "sampling.true_cfg.train=guided", "logging.eval_every=2"])}


@pytest.fixture(scope="module")
def cfg_runs(run):
    return {name: run(f"{name}_cfg", config, 2, extra) for name, (config, extra) in CFG.items()}


def test_true_cfg_keeps_the_first_pass_ratio_exactly_one(cfg_runs):
    """grpo with true CFG (sampling.true_cfg, Flux2KleinPipeline's guidance_scale 4 and negative prompt ""): the
    rollout, the update and the held-out eval sample the guided velocity; ratio_max_dev is exactly 0.0. AWM with
    it trains; both encode the negative prompt once and evaluate guided."""
    out = cfg_runs["grpo"]
    assert [r["ratio_max_dev"] for r in out["rows"]] == [0.0, 0.0]
    assert list((out["dir"].parent / "cache").glob("negative-*.safetensors"))  # encoded once, beside the prompts'
    for run in cfg_runs.values():
        assert [r["step"] for r in metrics_rows(run["dir"]) if "eval/reward_mean" in r] == [0, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in cfg_runs["awm"]["rows"])


@pytest.mark.parametrize("name", list(CFG))
def test_a_lora_trained_with_true_cfg_loads_into_flux2_klein_and_changes_the_guided_image(cfg_runs, name):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(str(TINY_FLUX2), dtype=torch.float32)
    base = _images(pipe, guidance_scale=4.0)
    pipe.load_lora_weights(str(cfg_runs[name]["dir"] / "final" / "lora"))
    assert (_images(pipe, guidance_scale=4.0) - base).abs().max() > 1e-3


# The 1-vs-2 and resume chains: grpo without CFG, and each true-CFG run. The family-agnostic recipe's chain is in the
# default tier on FLUX.1 (tests/recipe/test_recipe_distributed.py, tests/recipe/test_checkpoint_resume.py); these run
# with -m slow.
CHAINS = {"grpo": (GRPO, GRPO_ARGS), **{f"{name}_cfg": settings for name, settings in CFG.items()}}


@pytest.fixture(scope="module", params=list(CHAINS))
def chain(request, run):
    name = request.param
    two = (request.getfixturevalue("runs")["two"] if name == "grpo" else
           request.getfixturevalue("cfg_runs")[name.removesuffix("_cfg")])
    config, extra = CHAINS[name]
    return two_one_resumed(functools.partial(_prefixed, run, name), config, extra, two=two)


def _prefixed(run, prefix: str, name: str, config: str, nproc: int, extra: list[str]) -> dict:
    return run(f"{prefix}_{name}", config, nproc, extra)


@pytest.mark.slow
def test_one_and_two_processes_train_the_same(chain):
    assert_two_steps_agree(chain["one"], chain["two"])


@pytest.mark.slow
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(chain):
    assert_resumed_step_exact(chain["two"], chain["resumed"])


@pytest.mark.slow
def test_the_full_fine_tune_with_true_cfg_keeps_the_first_pass_ratio(run):
    out = run("cfg_full", FULL, 2, ["max_steps=1", "checkpoint.every=1", "optim.lr=1e-3",
                                    "sampling.true_cfg.scale=4.0"])
    assert [r["ratio_max_dev"] for r in out["rows"]] == [0.0]


# The full fine-tune of the family-agnostic engine is in the default tier on FLUX.1
# (tests/recipe/test_recipe_distributed.py, tests/recipe/test_recipe_cli.py); on FLUX.2 with -m slow.
@pytest.mark.slow
def test_the_full_fine_tune_keeps_the_first_pass_ratio(full):
    assert [r["ratio_max_dev"] for r in full["rows"]] == [0.0]


def _images(pipe, guidance_scale: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return pipe(prompt=["a red circle on a blue background"] * 2, height=64, width=64, num_inference_steps=4,
                    guidance_scale=guidance_scale, max_sequence_length=32, output_type="pt",
                    generator=[torch.Generator().manual_seed(i) for i in range(2)]).images.float()


@pytest.mark.slow
def test_the_lora_loads_into_flux2_klein_and_changes_the_image(runs):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(str(TINY_FLUX2), dtype=torch.float32)
    base = _images(pipe)
    pipe.load_lora_weights(str(runs["two"]["dir"] / "final" / "lora"))
    assert (_images(pipe) - base).abs().max() > 1e-3


@pytest.mark.slow
def test_the_full_export_loads_as_a_flux2_transformer(full):
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    trained = Flux2Transformer2DModel.from_pretrained(str(full["dir"] / "final" / "transformer"))
    base = _images(Flux2KleinPipeline.from_pretrained(str(TINY_FLUX2), dtype=torch.float32))
    tuned = _images(Flux2KleinPipeline.from_pretrained(str(TINY_FLUX2), transformer=trained, dtype=torch.float32))
    assert (tuned - base).abs().max() > 1e-4


@pytest.mark.slow
def test_nft_trains_flux2_with_its_lagging_policy(runs):
    rows = runs["nft"]["rows"]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert (runs["nft"]["dir"] / "final" / "lora" / "pytorch_lora_weights.safetensors").is_file()
