"""tools.compare: paired gains and differences of held-out evals, against the closed forms, and its bad input."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tools.compare import compare, compare_arms, main, paired, spread

BASE = [0.80, 0.70, 0.90, 0.60, 0.85, 0.75]
PROMPTS = ["a red circle on a cyan background", "a blue square on a yellow background"]


def _scores(tmp_path, name: str, after: list[float] | None, base: list[float] = BASE, step: int = 10):
    checkpoint = None if after is None else {"path": name, "step": step, "weights": "ema", "per_image": after,
                                             "reward_mean": sum(after) / len(after)}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"prompts": PROMPTS, "base": {"per_image": base, "reward_mean": sum(base) / len(base)},
                                "checkpoint": checkpoint}))
    return str(path)


def test_paired_is_the_mean_difference_and_its_standard_error(tmp_path):
    after = [0.90, 0.72, 0.88, 0.75, 0.95, 0.74]
    d = [b - a for a, b in zip(BASE, after)]
    got = paired(BASE, after)
    se = statistics.stdev(d) / math.sqrt(len(d))
    assert got["mean"] == pytest.approx(statistics.fmean(d), abs=1e-12)
    assert got["se"] == pytest.approx(se, abs=1e-12)
    assert got["t"] == pytest.approx(statistics.fmean(d) / se, abs=1e-9)
    assert got["higher"] == pytest.approx(4 / 6) and got["n"] == 6
    # the base evals of two hosts differ by rounding only: still paired
    out = compare([_scores(tmp_path, "a", BASE), _scores(tmp_path, "b", BASE, base=[x + 1e-6 for x in BASE])])
    assert out.splitlines()[-1].endswith(": +0.0000 +- 0.0000, t 0.0, 0% higher")
    # no spread: t is 0, not a division by zero
    assert paired([0.5, 0.5], [0.6, 0.6])["t"] == 0.0


def test_compare_prints_gains_shares_of_the_gap_and_the_difference(tmp_path):
    a = [x + 0.05 for x in BASE]
    b = [x + 0.05 + 0.01 * (i % 2) for i, x in enumerate(BASE)]
    out = compare([_scores(tmp_path, "a", a), _scores(tmp_path, "b", b)], ceiling=1.0).splitlines()
    assert out[0] == "6 paired images (2 prompts x 3 seeds), base 0.7667"
    gap = 1.0 - statistics.fmean(BASE)
    assert "gain +0.0500 +- 0.0000" in out[1] and f"{100 * 0.05 / gap:.1f}% of the gap to 1.0" in out[1]
    assert "gain +0.0550" in out[2]
    d = paired(a, b)
    assert out[3].endswith(f": +0.0050 +- {d['se']:.4f}, t {d['t']:.1f}, 50% higher")


def test_spread_is_the_mean_sample_std_range_and_worst_over_runs():
    s = spread([6.0, 7.5, 3.0])
    # mean 5.5; deviations 0.5, 2, -2.5: sum of squares 10.5 over n - 1 = 2
    assert (s.n, s.mean, s.low, s.high, s.worst) == (3, 5.5, 3.0, 7.5, 2)
    assert s.std == pytest.approx(math.sqrt(5.25), abs=1e-12)
    assert spread([0.04]) == (1, 0.04, None, 0.04, 0.04, 0)  # one run: no spread


# Three runs an arm (say training seeds 42, 43, 44), every run its arm's offset plus the same per-image wobble (+-0.01):
# a run's paired SE is sqrt(6 x 0.01^2 / 5) / sqrt(6) = 0.01 / sqrt(5) = 0.004472 (all three alike).
WOBBLE = [0.01, -0.01, 0.01, -0.01, 0.01, -0.01]


def _arm(tmp_path, name: str, offsets: list[float], sign: int = 1) -> list[str]:
    return [_scores(tmp_path, f"{name}{i}", [b + o + sign * w for b, w in zip(BASE, WOBBLE)])
            for i, o in enumerate(offsets)]


def test_arms_report_the_spread_between_runs_beside_the_per_image_se(tmp_path):
    a = _arm(tmp_path, "a", [0.05, 0.07, 0.03])  # gains 0.05 0.07 0.03: mean 0.05, std 0.02, worst the third
    b = _arm(tmp_path, "b", [0.06, 0.10, 0.08], sign=-1)  # mean 0.08, std 0.02, worst the first
    out = compare_arms([a, b], ceiling=1.0).splitlines()
    assert out[0] == "6 paired images (2 prompts x 3 seeds), base 0.7667" and len(out) == 1 + 4 + 4 + 1
    assert out[1].startswith(f"arm 1: {a[0]}: step 10 (ema) 0.8167 | gain +0.0500 +- 0.0045")
    # gap 1 - 0.76667 = 0.23333: 0.05 is 21.4% of it; 0.02 / 0.004472 = 4.47
    assert out[4] == (f"arm 1, 3 runs: mean of the run means 0.8167, gain +0.0500 (21.4% of the gap) | between runs "
                      f"std 0.0200, +0.0300 .. +0.0700, worst {a[2]} | per image: a run's SE 0.0045 | the spread "
                      f"between runs dominates (4.5x)")
    assert out[8].startswith("arm 2, 3 runs: mean of the run means 0.8467, gain +0.0800 (34.3% of the gap) | "
                             f"between runs std 0.0200, +0.0600 .. +0.1000, worst {b[0]} |")
    # B - A = 0.03. Between runs (Welch): sqrt(0.02^2 / 3 + 0.02^2 / 3) = 0.016330. Per image: the arms' per-image
    # means differ by 0.03 - 2 x wobble, so sqrt(6 x 0.02^2 / 5) / sqrt(6) = 0.008944; together
    # sqrt(0.016330^2 + 0.008944^2) = 0.018619, t 0.03 / 0.018619 = 1.61; 0.016330 / 0.008944 = 1.83
    assert out[9] == ("arm 2 - arm 1: +0.0300 | SE between runs 0.0163, per image 0.0089, together 0.0186, t 1.6 | "
                      "the spread between runs dominates (1.8x)")


def test_arms_whose_runs_agree_are_dominated_by_the_images(tmp_path):
    a = _arm(tmp_path, "a", [0.050, 0.051, 0.049])  # std 0.001 against a run's SE 0.004472: 4.47x the other way
    out = compare_arms([a], ceiling=None).splitlines()
    assert out[-1].endswith("between runs std 0.0010, +0.0490 .. +0.0510, worst "
                            f"{a[2]} | per image: a run's SE 0.0045 | the spread per image dominates (4.5x)")
    one = compare_arms([a, _arm(tmp_path, "b", [0.06])]).splitlines()
    assert "arm 2, 1 run:" in one[-2] and one[-2].endswith("one run: no spread between runs")
    assert one[-1].startswith("arm 2 - arm 1: +0.0100 | per image SE") and "no spread between runs" in one[-1]


def test_arms_from_the_command_line(tmp_path, capsys):
    a, b = _arm(tmp_path, "a", [0.05, 0.07]), _arm(tmp_path, "b", [0.06, 0.10])
    assert main(["--arm", *a, "--arm", *b, "--ceiling", "1.0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("arm 2 - arm 1: +0.0200 | SE between runs")


@pytest.mark.parametrize("case, message", [
    ("other_base", "base images differ"),
    ("base_only", "an eval of the base model only"),
    ("old_file", "no per-image rewards"),
    ("missing", "not a readable scores.json"),
    ("ceiling", "--ceiling 0.5: not above the base's"),
    ("both", "either as SCORES or in --arm groups, not both"),
    ("none", "no scores.json given"),
    ("arm_other_base", "base images differ"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, message):
    a = _scores(tmp_path, "a", [x + 0.05 for x in BASE])
    argv = {
        "other_base": [a, _scores(tmp_path, "other", BASE, base=[x + 0.01 for x in BASE])],
        "base_only": [a, _scores(tmp_path, "base_only", None)],
        "missing": [a, str(tmp_path / "nowhere.json")],
        "ceiling": [a, "--ceiling", "0.5"],
        "both": [a, "--arm", a],
        "none": [],
        "arm_other_base": ["--arm", a, "--arm", _scores(tmp_path, "other", BASE, base=[x + 0.01 for x in BASE])],
    }.get(case)
    if case == "old_file":
        old = json.loads((tmp_path / "a.json").read_text())
        del old["checkpoint"]["per_image"]
        (tmp_path / "old.json").write_text(json.dumps(old))
        argv = [str(tmp_path / "old.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
