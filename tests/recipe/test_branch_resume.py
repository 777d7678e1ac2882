"""BranchGRPO's trees through the real recipe on 2 CPU processes: a resumed run ends exactly where an uninterrupted one
does (a tree's noise, like every other draw, is a pure function of seed, step and sample; nothing of it is state).

(1 vs 2 processes and the first-pass ratio for the preset: tests/recipe/test_recipe_distributed.py.)
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.recipe.launch import max_abs_diff, run_recipe, tiny_run, train_rows

pytestmark = pytest.mark.slow
STEPS = 3
CONFIG = "recipes/configs/tiny/branchgrpo_lora.yaml"


def _run(tmp, out, extra):
    settings = ["sampling.num_steps=6", "grpo.timestep_fraction=1.0", "data.eval_prompts=null", "checkpoint.every=1",
                "optim.lr=1e-2", f"output_dir={out}", f"data.cache_dir={tmp / 'cache'}"]
    proc = run_recipe(CONFIG, [*tiny_run(tmp), *settings, *extra], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_resumed_tree_run_ends_exactly_where_the_uninterrupted_one_does(tmp_path):
    _run(tmp_path, tmp_path / "reference", [f"max_steps={STEPS}"])
    _run(tmp_path, tmp_path / "resumed", [f"max_steps={STEPS - 1}"])
    _run(tmp_path, tmp_path / "resumed", [f"max_steps={STEPS}", "checkpoint.resume=auto"])
    a = load_file(str(tmp_path / "reference" / "final" / "lora" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "final" / "lora" / "pytorch_lora_weights.safetensors"))
    assert max_abs_diff(a, b) == 0.0
    rows_a, rows_b = train_rows(tmp_path / "reference"), train_rows(tmp_path / "resumed")
    assert [r["step"] for r in rows_b] == list(range(STEPS))
    for ra, rb in zip(rows_a, rows_b):
        for key in ("reward_mean", "loss", "grad_norm", "ratio_max_dev"):
            assert ra[key] == rb[key], (ra["step"], key)
