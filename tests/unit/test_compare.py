"""tools.compare: paired gains and differences of held-out evals, against the closed forms, and its bad input."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tools.compare import compare, main, paired

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


@pytest.mark.parametrize("case, message", [
    ("other_base", "base images differ"),
    ("base_only", "an eval of the base model only"),
    ("old_file", "no per-image rewards"),
    ("missing", "not a readable scores.json"),
    ("ceiling", "--ceiling 0.5: not above the base's"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, message):
    a = _scores(tmp_path, "a", [x + 0.05 for x in BASE])
    argv = {
        "other_base": [a, _scores(tmp_path, "other", BASE, base=[x + 0.01 for x in BASE])],
        "base_only": [a, _scores(tmp_path, "base_only", None)],
        "missing": [a, str(tmp_path / "nowhere.json")],
        "ceiling": [a, "--ceiling", "0.5"],
    }.get(case)
    if case == "old_file":
        old = json.loads((tmp_path / "a.json").read_text())
        del old["checkpoint"]["per_image"]
        (tmp_path / "old.json").write_text(json.dumps(old))
        argv = [str(tmp_path / "old.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
