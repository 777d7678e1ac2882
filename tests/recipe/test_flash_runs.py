"""Flash-GRPO (one SDE step per prompt group, shared, its loss rescaled per timestep) through the real recipe on CPU
processes: over two steps the first-pass ratio stays exactly 1 at the trained step, 1 and 2 processes train the
same, and a resumed run continues exactly (each group's step is a pure function of the seed, the step and the group;
the rescale a constant of the schedule; nothing of it is state).

    two      the tiny Flash-GRPO preset, 2 steps, 2 processes, micro-batches of half a group, a checkpoint every step
    one      the same on 1 process
    resumed  2 processes from two's step-1 checkpoint to step 2

(The default tier checks the preset on 2 processes, its first-pass ratio and cost: test_recipe_distributed.py.)
"""

from __future__ import annotations

import functools

import pytest

from tests.recipe.launch import assert_resumed_step_exact, assert_two_steps_agree, two_one_resumed
from tests.recipe.test_candidates_runs import _run

pytestmark = pytest.mark.slow
FLASH = "recipes/configs/tiny/flashgrpo_lora.yaml"
# SMALL's 4 steps: the group's SDE step is one of the first 3 transitions
EXTRA = ["grpo.timestep_fraction=1.0", "batch.micro_batch_size=2", "max_steps=2", "checkpoint.every=1", "checkpoint.keep=2", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return two_one_resumed(functools.partial(_run, tmp_path_factory.mktemp("flash")), FLASH, EXTRA)


def test_the_first_pass_ratio_is_exactly_one_at_each_groups_step(runs):
    rows = runs["two"]["rows"]
    assert [r["ratio_max_dev"] for r in rows] == [0.0, 0.0]
    assert [r["forwards_per_image"] for r in rows] == [4 + 3] * 2
    for r in rows:  # only the drawn steps are trained, each logged on its own
        trained = {k.split("/")[1].removesuffix("_max") for k in r if k.startswith("ratio_dev/") and k.endswith("_max")}
        assert trained and trained <= {"t00", "t01", "t02"}, trained


def test_one_and_two_processes_train_the_same(runs):
    assert_two_steps_agree(runs["one"], runs["two"])


def test_a_resumed_run_ends_exactly_as_the_uninterrupted_one(runs):
    assert_resumed_step_exact(runs["two"], runs["resumed"])
