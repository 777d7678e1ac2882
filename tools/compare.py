"""Paired comparison of held-out evals: the `scores.json` files `tools.eval` writes for checkpoints of one preset.

    python -m tools.compare A/scores.json B/scores.json [...] [--ceiling R]
    python -m tools.compare --arm A1/scores.json A2/scores.json [...] --arm B1/scores.json [...] [--ceiling R]

Every eval of a preset draws the same images of the base model (eta 0, the same noise per prompt and seed), so a
checkpoint's gain is paired image by image, and so is the difference between two checkpoints: the standard errors
printed are those of the mean of the per-image differences (n - 1 in the variance), the t its ratio to that error,
"higher" the share of images that score higher. With `--ceiling` (what right images score: 0.9966 on the tiny
world, docs/tiny_world.md) each gain is also a share of the gap from the base to it. Then each file after the first
is compared with the first. This is how the paired numbers of docs/results.md and benchmarks/RESULTS.md are read.

With `--arm` (given once per arm) each arm holds several runs of one setting, e.g. one per training seed, all
evaluated on the same images. The per-image standard error says how much a run's gain would move on other eval
images; it says nothing of how much it moves with the run's training seed. So each arm also gets the mean of its
runs' means, the standard deviation between them (n - 1), their range and its worst run, and which of the two spreads
is larger; each arm after the first gets its difference from the first with both standard errors: between runs
(Welch's, sqrt(s_a^2 / k_a + s_b^2 / k_b)) and per image (paired, over each arm's per-image mean), and the two
together (in quadrature: the seeds and the images are independent draws).

Bad input (files of other prompts or seeds, a base eval without a checkpoint, files without per-image rewards) exits
2 with one line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

from grpo.best import paired
from grpo.errors import ConfigError, run_command

SAME_SCORE = 1e-4  # base scores closer than this are the same image


class Spread(NamedTuple):
    """Readings of one quantity over runs (e.g. training seeds), higher being better."""

    n: int
    mean: float
    std: float | None  # sample standard deviation (n - 1); None for a single run
    low: float
    high: float
    worst: int  # the index of the lowest reading


def spread(values: list[float]) -> Spread:
    """The mean, sample standard deviation, range and worst (lowest) of readings over runs."""
    n = len(values)
    if n == 0:
        raise ValueError("no readings")
    mean = sum(values) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1)) if n > 1 else None
    worst = min(range(n), key=values.__getitem__)
    return Spread(n, mean, std, values[worst], max(values), worst)


def read_scores(path: str | Path) -> dict:
    """A scores.json with its checkpoint's per-image rewards (one-line errors for anything else)."""
    p = Path(path)
    if p.is_dir():
        p = p / "scores.json"
    try:
        scores = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable scores.json ({e.__class__.__name__}); pass the file (or folder) "
                          f"python -m tools.eval wrote") from None
    if not scores.get("checkpoint"):
        raise ConfigError(f"{path}: an eval of the base model only; evaluate a checkpoint: python -m tools.eval "
                          f"CONFIG checkpoint=RUN_OR_CHECKPOINT")
    if "per_image" not in scores["base"] or "per_image" not in scores["checkpoint"]:
        raise ConfigError(f"{path}: no per-image rewards (written before tools.eval stored them); re-run python -m "
                          f"tools.eval for that checkpoint")
    return scores


def _same_images(a: list[float], b: list[float]) -> bool:
    """The same base images up to rounding: another host or micro-batch shape moves a score by ~1e-6, another noise or
    prompt by ~1e-2."""
    return len(a) == len(b) and all(abs(x - y) <= SAME_SCORE for x, y in zip(a, b))


def _read_paired(paths: list[str], ceiling: float | None) -> tuple[list[dict], float, list[str]]:
    """Every file's scores, checked to be evals of the same base images as the first's; the base's mean and the
    header line."""
    runs = [read_scores(p) for p in paths]
    first = runs[0]
    for path, r in zip(paths[1:], runs[1:]):
        if r["prompts"] != first["prompts"] or not _same_images(r["base"]["per_image"], first["base"]["per_image"]):
            raise ConfigError(f"{path}: its base images differ from {paths[0]}'s (other prompts, seeds or sampling); "
                              f"compare evals of one preset with the same logging.eval_seeds")
    base = first["base"]["per_image"]
    base_mean = sum(base) / len(base)
    if ceiling is not None and not ceiling > base_mean:
        raise ConfigError(f"--ceiling {ceiling}: not above the base's {base_mean:.4f}; give what right images score")
    header = (f"{len(base)} paired images ({len(first['prompts'])} prompts x {len(base) // len(first['prompts'])} "
              f"seeds), base {base_mean:.4f}")
    return runs, base_mean, [header]


