"""OP-GRPO's trajectory replay (grpo/replay.py) through the real recipe on CPU processes: step 0 fills the buffer,
step 1 replays a block of it after its on-policy blocks. The on-policy block's first-pass ratio stays exactly 1 and
so does the replay block's (its ratio is to the no-grad pass just before it), 1 and 2 processes replay the same, and a
run resumed from the checkpoint taken with the buffer non-empty continues exactly (the buffer is in rank 0's file).

    two      the tiny OP-GRPO preset, 2 steps, 2 processes, 4 update blocks of 2 images a step (so a replay block of
             2 fits the buffer after one step), a checkpoint every step (slow since 2026-12-07, CI time: an
             experimental preset; the replay's draw, ratio and buffer in process in tests/unit/test_replay.py)
    one      the same on 1 process                                  (slow)
    resumed  2 processes from two's step-1 checkpoint to step 2     (slow)
"""

from __future__ import annotations

import functools

import pytest
from safetensors.torch import load_file

from grpo.checkpoint import rank_file
from tests.recipe.launch import assert_resumed_step_exact, assert_two_steps_agree
from tests.recipe.test_candidates_runs import _run

OPGRPO = "recipes/configs/experimental/tiny_opgrpo_lora.yaml"
# SMALL's 8 images and 4 steps (K = 1 of 3 trainable transitions): update blocks of 2, a buffer of 4, 2 entries a
# step, transitions 0 and 1 weighted and replayed; a KL to the base model, so replayed chunks get their reference
# means too; no held-out eval (not what is tested, and it costs the run ~15 s)
EXTRA = ["batch.micro_batch_size=1", "batch.updates_per_step=4", "grpo.replay.size=4", "grpo.replay.per_step=2",
         "grpo.replay.truncate=2", "grpo.kl_coef=0.1", "data.eval_prompts=null", "max_steps=2", "checkpoint.every=1",
         "checkpoint.keep=2", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("replay")


@pytest.fixture(scope="module")
def two(tmp):
    return _run(tmp, "two", OPGRPO, 2, EXTRA)


@pytest.fixture(scope="module")
def others(tmp, two):
    run = functools.partial(_run, tmp)
    return {"one": run("one", OPGRPO, 1, EXTRA),
            "resumed": run("resumed", OPGRPO, 2, [*EXTRA, f"checkpoint.resume={two['dir']}/checkpoints/step_00000001"])}


@pytest.mark.slow
def test_the_replay_block_runs_after_the_on_policy_one_at_first_pass_ratio_one(two):
    first, second = two["rows"]
    assert first["ratio_max_dev"] == second["ratio_max_dev"] == 0.0
    assert (first["replay/size"], first["replay/blocks"]) == (0.0, 0.0)  # nothing to replay at step 0
    # 4 rollout steps, 1 trained transition: a forward, a backward and the reference's forward
    assert "replay/weight_mean" not in first and first["forwards_per_image"] == 4 + 1 * 4
    assert (second["replay/size"], second["replay/blocks"], second["replay/age_mean"]) == (2.0, 1.0, 1.0)
    assert second["replay/ratio_max_dev"] == 0.0
    # the replay block's loss terms are logged apart from the on-policy blocks' (loss, kl, clip_frac, ratio_mean)
    assert {"replay/loss", "replay/kl", "replay/clip_frac", "replay/ratio_mean"} <= set(second)
    assert second["replay/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and second["replay/clip_frac"] == 0.0
    assert not any(k.startswith("replay/") for k in first if k not in ("replay/size", "replay/blocks"))
    # the policy moved over step 0's 4 optimizer steps and step 1's on-policy ones: the weight is not 1
    assert 0 < second["replay/weight_min"] <= second["replay/weight_mean"] <= second["replay/weight_max"] <= 2.0
    assert second["replay/weight_min"] != 1.0
    # a block of 2 of the step's 8 images: 2 no-grad forwards of the weight + 1 trained transition each
    assert second["forwards_per_image"] == 4 + 1 * 4 + 2 * (2 + 1 * 4) / 8
    buffer = load_file(str(two["dir"] / "checkpoints" / "step_00000001" / rank_file(0)))
    assert buffer["replay/latents"].shape[:2] == (2, 3) and buffer["replay/log_probs"].shape == (2, 2)
    assert "replay/latents" not in load_file(str(two["dir"] / "checkpoints" / "step_00000001" / rank_file(1)))


@pytest.mark.slow
def test_one_and_two_processes_replay_the_same(two, others):
    assert_two_steps_agree(others["one"], two)
    a, b = others["one"]["rows"][1], two["rows"][1]
    for key in (k for k in b if k.startswith("replay/")):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key


@pytest.mark.slow
def test_a_run_resumed_with_a_full_buffer_ends_exactly_as_the_uninterrupted_one(two, others):
    assert others["resumed"]["rows"][0]["replay/blocks"] == 1.0
    assert_resumed_step_exact(two, others["resumed"])
