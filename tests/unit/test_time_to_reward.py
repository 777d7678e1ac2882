"""The arithmetic of benchmarks/time_to_reward.py: its cost model, the compute to reach a gain, the seed average, and
the protocol over training seeds (benchmarks/_seeds.py: per-seed readings, their mean, worst seed and spread, the
headline). (The script itself runs in tests/recipe/test_benchmarks.py::test_time_to_reward_smoke.)"""

import json

import pytest

from benchmarks import _seeds as seeds
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


def test_the_gardo_strategy_is_dancegrpo_with_its_gated_kl():
    """dancegrpo_gardo resolves to the default run plus GARDO at its source's defaults, JPEG compressibility scored
    untrained as the auxiliary reward (so held-out evals read tiny_world alone), and pays its reference's forward at
    every trained transition."""
    base, cfg = ttr.strategy_config("dancegrpo", []), ttr.strategy_config("dancegrpo_gardo", [])
    g = cfg.grpo.gardo
    assert (g.aux_rewards, g.share, g.kl_coef, g.kl_threshold, g.refresh_every) == (
        ["jpeg_compressibility"], 0.1, 0.01, 3e-4, 16)
    assert {k: v["weight"] if isinstance(v, dict) else v for k, v in cfg.rewards.items()} == {
        "tiny_world": 1.0, "jpeg_compressibility": 0.0}
    assert base.grpo.gardo is None and cfg.grpo.kl_coef == base.grpo.kl_coef == 0.0
    assert ttr.step_cost(cfg, 0) == ttr.step_cost(base, 0) + 5 == 6 + 5 * 4


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


# Three training seeds (42, 43, 44), each a baseline run and a strategy's run from the same step-0 eval:
# 42: the baseline ends +0.02 (first reached at 200/3), the strategy reaches it at 40/3: 5x; it ends +0.03
# 43: the baseline ends -0.01: no speed-up to read; the strategy ends +0.02
# 44: the baseline ends +0.06, the strategy never reaches it: 0x (within the budget); it ends +0.015
BASE_RUNS = [[(0.0, 0.50), (100.0, 0.53), (200.0, 0.52)], [(0.0, 0.60), (100.0, 0.59), (200.0, 0.59)],
             [(0.0, 0.40), (100.0, 0.44), (200.0, 0.46)]]
RUNS = [[(0.0, 0.50), (20.0, 0.53)], [(0.0, 0.60), (20.0, 0.62)], [(0.0, 0.40), (20.0, 0.415)]]
SEEDS = [42, 43, 44]


def test_seed_readings_are_each_seed_against_its_own_baseline():
    r = ttr.seed_readings(BASE_RUNS, RUNS, ceiling=1.0)
    assert r["speed-up"] == [pytest.approx(5.0), None, 0.0]
    assert r["final gain"] == pytest.approx([0.03, 0.02, 0.015])
    assert r["share of the gap"] == pytest.approx([0.03 / 0.5, 0.02 / 0.4, 0.015 / 0.6])  # from each step-0 eval to 1
    with pytest.raises(ValueError):  # a seed missing on one side
        ttr.seed_readings(BASE_RUNS, RUNS[:2], ceiling=1.0)


def test_the_summary_over_seeds_is_mean_worst_std_and_range():
    lines = seeds.summary_lines("awm", ttr.seed_readings(BASE_RUNS, RUNS, ceiling=1.0), SEEDS)
    # speed-up over the two seeds with a reading: mean 2.5, std sqrt(2 x 2.5^2 / 1) = 3.54, worst seed 44
    assert lines[0] == ("           awm  speed-up             2.50x |    0.00x (seed 44) |   3.54 | 0.00x .. 5.00x "
                        "(2 of 3 seeds)")
    # gains 0.03 0.02 0.015: mean 0.02167, deviations 0.00833 -0.00167 -0.00667, std sqrt(1.1667e-4 / 2) = 0.0076
    assert lines[1] == ("           awm  final gain         +0.0217 |  +0.0150 (seed 44) | 0.0076 | "
                        "+0.0150 .. +0.0300")
    # shares 6%, 5%, 2.5%: mean 4.5%, deviations 1.5 0.5 -2 points, std sqrt(6.5 / 2) = 1.8 points
    assert lines[2] == "           awm  share of the gap      4.5% |     2.5% (seed 44) |   1.8% | 2.5% .. 6.0%"
    assert seeds.summary_lines("x", {"speed-up": [None, None]}, [42, 43]) == [
        "             x  speed-up          no reading on any seed"]
    one = seeds.summary_lines("x", {"final gain": [0.01]}, [42])[0]  # one seed: no spread
    assert one.endswith("|  +0.0100 (seed 42) |      - | +0.0100 .. +0.0100")


def test_the_headline_is_the_best_mean_with_its_worst_seed():
    speedups = {"awm": [5.0, None, 0.0], "nft": [3.0, 3.5, 2.5]}
    assert seeds.headline(speedups, SEEDS) == ("time_to_reward_speedup: 3.000 (nft, mean of 3 seeds; worst seed 44: "
                                               "2.500)")
    assert seeds.headline({"awm": speedups["awm"]}, SEEDS) == ("time_to_reward_speedup: 2.500 (awm, mean of 2 seeds; "
                                                               "worst seed 44: 0.000)")
    # RESULTS.md "Goal 1 met": AWM at one noise level on 3-step rollouts, 7.37x 6.08x 3.04x per seed
    assert seeds.headline({"awm_t1_3": [7.37, 6.08, 3.04]}, SEEDS).startswith("time_to_reward_speedup: 5.497 (awm_t1_3")
    assert seeds.headline({"awm": [None]}, [42]) == "time_to_reward_speedup: 0.000 (no strategy has a reading)"


def test_saved_runs_are_read_back_not_retrained(tmp_path):
    """--report-only reads a finished run's metrics; a missing run, or one of another budget, is one line."""
    run_dir = tmp_path / "awm"
    rows = [{"step": k, "forwards_per_image": 14.0} for k in range(3)] + [{"step": 3, "eval/reward_mean": 0.9}]
    with pytest.raises(SystemExit, match="no finished run of awm .--report-only trains nothing"):
        ttr.run("awm", "flux1", [], 3, 1, run_dir, reuse=False, train=False)
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ttr.run("awm", "flux1", [], 3, 1, run_dir, reuse=False, train=False) == rows
    with pytest.raises(SystemExit, match="a run of 3 steps, this budget gives awm 4"):
        ttr.run("awm", "flux1", [], 4, 1, run_dir, reuse=True)
