"""Paired comparison of held-out evals: the `scores.json` files `tools.eval` writes for checkpoints of one preset.

    python -m tools.compare A/scores.json B/scores.json [...] [--ceiling R]

Every eval of a preset draws the same images of the base model (eta 0, the same noise per prompt and seed), so a
checkpoint's gain is paired image by image, and so is the difference between two checkpoints: the standard errors
printed are those of the mean of the per-image differences (n - 1 in the variance), the t its ratio to that error,
"higher" the share of images that score higher. With `--ceiling` (what right images score: 0.9966 on the tiny
world, docs/tiny_world.md) each gain is also a share of the gap from the base to it. Then each file after the first
is compared with the first. This is how the paired numbers of docs/results.md and benchmarks/RESULTS.md are read.

Bad input (files of other prompts or seeds, a base eval without a checkpoint, files without per-image rewards) exits
2 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grpo.best import paired
from grpo.errors import ConfigError, run_command

SAME_SCORE = 1e-4  # base scores closer than this are the same image


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


def compare(paths: list[str], ceiling: float | None = None) -> str:
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
    lines = [f"{len(base)} paired images ({len(first['prompts'])} prompts x {len(base) // len(first['prompts'])} "
             f"seeds), base {base_mean:.4f}"]
    for path, r in zip(paths, runs):
        after = r["checkpoint"]["per_image"]
        g = paired(r["base"]["per_image"], after)
        line = (f"{path}: step {r['checkpoint']['step']} ({r['checkpoint']['weights']}) {sum(after) / len(after):.4f}"
                f" | gain {g['mean']:+.4f} +- {g['se']:.4f}, t {g['t']:.1f}, {100 * g['higher']:.0f}% higher")
        if ceiling is not None:
            gap = ceiling - base_mean
            line += f" | {100 * g['mean'] / gap:.1f}% of the gap to {ceiling} (SE {100 * g['se'] / gap:.1f})"
        lines.append(line)
    for path, r in zip(paths[1:], runs[1:]):
        d = paired(first["checkpoint"]["per_image"], r["checkpoint"]["per_image"])
        lines.append(f"{path} - {paths[0]}: {d['mean']:+.4f} +- {d['se']:.4f}, t {d['t']:.1f}, "
                     f"{100 * d['higher']:.0f}% higher")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compare", description=__doc__.splitlines()[0])
    parser.add_argument("scores", nargs="+", help="scores.json files (or their folders) of tools.eval")
    parser.add_argument("--ceiling", type=float, default=None, help="what right images score (tiny world: 0.9966)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: compare(args.scores, args.ceiling))


if __name__ == "__main__":
    sys.exit(main())
