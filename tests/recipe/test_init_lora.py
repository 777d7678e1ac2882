"""A run started from an existing LoRA (lora.init_from) on 2 processes under ZeRO-3, on the tiny FLUX.2 [klein]:
the adapters come from a ComfyUI-format file (read through diffusers' kohya FLUX.2 reader), the first-pass ratio is
exactly 1, and the weights the run trains from are the file's, bit for bit: with an update of 1e-30 (optim.lr must be
positive; 1e-30 times AdamW's unit-sized step is far below half an fp32 ulp of weights of size ~0.1, and so is the
decay factor's distance from 1) the final export, written in both formats (export.formats), holds the file's tensors,
and so does tools.export --format comfyui of the run's checkpoint.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from safetensors.torch import load_file

from grpo.config import load_config
from grpo.lora_files import COMFYUI_FILE, expected_adapter, write_comfyui
from grpo.models import family_of
from tests import ROOT, TINY_FLUX2
from tests.recipe.launch import SMALL, run_recipe, train_rows
from tools.export import export

pytestmark = pytest.mark.skipif(not (TINY_FLUX2 / "model_index.json").exists(), reason="tiny FLUX.2 not built")
CONFIG = ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml"


ARGS = [*SMALL, f"model.path={TINY_FLUX2}", "logging.eval_every=0", "logging.sample_every=0",
        "logging.tensorboard=false", "optim.lr=1e-30", "export.formats=[diffusers, comfyui]"]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """One step on 2 processes from a ComfyUI-format LoRA of random (non-trivial) weights, checkpointed."""
    tmp = tmp_path_factory.mktemp("init_lora")
    lora = load_config(CONFIG).lora
    meta = family_of(TINY_FLUX2).meta_transformer(str(TINY_FLUX2))
    meta.add_adapter(PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, init_lora_weights=lora.init,
                                    target_modules=lora.target_modules))
    g = torch.Generator().manual_seed(0)
    state = {k: 0.1 * torch.randn(shape, generator=g) for k, shape in expected_adapter(meta).items()}
    init = write_comfyui(state, meta, dataclasses.asdict(lora), tmp / "init", family_of(TINY_FLUX2))
    out = tmp / "run"
    proc = run_recipe(str(CONFIG), [*ARGS, f"output_dir={out}", f"data.cache_dir={tmp / 'cache'}", "max_steps=1",
                                    "checkpoint.every=1", f"lora.init_from={init}"], 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"state": state, "init": init, "out": out, "tmp": tmp}


def test_a_run_started_from_a_comfyui_lora_trains_from_its_weights(started):
    state, out = started["state"], started["out"]
    assert [r["ratio_max_dev"] for r in train_rows(out)] == [0.0]
    final = out / "final" / "lora"
    diffusers_file = load_file(str(final / "pytorch_lora_weights.safetensors"))
    assert {k.removeprefix("transformer.") for k in diffusers_file} == state.keys()
    assert all(torch.equal(diffusers_file[f"transformer.{k}"], v) for k, v in state.items())
    comfy, written = load_file(str(final / COMFYUI_FILE)), load_file(str(started["init"]))
    assert comfy.keys() == written.keys() and all(torch.equal(comfy[k], v) for k, v in written.items())
    # tools.export --format comfyui: the same file from the step-1 checkpoint, offline
    exported = load_file(str(export(out, started["tmp"] / "exported", "comfyui") / COMFYUI_FILE))
    assert exported.keys() == written.keys() and all(torch.equal(exported[k], v) for k, v in written.items())


@pytest.mark.slow
def test_a_resumed_run_reads_its_checkpoint_not_the_init_lora(started):
    """lora.init_from matters at step 0 only: resumed with the file gone, the run goes on from its checkpoint."""
    started["init"].unlink()
    out, cache = started["out"], started["tmp"] / "cache"
    proc = run_recipe(str(CONFIG), [*ARGS, f"output_dir={out}", f"data.cache_dir={cache}", "max_steps=2",
                                    "checkpoint.every=1", "checkpoint.resume=auto",
                                    f"lora.init_from={started['init']}"], 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(train_rows(out)) == 2