def _run_line(path: str, r: dict, base_mean: float, ceiling: float | None) -> tuple[str, dict]:
    """One checkpoint's line (its reward, paired gain and share of the gap) and its paired gain."""
    after = r["checkpoint"]["per_image"]
    g = paired(r["base"]["per_image"], after)
    line = (f"{path}: step {r['checkpoint']['step']} ({r['checkpoint']['weights']}) {sum(after) / len(after):.4f}"
            f" | gain {g['mean']:+.4f} +- {g['se']:.4f}, t {g['t']:.1f}, {100 * g['higher']:.0f}% higher")
    if ceiling is not None:
        gap = ceiling - base_mean
        line += f" | {100 * g['mean'] / gap:.1f}% of the gap to {ceiling} (SE {100 * g['se'] / gap:.1f})"
    return line, g


def compare(paths: list[str], ceiling: float | None = None) -> str:
    runs, base_mean, lines = _read_paired(paths, ceiling)
    lines += [_run_line(path, r, base_mean, ceiling)[0] for path, r in zip(paths, runs)]
    for path, r in zip(paths[1:], runs[1:]):
        d = paired(runs[0]["checkpoint"]["per_image"], r["checkpoint"]["per_image"])
        lines.append(f"{path} - {paths[0]}: {d['mean']:+.4f} +- {d['se']:.4f}, t {d['t']:.1f}, "
                     f"{100 * d['higher']:.0f}% higher")
    return "\n".join(lines)


def _dominant(between: float | None, image: float) -> str:
    """Which of a spread between runs and a per-image standard error is the larger, in words."""
    if between is None:
        return "one run: no spread between runs"
    if between == image:
        return "neither dominates"
    side = "between runs" if between > image else "per image"
    ratio = max(between, image) / min(between, image) if min(between, image) > 0 else math.inf
    return f"the spread {side} dominates ({ratio:.1f}x)"


def compare_arms(arms: list[list[str]], ceiling: float | None = None) -> str:
    """Arms of several runs each (e.g. one per training seed), all on the same base images: each run's line, then each
    arm's spread between runs beside its per-image standard error, then each arm's difference from the first."""
    runs, base_mean, lines = _read_paired([p for arm in arms for p in arm], ceiling)
    remaining = iter(runs)
    arm_stats, arm_images = [], []  # per arm: the spread of its runs' gains; the per-image mean of its runs' rewards
    for a, arm in enumerate(arms, 1):
        rs = [next(remaining) for _ in arm]
        gains = []
        for path, r in zip(arm, rs):
            line, g = _run_line(path, r, base_mean, ceiling)
            lines.append(f"arm {a}: {line}")
            gains.append(g)
        s = spread([g["mean"] for g in gains])
        se = math.sqrt(sum(g["se"] ** 2 for g in gains) / len(gains))  # a typical run's (root mean square)
        share = "" if ceiling is None else f" ({100 * s.mean / (ceiling - base_mean):.1f}% of the gap)"
        between = "-" if s.std is None else (f"std {s.std:.4f}, {s.low:+.4f} .. {s.high:+.4f}, worst "
                                             f"{arm[s.worst]}")
        lines.append(f"arm {a}, {s.n} run{'s' * (s.n > 1)}: mean of the run means {base_mean + s.mean:.4f}, gain "
                     f"{s.mean:+.4f}{share} | between runs {between} | per image: a run's SE {se:.4f} | "
                     f"{_dominant(s.std, se)}")
        arm_stats.append(s)
        arm_images.append([sum(xs) / len(xs) for xs in zip(*(r["checkpoint"]["per_image"] for r in rs))])
    first = arm_stats[0]
    for a, (s, images) in enumerate(zip(arm_stats[1:], arm_images[1:]), 2):
        d = paired(arm_images[0], images)  # its mean is the difference of the two arms' mean gains
        if s.std is None or first.std is None:
            lines.append(f"arm {a} - arm 1: {d['mean']:+.4f} | per image SE {d['se']:.4f} | one run in an arm: no "
                         f"spread between runs")
            continue
        welch = math.sqrt(s.std ** 2 / s.n + first.std ** 2 / first.n)
        both = math.hypot(welch, d["se"])
        t = d["mean"] / both if both > 0 else 0.0
        lines.append(f"arm {a} - arm 1: {d['mean']:+.4f} | SE between runs {welch:.4f}, per image {d['se']:.4f}, "
                     f"together {both:.4f}, t {t:.1f} | {_dominant(welch, d['se'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compare", description=__doc__.splitlines()[0])
    parser.add_argument("scores", nargs="*", help="scores.json files (or their folders) of tools.eval")
    parser.add_argument("--arm", nargs="+", action="append", metavar="SCORES",
                        help="the runs of one arm (e.g. one per training seed); once per arm, instead of SCORES")
    parser.add_argument("--ceiling", type=float, default=None, help="what right images score (tiny world: 0.9966)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: _dispatch(args))


def _dispatch(args) -> str:
    if args.arm and args.scores:
        raise ConfigError(f"{args.scores[0]}: give the files either as SCORES or in --arm groups, not both")
    if args.arm:
        return compare_arms(args.arm, args.ceiling)
    if not args.scores:
        raise ConfigError("no scores.json given: python -m tools.compare A/scores.json B/scores.json, or --arm ...")
    return compare(args.scores, args.ceiling)


if __name__ == "__main__":
    sys.exit(main())
