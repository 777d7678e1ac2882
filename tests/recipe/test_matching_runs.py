"""DiffusionNFT and AWM through the real recipe on 2 CPU processes: a resumed run ends exactly where an uninterrupted
one does (the lagging policy, nft's old policy or awm's anchor, is part of the checkpoint), and the final LoRA loads
into diffusers' FluxPipeline.

(1 vs 2 processes for the nft and awm presets: tests/recipe/test_recipe_distributed.py.)
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests import TINY
from tests.recipe.launch import max_abs_diff, run_recipe, tiny_run, train_rows

STEPS = 2
# name -> (objective, its overrides, the loss terms it logs)
CASES = {"nft": ("nft", [], ("loss_pos", "loss_neg")),
         "awm": ("awm", ["awm.group_noise=true"], ("matching_error", "anchor")),  # the shared noise resumes exactly too
         "awm_no_anchor": ("awm", ["awm.anchor_coef=0"], ("matching_error",))}  # no anchor: its copy still resumes


def _run(tmp, config, out, extra):
    # lag_rate 0.3: the lagging policy's decay is 0.3 after one optimizer step, so it really lags (and must be
    # restored on resume).
    proc = run_recipe(config, [*tiny_run(tmp), "sampling.num_steps=6", "data.eval_prompts=null", "checkpoint.every=1",
                               f"{config.split('/')[-1].split('_')[0]}.lag_rate=0.3", "optim.lr=1e-2", f"output_dir={out}",
                               f"data.cache_dir={tmp / 'cache'}", *extra], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]


# AWM's resume restores the same lagging-policy state as DiffusionNFT's (ShardedEMA): it runs with -m slow (CI time).
@pytest.fixture(scope="module", params=[pytest.param(t, marks=pytest.mark.slow) if t.startswith("awm") else t
                                        for t in CASES])
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    objective, own, _ = CASES[request.param]
    config = f"recipes/configs/tiny/{objective}_lora.yaml"
    _run(tmp, config, tmp / "reference", [f"max_steps={STEPS}", *own])
    _run(tmp, config, tmp / "resumed", [f"max_steps={STEPS - 1}", *own])
    _run(tmp, config, tmp / "resumed", [f"max_steps={STEPS}", "checkpoint.resume=auto", *own])
    return request.param, tmp / "reference", tmp / "resumed"


def test_resumed_run_ends_exactly_where_the_uninterrupted_one_does(runs):
    algorithm, ref, resumed = runs
    a = load_file(str(ref / "final" / "lora" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(resumed / "final" / "lora" / "pytorch_lora_weights.safetensors"))
    assert max_abs_diff(a, b) == 0.0
    rows_a, rows_b = train_rows(ref), train_rows(resumed)
    assert [r["step"] for r in rows_b] == list(range(STEPS))
    for ra, rb in zip(rows_a, rows_b):
        for key in ("reward_mean", "loss", "grad_norm", *CASES[algorithm][2]):
            assert ra[key] == rb[key], (ra["step"], key)
    # The lagging policy's shards are part of every checkpoint (what makes the resumed loss above exact).
    lag = load_file(str(ref / "checkpoints" / f"step_{STEPS:08d}" / "grpo_rank00000.safetensors"))
    assert any(k.startswith("lag/") for k in lag)
    if algorithm == "awm_no_anchor":  # neither the term nor its forward
        assert all("anchor" not in r for r in rows_a)


def test_lora_loads_in_flux_pipeline(runs):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(TINY), dtype=torch.float32)

    def image():
        return pipe("a red circle on a blue background", height=64, width=64, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images

    base = image()
    pipe.load_lora_weights(str(runs[1] / "final" / "lora"))
    assert pipe.get_active_adapters()
    assert not torch.equal(image(), base)
