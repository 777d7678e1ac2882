"""Candidate selection (Sol-RL, grpo/candidates.py) through the real recipe on CPU processes: over two steps the
first-pass ratio stays exactly 1 (the kept samples' log-probs are their own full rollouts'), 1 and 2 processes keep
and train the same, and a resumed run continues exactly (the selection is a pure function of the seed, the step,
the pool index and the gathered scores; nothing of it is state).

    two      grpo + selection, 2 steps, 2 processes, a checkpoint every step
    one      the same on 1 process
    resumed  2 processes from two's step-1 checkpoint to step 2
    nft_*    the same two and resumed for DiffusionNFT, whose preview uses the lagging policy a checkpoint restores

(The default tier checks the preset on 2 processes, its first-pass ratio and cost: test_recipe_distributed.py.)
"""

from __future__ import annotations

import functools

import pytest

from tests import ROOT
from tests.recipe.launch import (assert_resumed_step_exact, assert_two_steps_agree, run_recipe, tiny_run, train_rows,
                                 two_one_resumed)

pytestmark = pytest.mark.slow
GRPO, NFT = (f"recipes/configs/tiny/{n}_candidates_lora.yaml" for n in ("grpo", "nft"))
# SMALL's 2 prompts x 4 kept, each from a pool of 8 previewed in 2 of the 4 steps: 16 previews a step
EXTRA = ["sampling.candidates.preview_steps=2", "max_steps=2", "checkpoint.every=1", "checkpoint.keep=2",
         "optim.lr=1e-2"]


def _run(tmp, name: str, config: str, nproc: int, extra: list[str]) -> dict:
    out = tmp / name
    overrides = [*tiny_run(tmp), f"output_dir={out}", f"data.cache_dir={tmp / 'cache'}", "logging.eval_every=0",
                 "logging.sample_every=0", "logging.tensorboard=false", *extra]
    proc = run_recipe(str(ROOT / config), overrides, nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"dir": out, "rows": [r for r in train_rows(out) if "loss" in r]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("candidates")
    run = functools.partial(_run, tmp)
    nft_two = run("nft_two", NFT, 2, EXTRA)
    nft_resumed = run("nft_resumed", NFT, 2, [*EXTRA, f"checkpoint.resume={nft_two['dir']}/checkpoints/step_00000001"])
    return {**two_one_resumed(run, GRPO, EXTRA), "nft_two": nft_two, "nft_resumed": nft_resumed}


def test_the_first_pass_ratio_is_exactly_one_and_the_preview_is_paid_for(runs):
    rows = runs["two"]["rows"]
    assert [r["ratio_max_dev"] for r in rows] == [0.0, 0.0]
    # 4 rollout steps + 2 of 3 transitions trained at 3 forwards + a pool of 8 previewed in 2 steps per 4 kept
    assert [r["forwards_per_image"] for r in rows] == [4 + 1 * 3 + 8 * 2 / 4] * 2
    assert all(r["candidates/kept_preview_spread"] > 0 for r in rows)


def test_one_and_two_processes_keep_and_train_the_same(runs):
    assert_two_steps_agree(runs["one"], runs["two"])
    for a, b in zip(runs["one"]["rows"], runs["two"]["rows"]):
        assert {k: v for k, v in a.items() if k.startswith("candidates/")} == {
            k: v for k, v in b.items() if k.startswith("candidates/")}


def test_a_resumed_run_selects_and_ends_exactly_as_the_uninterrupted_one(runs):
    assert_resumed_step_exact(runs["two"], runs["resumed"])
    assert_resumed_step_exact(runs["nft_two"], runs["nft_resumed"])
