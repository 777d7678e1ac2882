"""Flow-DPPO's trust region (grpo.trust_region) through the real recipe on 2 CPU processes: the first-pass ratio stays
exactly 1, the masked share is logged per trained transition, and the off-policy update blocks see a KL to the
rollout policy that the first pass does not (it is exactly 0 there, so even a threshold of 1e-12 masks nothing).

    grpo    the tiny grpo LoRA preset with the trust region, 2 steps, 2 update blocks a step (the second one is
            off-policy and can be masked), all 3 trainable transitions, lr 1e-2
    replay  the tiny OP-GRPO preset with it: step 1's replay block takes its SDE means from the same no-grad pass as
            its ratio's log-probs, so its KL and masked share are exactly 0
    one, resumed  grpo's run on 1 process, and on 2 again from its step-1 checkpoint: the same steps (1 vs N) and the
            same step 1 and final weights exactly (resume); runs made when a test first asks for them
"""

from __future__ import annotations

import functools

import pytest

from tests.recipe.launch import assert_resumed_step_exact, assert_two_steps_agree
from tests.recipe.test_candidates_runs import _run
from tests.recipe.test_recipe_distributed import _Runs
from tests.recipe.test_replay_runs import EXTRA as REPLAY_EXTRA
from tests.recipe.test_replay_runs import OPGRPO

GRPO = "recipes/configs/tiny/grpo_lora.yaml"
TRUST = "grpo.trust_region.kl_threshold=1e-12"  # any KL the weights' moving makes is outside
GRPO_EXTRA = [TRUST, "batch.updates_per_step=2", "batch.micro_batch_size=2", "grpo.timestep_fraction=1.0",
              "max_steps=2", "checkpoint.every=1", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("dppo")


@pytest.fixture(scope="module")
def grpo_runs(tmp):
    """name -> grpo's run with the trust region: "grpo" on 2 processes (a checkpoint a step), "one" on 1, "resumed"
    on 2 from grpo's step-1 checkpoint; each made when a test first asks for it."""
    run = functools.partial(_run, tmp)
    overrides = {"grpo": (2, GRPO_EXTRA), "one": (1, GRPO_EXTRA)}

    def make(name: str) -> dict:
        if name == "resumed":
            step1 = runs["grpo"]["dir"] / "checkpoints" / "step_00000001"
            return run(name, GRPO, 2, [*GRPO_EXTRA, f"checkpoint.resume={step1}"])
        nproc, extra = overrides[name]
        return run(name, GRPO, nproc, extra)

    runs = _Runs(make)
    return runs


@pytest.mark.slow  # CI time: the mask's arithmetic and per-transition logging are tests/unit/test_dppo.py's
def test_the_first_pass_ratio_stays_one_and_the_masked_share_is_logged_per_transition(grpo_runs):
    rows = grpo_runs["grpo"]["rows"]
    assert [r["ratio_max_dev"] for r in rows] == [0.0, 0.0]
    for r in rows:
        assert 0.0 <= r["dppo/masked_frac"] <= 1.0
        per = {k: v for k, v in r.items() if k.startswith("dppo/masked_frac/")}
        assert set(per) == {f"dppo/masked_frac/t{j:02d}" for j in range(3)}, per
        assert all(0.0 <= v <= 1.0 for v in per.values())
        assert r["dppo/kl"] > 0  # the second block's, after the first one's optimizer step at lr 1e-2
        assert r["forwards_per_image"] == 4 + 3 * 3  # the means come with the log-probs' forwards
    # the mask engages on the off-policy block (measured: 0.375 and 0.208 of all the step's terms; the first block's
    # share is 0, its KL being exactly 0)
    assert any(r["dppo/masked_frac"] > 0 for r in rows)


@pytest.mark.slow  # CI time: the replay block's means come from the same transition code as the on-policy block's
def test_the_replay_block_is_exactly_on_policy_to_its_own_means(tmp):
    first, second = _run(tmp, "replay", OPGRPO, 2, [*REPLAY_EXTRA, TRUST])["rows"]
    assert first["ratio_max_dev"] == second["ratio_max_dev"] == second["replay/ratio_max_dev"] == 0.0
    assert second["replay/blocks"] == 1.0
    assert second["replay/dppo/kl"] == 0.0 and second["replay/dppo/masked_frac"] == 0.0
    assert second["dppo/kl"] > 0  # its 4 on-policy blocks: the later ones are off-policy


@pytest.mark.slow  # CI time: two more 2-step runs (each ~2 min on the loaded 2-core host)
def test_one_vs_two_processes_and_exact_resume(grpo_runs):
    """With the mask on (and engaging on the off-policy blocks), 1 and 2 processes train the same steps, and a run
    resumed from the step-1 checkpoint logs step 1 and ends with the step-2 weights exactly."""
    two = grpo_runs["grpo"]
    assert any(r["dppo/masked_frac"] > 0 for r in two["rows"])  # the mask did take part in what is compared
    assert_two_steps_agree(grpo_runs["one"], two)
    for a, b in zip(grpo_runs["one"]["rows"], two["rows"]):
        assert b["dppo/masked_frac"] == pytest.approx(a["dppo/masked_frac"], abs=1e-6)
    assert_resumed_step_exact(two, grpo_runs["resumed"])
