"""The recipe on the untrained tiny FLUX.2 [dev] folder (the `tiny_flux2_dev` fixture: Flux2Pipeline, Mistral3 text
encoder, a guidance embedding) under ZeRO-3: one grpo + LoRA run of 2 steps on 2 processes with guidance 4 into the
embedding, an exact first-pass ratio, and a LoRA that loads into diffusers' own Flux2Pipeline."""

from __future__ import annotations

import pytest
import torch

from tests import ROOT
from tests.recipe.launch import SMALL, run_recipe, train_rows
from maintainer.tiny_worlds.flux2 import DEV_GUIDANCE, DEV_MAX_SEQUENCE_LENGTH

# CI time (~35 s idle, 70 s loaded): the [dev] family's own code (encoding, guidance, parity with Flux2Pipeline) is
# tests/unit/test_flux2_dev.py's; the recipe around it is the klein runs' (tests/recipe/test_flux2_runs.py).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tiny_flux2_dev, tmp_path_factory):
    out = tmp_path_factory.mktemp("flux2_dev") / "run"
    overrides = [*SMALL, f"model.path={tiny_flux2_dev}", f"output_dir={out}", f"data.cache_dir={out.parent / 'cache'}",
                 f"sampling.guidance={DEV_GUIDANCE}", f"data.max_sequence_length={DEV_MAX_SEQUENCE_LENGTH}",
                 "max_steps=2", "checkpoint.every=0", "optim.lr=1e-2", "logging.sample_every=0",
                 "logging.tensorboard=false",
                 "data.eval_prompts=null"]  # no held-out eval: it would cost more than the two steps
    proc = run_recipe(str(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml"), overrides, 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"dir": out, "rows": [r for r in train_rows(out) if "loss" in r]}


def test_the_first_pass_ratio_is_exactly_one(run):
    assert [r["ratio_max_dev"] for r in run["rows"]] == [0.0, 0.0]


def _images(pipe) -> torch.Tensor:
    with torch.no_grad():
        return pipe(prompt=["a red circle on a blue background"] * 2, height=64, width=64, num_inference_steps=4,
                    guidance_scale=DEV_GUIDANCE, max_sequence_length=DEV_MAX_SEQUENCE_LENGTH, output_type="pt",
                    generator=[torch.Generator().manual_seed(i) for i in range(2)]).images.float()


def test_the_lora_loads_into_flux2_pipeline_and_changes_the_image(run, tiny_flux2_dev):
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(str(tiny_flux2_dev), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    base = _images(pipe)
    pipe.load_lora_weights(str(run["dir"] / "final" / "lora"))
    assert (_images(pipe) - base).abs().max() > 1e-3
