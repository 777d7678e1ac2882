"""The arithmetic of benchmarks/time_to_reward.py: its cost model, the compute to reach a gain, the seed average.
(The script itself runs in tests/recipe/test_benchmarks.py::test_time_to_reward_smoke.)"""

import pytest

from benchmarks import time_to_reward as ttr


def test_cost_model_of_the_presets():
    cost = {n: ttr.step_cost(ttr.strategy_config(n, []), 0) for n in ttr.STRATEGIES}
    # DanceGRPO: 6 rollout steps + 5 trained transitions x 3; AWM: 6 + 2 noise levels x (3 + the anchor's forward).
    assert cost["dancegrpo"] == 6 + 5 * 3 and cost["awm"] == 6 + 2 * 4
    assert cost["mixgrpo"] == 6 + 2 * 3  # ODE outside a window of 2
    # Flash*: 1 SDE step + 2 solver steps + 1 trained; DiffusionNFT's DPM rollout: 1 Euler + 2 solver steps
    assert cost["flash_frozen"] == 1 + 2 + 3 and cost["nft_dpm"] == 1 + 2 + 2 * 4 < cost["nft"] == 6 + 2 * 4
    # candidate selection: a pool of 8 previewed in 3 steps per 4 kept, on top of the step it selects for
    assert cost["grpo_candidates"] == 8 * 3 / 4 + cost["dancegrpo"] and cost["nft_candidates"] == 6 + cost["nft"]
    assert cost["awm_candidates"] == 6 + cost["awm"] and cost["awm_t1"] == 6 + 1 * 4
    assert cost["awm_t1_no_anchor"] == 6 + 1 * 3  # no anchor: no forward of the lagging policy
    assert cost["awm_t1_no_anchor_4"] == 4 + 1 * 3  # rollouts on 4 steps (the evals on 6 are not training compute)
    assert cost["awm_t1_no_anchor_3"] == 3 + 1 * 3
    assert cost["awm_t1_3"] == 3 + 1 * 4  # the anchor's forward of the lagging policy is back
    # BranchGRPO, trees of 4 splitting at steps 0 and 2: 1+2+2+4+4+4 rollout calls and 3 x (1+2+2+4+4) a tree
    assert cost["branchgrpo"] == (17 + 3 * 13) / 4
    cfg = ttr.strategy_config("awm", [])
    assert ttr.steps_within(cfg, 45 * 14) == 45 and ttr.steps_within(cfg, 45 * 14 - 1) == 44
    assert ttr.steps_within(cfg, 1) == 1  # at least one step


def test_compute_to_reach_interpolates_between_evals():
    curve = [(0.0, 0.50), (100.0, 0.52), (200.0, 0.56)]
    assert ttr.compute_to_reach(curve, 0.02) == pytest.approx(100.0)
    assert ttr.compute_to_reach(curve, 0.04) == pytest.approx(150.0)
    assert ttr.compute_to_reach(curve, 0.07) is None
    assert ttr.compute_to_reach([(0.0, 0.5), (50.0, 0.49), (90.0, 0.53)], 0.01) == pytest.approx(70.0)


def test_speedup_is_the_baselines_compute_to_its_final_gain_over_the_others():
    base = [(0.0, 0.50), (100.0, 0.53), (200.0, 0.52)]  # its final gain +0.02, first reached at 66.7
    assert ttr.speedup(base, [(0.0, 0.60), (20.0, 0.63)]) == (pytest.approx(0.02), pytest.approx(40 / 3),
                                                               pytest.approx(5.0))
    assert ttr.speedup(base, [(0.0, 0.60), (20.0, 0.59)])[1:] == (None, 0.0)  # never reached
    assert ttr.speedup([(0.0, 0.5), (100.0, 0.49)], base)[1:] == (None, 0.0)  # a baseline that lost: no reading


def test_seed_curves_are_averaged_point_by_point():
    a = [(0.0, 0.50), (100.0, 0.54)]
    b = [(0.0, 0.52), (100.0, 0.52)]
    assert ttr.mean_curve([a, b]) == [(0.0, 0.51), (100.0, pytest.approx(0.53))]


def test_the_flux2_family_runs_the_same_presets_on_tiny_flux2():
    """--family flux2: each strategy's preset on the tiny FLUX.2 world, at the same compute per step."""
    for name in ("dancegrpo", "nft", "branchgrpo"):
        flux1, flux2 = ttr.strategy_config(name, []), ttr.strategy_config(name, [], "flux2")
        assert flux2.model.path.endswith("tiny-flux2") and "to_qkv_mlp_proj" in flux2.lora.target_modules
        assert ttr.step_cost(flux2, 0) == ttr.step_cost(flux1, 0)
