"""NormGuard ({nft,awm}.norm_guard) through the real recipe on 2 CPU processes (ZeRO-3), against the lagging policy
(the tiny presets load no reference): at step 0 the lagging policy is the policy, so the policy's velocity equals
the one fixed_targets computed bit for bit: the hinge is exactly 0 and the logged norm ratio exactly 1. At step 1
the lagging policy lags (lag_rate 0.3, lr 1e-2): the ratio moves off 1 and the hinge is logged.

    nft   the tiny nft LoRA preset with the guard, 2 steps
    awm   the tiny awm LoRA preset (its anchor on) with the guard, 2 steps
    grpo  the tiny grpo LoRA preset with a KL: the drift stats against its reference, 2 steps
    1 vs 2 processes and exact resume of the guarded nft run: -m slow (CI time)
"""

from __future__ import annotations

import functools

import pytest

from tests.recipe.launch import assert_resumed_step_exact, assert_two_steps_agree, two_one_resumed
from tests.recipe.test_candidates_runs import _run

PRESETS = {"nft": "recipes/configs/tiny/nft_lora.yaml", "awm": "recipes/configs/tiny/awm_lora.yaml"}


def _extra(algorithm: str) -> list[str]:
    return [f"{algorithm}.norm_guard.weight=1.0", f"{algorithm}.norm_guard.margin=0.0", f"{algorithm}.lag_rate=0.3",
            "sampling.num_steps=6", "optim.lr=1e-2", "max_steps=2", "checkpoint.every=1"]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("norm_guard")


# nft's run with -m slow (CI time): the same hinge and ratio code as awm's (grpo/objectives/forward.py)
@pytest.mark.parametrize("algorithm", [pytest.param("nft", marks=pytest.mark.slow), "awm"])
def test_the_first_pass_hinge_is_zero_and_the_ratio_is_logged(tmp, algorithm):
    first, second = _run(tmp, algorithm, PRESETS[algorithm], 2, _extra(algorithm))["rows"]
    assert first["norm_guard"] == 0.0 and first["drift/vnorm_ratio"] == 1.0
    assert second["drift/vnorm_ratio"] != 1.0 and second["norm_guard"] >= 0.0
    assert first["drift/vnorm"] > 0 and second["drift/vnorm"] > 0


@pytest.mark.slow  # CI time: drift_stats's arithmetic and grpo's reference norms are tests/unit/test_norm_guard.py's
def test_grpo_logs_the_drift_against_its_reference(tmp):
    """grpo with a KL (a reference loaded: the LoRA policy with its adapters off): at step 0 the policy is the
    reference (its KL is exactly 0 there), so the ratio is exactly 1; the norm is logged at every step; the first-pass
    ratio stays exactly 1."""
    extra = ["grpo.kl_coef=0.01", "sampling.num_steps=4", "optim.lr=1e-2", "max_steps=2", "checkpoint.every=0"]
    first, second = _run(tmp, "grpo", "recipes/configs/tiny/grpo_lora.yaml", 2, extra)["rows"]
    assert first["drift/vnorm_ratio"] == 1.0 and second["drift/vnorm_ratio"] != 1.0
    assert first["drift/vnorm"] > 0 and second["drift/vnorm"] > 0
    assert first["ratio_max_dev"] == second["ratio_max_dev"] == 0.0


@pytest.mark.slow  # CI time: ZeRO-3's gradient all-reduce and the lagging policy's checkpoint, as nft's own runs
def test_one_vs_two_processes_and_exact_resume(tmp):
    runs = two_one_resumed(functools.partial(_run, tmp), PRESETS["nft"], _extra("nft"))
    assert_two_steps_agree(runs["one"], runs["two"])
    assert_resumed_step_exact(runs["two"], runs["resumed"])
