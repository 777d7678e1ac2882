"""Non-finite rewards, losses and gradients: the update is skipped on every rank, counted, logged, and training goes
on; too many skips in a row save a checkpoint and stop with a clear error.

One 2-process run through launch/run.sh of the recipe with injected faults (RECIPE=tests/recipe/faulty_recipe.py,
GRPO_FAULT_INJECT) and faults.max_consecutive_skips=2:
    step 0  NaN rewards on both ranks      -> update skipped (reward check)
    step 1  clean                          -> trained; the skip streak resets
    step 2  NaN loss on rank 1 only        -> DeepSpeed skips the optimizer step on both ranks (global grad norm)
    step 3  NaN rewards                    -> second skip in a row: checkpoint step_4, then exit 3 with one error line
"""

from __future__ import annotations

import json

import pytest

from grpo import checkpoint as ckpt
from tests import ROOT
from tests.recipe.launch import Run, max_abs_diff, script_env, tiny_run, train_rows, trained_weights
from tools.launch import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    out = tmp / "run"
    run = Run.start(["bash", str(ROOT / "launch" / "run.sh"), str(ROOT / "recipes/configs/tiny/grpo_lora.yaml"),
                     *tiny_run(tmp), "max_steps=6", "checkpoint.every=2", "checkpoint.keep=5",
                     "faults.max_consecutive_skips=2", "data.eval_prompts=null", "logging.sample_every=0",
                     "logging.tensorboard=false", f"output_dir={out}", f"data.cache_dir={tmp / 'cache'}"],
                    tmp / "run.log", script_env({"GRPO_FAULT_INJECT": "nan_reward@0,nan_loss@2:1,nan_reward@3",
                                                 "RECIPE": str(ROOT / "tests" / "recipe" / "faulty_recipe.py"),
                                                 "NPROC": "2", "MASTER_PORT": str(free_port())}))
    rc = run.wait(900)
    return {"rc": rc, "out": out, "log": run.log.read_text(errors="replace"), "rows": train_rows(out)}


def test_nan_reward_skips_the_update_and_is_counted(faulty_run):
    r0 = faulty_run["rows"][0]
    assert r0["skipped_updates"] == 1 and r0["nonfinite/tiny_world"] == 8  # both ranks' 4 images, summed
    assert "loss" not in r0 and "grad_norm" not in r0  # no update ran
    assert r0["lr"] > 0 and r0["step_time_s"] > 0  # the row still says where the schedule and the clock were
    assert "nonfinite reward/loss/grad 8/0/0 | skipped 1" in faulty_run["log"]


def test_training_goes_on_after_a_skip(faulty_run):
    r1 = faulty_run["rows"][1]
    assert r1["skipped_updates"] == 0 and r1["nonfinite/loss"] == 0
    assert r1["grad_norm"] > 0 and r1["loss"] == r1["loss"]  # finite, not NaN


def test_nan_loss_on_one_rank_skips_the_step_on_all_ranks(faulty_run):
    r2 = faulty_run["rows"][2]
    assert r2["nonfinite/loss"] == 1  # one micro-batch of rank 1, summed over ranks
    assert r2["skipped_updates"] == 1  # DeepSpeed's skip, the same count on every rank
    assert r2["grad_norm"] == "inf"  # logged as a string: JSON has no inf
    assert "nonfinite reward/loss/grad 0/1/0 | skipped 1" in faulty_run["log"]
    # Skipped steps change nothing: the weights after steps 2 and 3 (both skipped) equal those after step 1.
    root = faulty_run["out"] / "checkpoints"
    for which in ("model",):
        assert max_abs_diff(trained_weights(root / ckpt.checkpoint_name(4), which),
                            trained_weights(root / ckpt.checkpoint_name(2), which)) == 0.0


def test_too_many_skips_in_a_row_save_and_stop_with_an_error(faulty_run):
    assert faulty_run["rc"] == 3  # the launcher passes the workers' code on
    assert [r["step"] for r in faulty_run["rows"]] == [0, 1, 2, 3]
    errors = [line for line in faulty_run["log"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and faulty_run["log"].strip().splitlines()[-1] == errors[0]  # rank 0's, last
    assert "Traceback" not in faulty_run["log"]
    assert errors[0].startswith("error: faults.max_consecutive_skips: 2 steps in a row skipped")
    assert "checkpoint.resume=auto" in errors[0]
    saved = faulty_run["out"] / "checkpoints" / ckpt.checkpoint_name(4)
    assert ckpt.verify(saved) is None
    meta = json.loads((saved / "meta.json").read_text())
    assert (meta["consecutive_skips"], meta["total_skips"]) == (2, 3)
