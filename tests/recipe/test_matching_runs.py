"""DiffusionNFT through the real recipe on 2 CPU processes: a resumed run ends exactly where an uninterrupted one does
(the lagging policy is part of the checkpoint), and the final LoRA loads into diffusers' FluxPipeline.

(1 vs 2 processes for the nft and awm presets: tests/recipe/test_recipe_distributed.py.)
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests import TINY
from tests.recipe.launch import max_abs_diff, run_recipe, tiny_run, train_rows

CONFIG = "recipes/configs/tiny/nft_lora.yaml"
STEPS = 3


def _run(tmp, out, extra):
    # lag_rate 0.3: the old policy's decay is 0.3 after one optimizer step, so it really lags (and must be restored).
    proc = run_recipe(CONFIG, [*tiny_run(tmp), "sampling.num_steps=6", "data.eval_prompts=null", "checkpoint.every=1",
                               "matching.lag_rate=0.3", "optim.lr=1e-2", f"output_dir={out}",
                               f"data.cache_dir={tmp / 'cache'}", *extra], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nft")
    _run(tmp, tmp / "reference", [f"max_steps={STEPS}"])
    _run(tmp, tmp / "resumed", [f"max_steps={STEPS - 1}"])
    _run(tmp, tmp / "resumed", [f"max_steps={STEPS}", "checkpoint.resume=auto"])
    return tmp / "reference", tmp / "resumed"


def test_resumed_nft_run_ends_exactly_where_the_uninterrupted_one_does(runs):
    ref, resumed = runs
    a = load_file(str(ref / "final" / "lora" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(resumed / "final" / "lora" / "pytorch_lora_weights.safetensors"))
    assert max_abs_diff(a, b) == 0.0
    rows_a, rows_b = train_rows(ref), train_rows(resumed)
    assert [r["step"] for r in rows_b] == list(range(STEPS))
    for ra, rb in zip(rows_a, rows_b):
        for key in ("reward_mean", "loss", "loss_pos", "loss_neg", "grad_norm"):
            assert ra[key] == rb[key], (ra["step"], key)
    # The lagging policy's shards are part of every checkpoint (what makes the resumed loss above exact).
    lag = load_file(str(ref / "checkpoints" / "step_00000003" / "grpo_rank00000.safetensors"))
    assert any(k.startswith("lag/") for k in lag)


def test_nft_lora_loads_in_flux_pipeline(runs):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(TINY), torch_dtype=torch.float32)

    def image():
        return pipe("a red circle on a blue background", height=64, width=64, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images

    base = image()
    pipe.load_lora_weights(str(runs[0] / "final" / "lora"))
    assert pipe.get_active_adapters()
    assert not torch.equal(image(), base)
