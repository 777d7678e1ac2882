"""The protocol over training seeds that benchmarks/time_to_reward.py reports: each reading (speed-up, final gain, share
of the gap) per seed, then over the seeds its mean, its worst seed, and the spread between seeds (sample standard
deviation, min .. max); the headline is the best strategy's mean speed-up with its worst seed beside it.

The mean of the per-seed readings, not a reading of the seed-mean curve: the worst seed and the spread are spreads of
the per-seed readings, so the mean beside them must be theirs too. A seed whose baseline run gained nothing has no
speed-up (nothing to reach); a strategy that never reaches the baseline's gain within the budget reads 0 on that seed
(a real reading: it would need more compute than the budget). Not a library module: benchmarks and their tests only.
"""

from __future__ import annotations

from typing import NamedTuple

from tools.compare import Spread, spread

Readings = dict[str, list[float | None]]  # quantity -> one reading per training seed (None: no reading)

# How each quantity prints: a value, and a spread of values (its standard deviation has no sign)
FORMATS = {
    "speed-up": ("{:.2f}x", "{:.2f}"),
    "final gain": ("{:+.4f}", "{:.4f}"),
    "share of the gap": ("{:.1%}", "{:.1%}"),
}


class SeedSummary(NamedTuple):
    spread: Spread  # over the seeds with a reading
    worst_seed: int
    seeds: int  # how many seeds had a reading


def summarize(values: list[float | None], seeds: list[int]) -> SeedSummary | None:
    """Mean, spread and worst seed of one quantity's readings; None when no seed has one."""
    have = [(seed, v) for seed, v in zip(seeds, values, strict=True) if v is not None]
    if not have:
        return None
    s = spread([v for _, v in have])
    return SeedSummary(s, have[s.worst][0], len(have))


def summary_lines(name: str, readings: Readings, seeds: list[int]) -> list[str]:
    """One line per quantity: mean | worst seed | std | min .. max over the training seeds."""
    lines = []
    for what, values in readings.items():
        value, dev = FORMATS[what]
        s = summarize(values, seeds)
        if s is None:
            lines.append(f"{name:>14}  {what:<16}  no reading on any seed")
            continue
        std = "-" if s.spread.std is None else dev.format(s.spread.std)
        some = f" ({s.seeds} of {len(seeds)} seeds)" if s.seeds < len(seeds) else ""
        lines.append(f"{name:>14}  {what:<16}  {value.format(s.spread.mean):>8} | "
                     f"{value.format(s.spread.low):>8} (seed {s.worst_seed}) | {std:>6} | "
                     f"{value.format(s.spread.low)} .. {value.format(s.spread.high)}{some}")
    return lines


def headline(speedups: dict[str, list[float | None]], seeds: list[int]) -> str:
    """The `time_to_reward_speedup` line: the strategy with the best mean speed-up over the seeds, its worst seed
    beside it (0 when no strategy has a reading)."""
    summaries = {n: s for n, v in speedups.items() if (s := summarize(v, seeds)) is not None}
    if not summaries:
        return "time_to_reward_speedup: 0.000 (no strategy has a reading)"
    name = max(summaries, key=lambda n: summaries[n].spread.mean)
    s = summaries[name]
    return (f"time_to_reward_speedup: {s.spread.mean:.3f} ({name}, mean of {s.seeds} seed{'s' * (s.seeds > 1)}; "
            f"worst seed {s.worst_seed}: {s.spread.low:.3f})")
