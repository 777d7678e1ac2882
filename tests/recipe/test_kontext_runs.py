"""The recipe on the tiny FLUX.1-Kontext (assets/tiny-flux-kontext) and its edit set under ZeRO-3: every sample
conditioned on its row's source image, in the rollout, the update's recomputation and the lagging policy.

The default tier has one short run (grpo + LoRA, 1 step, 2 processes): the first-pass ratio is exactly 1 with the
reference tokens in every call, and the exported LoRA loads into diffusers' FluxKontextPipeline and changes its
edit. The slow tier (-m slow) has five more (8 images a step, 4 steps a trajectory):

    two     grpo + LoRA, 2 steps, 2 processes, a checkpoint every step
    one     the same on 1 process
    resumed 2 processes from two's step-1 checkpoint to step 2
    nft     DiffusionNFT + LoRA (the lagging policy samples with the source images too), 2 steps, 2 processes
    awm     AWM + LoRA (the editing default run's objective; its EMA anchor sees the source images too), the same
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests import EDITS, ROOT, TINY_KONTEXT
from tests.recipe.launch import (SMALL, assert_resumed_step_exact, assert_two_steps_agree, run_recipe, train_rows,
                                 two_one_resumed)

pytestmark = pytest.mark.skipif(not (TINY_KONTEXT / "model_index.json").exists(), reason="tiny Kontext not built")
GRPO, NFT, AWM = (f"recipes/configs/tiny_kontext/{n}.yaml" for n in ("grpo_lora", "nft_lora", "awm_lora"))


def _run(tmp, name: str, config: str, nproc: int, extra: list[str]) -> dict:
    out = tmp / name
    overrides = [*SMALL, f"output_dir={out}", f"data.cache_dir={tmp / 'cache'}", "data.eval_prompts=null",
                 "logging.sample_every=0", "logging.tensorboard=false", *extra]
    proc = run_recipe(str(ROOT / config), overrides, nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"dir": out, "rows": [r for r in train_rows(out) if "loss" in r], "log": proc.stderr}


def _edits(pipe) -> torch.Tensor:
    from diffusers.utils import load_image

    source = load_image(str(EDITS.parent / "tiny_edit" / "000.png"))
    with torch.no_grad():
        return pipe(image=source, prompt=["a blue circle on a green background"] * 2, height=64, width=64,
                    max_area=64 * 64, _auto_resize=False, num_inference_steps=4, guidance_scale=3.5,
                    max_sequence_length=32, output_type="pt",
                    generator=[torch.Generator().manual_seed(i) for i in range(2)]).images.float()


def test_kontext_trains_on_two_processes_and_its_lora_edits_in_diffusers(tmp_path):
    from diffusers import FluxKontextPipeline

    run = _run(tmp_path, "short", GRPO, 2, ["max_steps=1", "checkpoint.every=1", "optim.lr=1e-2"])
    assert [r["ratio_max_dev"] for r in run["rows"]] == [0.0]
    assert "encoding 73 source images of" in run["log"]
    pipe = FluxKontextPipeline.from_pretrained(str(TINY_KONTEXT), dtype=torch.float32)
    base = _edits(pipe)
    pipe.load_lora_weights(str(run["dir"] / "final" / "lora"))
    assert (_edits(pipe) - base).abs().max() > 1e-3
    # tools.eval's grid of an edit set: one row per edit, source | base | checkpoint
    import numpy as np
    from PIL import Image

    from grpo.config import load_config
    from grpo.prompt_sets import read_image, read_prompt_set, row_images
    from tests import EDITS_HELDOUT
    from tools.eval import evaluate_checkpoint

    cfg = load_config(str(ROOT / GRPO), [f"output_dir={run['dir']}", f"data.cache_dir={tmp_path / 'cache'}",
                                         "logging.eval_seeds=1"])
    result = evaluate_checkpoint(cfg, None)
    assert result["checkpoint"]["step"] == 1 and set(result["base"]["components"]) == {"tiny_world", "tiny_edit"}
    grid = np.asarray(Image.open(f"{result['dir']}/grid.png").convert("RGB"))
    assert grid.shape == (17 * 66 + 2, 3 * 66 + 2, 3)  # torchvision's grid: 64 px cells, 2 px padding
    first = read_image(row_images(read_prompt_set(EDITS_HELDOUT).metadata[0])[0])
    assert np.array_equal(grid[2:66, 2:66], (first.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kontext")
    grpo = ["max_steps=2", "checkpoint.every=1", "checkpoint.keep=2", "optim.lr=1e-2"]
    return {**two_one_resumed(functools.partial(_run, tmp), GRPO, grpo),
            **{name: _run(tmp, name, preset, 2, ["max_steps=2", "checkpoint.every=0"])
               for name, preset in (("nft", NFT), ("awm", AWM))}}


@pytest.mark.slow
def test_the_first_pass_ratio_is_exactly_one_on_every_step(runs):
    assert [r["ratio_max_dev"] for r in runs["two"]["rows"]] == [0.0, 0.0]
    assert [r["ratio_max_dev"] for r in runs["one"]["rows"]] == [0.0, 0.0]


@pytest.mark.slow
def test_one_and_two_processes_train_the_same(runs):
    assert_two_steps_agree(runs["one"], runs["two"])


@pytest.mark.slow
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(runs):
    assert_resumed_step_exact(runs["two"], runs["resumed"])


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_the_forward_process_objectives_train_kontext_with_their_lagging_policy(runs, objective):
    rows = runs[objective]["rows"]
    assert len(rows) == 2
    assert all(math.isfinite(r[k]) for r in rows for k in ("loss", "reward_mean", "grad_norm"))
    assert (runs[objective]["dir"] / "final" / "lora" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.slow
def test_flux2_klein_trains_on_reference_images(tmp_path):
    """FLUX.2 [klein] given the edit set: each sample conditioned on its row's image (T-offset ids), the first-pass
    ratio still exactly 1 on 2 processes."""
    run = _run(tmp_path, "klein", "recipes/configs/tiny_flux2/grpo_lora.yaml", 2,
               ["max_steps=1", "checkpoint.every=0", f"data.train_prompts={EDITS}"])
    assert [r["ratio_max_dev"] for r in run["rows"]] == [0.0]
    assert "encoding 73 source images of" in run["log"]
