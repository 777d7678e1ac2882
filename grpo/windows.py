"""SDE windows: which denoising steps of a rollout are stochastic (and trained); all others are ODE (Euler) steps.

Every function is a pure function of its arguments (the GRPO step included), with no scheduler state, so a resumed
run and an N-process run see exactly the window a single uninterrupted process would. A window is a ``range`` of
denoising step indices i (step i maps x_i at sigma_i to x_{i+1} at sigma_{i+1}), never empty.

Sources: MixGRPO (Tencent-Hunyuan/MixGRPO@e5cdd6a fastvideo/utils/grpo_states.py GRPOTrainingStates; paper
arXiv 2507.21802 §3, sliding window) and Flow-GRPO-Fast (yifan123/flow_grpo, flux_pipeline_with_logprob_fast.py,
checked at zhtmike/flow_grpo@a1f47c5, a fork carrying the same file; no paper, repository README 2025-07-31), and
Flash-GRPO's one SDE step per trajectory, shared by its group (Shredded-Pork/Flash-GRPO@4211013
scripts/train_wanx2_1_flash.py:693-706: per prompt one step index drawn uniformly from the first 10 of 20, every
other step ODE; ICML 2026, arXiv 2605.15980): placement "group", size 1, high num_steps // 2.
"""

from __future__ import annotations

import torch

from grpo.data import WINDOW, generator
from grpo.errors import ConfigError
from grpo.settings import SamplingConfig

__all__ = ["rollout_window", "sde_mask", "trainable_bound", "trainable_range", "random_window", "window"]


def trainable_bound(num_steps: int) -> int:
    """MixGRPO's bound M = T - 2: windows lie inside [0, M), so the last two transitions are never trained.

    Source: MixGRPO@e5cdd6a fastvideo/train_grpo_flux.py (max_timesteps = sampling_steps - 2, passed to
    GRPOTrainingStates). Needs T >= 3 (M >= 1).
    """
    if num_steps < 3:
        raise ConfigError(f"sampling.num_steps: {num_steps} leaves no step for an SDE window (needs T - 2 >= 1); "
                          "use at least 3")
    return num_steps - 2


def window(step: int, num_steps: int, size: int, shift_every: int, stride: int, *, roll_back: bool = True) -> range:
    """MixGRPO's progressive (sliding) window used at GRPO step `step` (0-based), as a closed form.

    Source: MixGRPO@e5cdd6a fastvideo/utils/grpo_states.py:85-148 (sample_strategy "progressive"), paper §3.
    The source keeps a start c (initially 0) and a counter; after every GRPO step the counter grows and every
    `shift_every` (tau) steps c += stride (prog_overlap_step, or the window size when prog_overlap is off: pass
    stride=size for that); once c > M it rolls back to 0 (roll_back) or is clamped to M. The window is
    [c, min(c + size, M)) with M = T - 2. Here c = (step // tau)·stride, wrapped or clamped.

    Deliberate difference (the pitfall "window empties at its last start"): in the source c may reach M, where the
    window [c, M) shrinks and at c = M is the empty range(M, M) for tau steps (an optimizer step on zero gradient).
    Here every window is full: the starts are limited to c <= M - size, so each GRPO step trains exactly `size`
    transitions per trajectory (DeepSpeed's gradient accumulation count is fixed for a run). With roll_back the
    cycle of starts is 0, stride, ..., k·stride (the largest multiple <= M - size) and then 0 again; without
    roll_back c stays at the last start once it gets there. stride 0 keeps the window at [0, size) (MixGRPO-Flash*,
    "frozen"). A size larger than M is clamped to M.

    Args:
        step: GRPO step (0-based), the only "state".
        num_steps: T, denoising steps of a rollout (>= 3).
        size: w >= 1, window size (MixGRPO: 4).
        shift_every: tau >= 1, GRPO steps per window position (MixGRPO: 25, Flash: 20).
        stride: s >= 0, steps the window moves each time (MixGRPO: 1; Flash*: 0).
        roll_back: back to 0 after the last start (MixGRPO's setting) or stay there.

    Returns:
        range of step indices, non-empty, inside [0, T - 2).
    """
    bound = trainable_bound(num_steps)
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    if size < 1:
        raise ConfigError(f"window size: must be >= 1, got {size}")
    if shift_every < 1:
        raise ConfigError(f"window shift_every: must be >= 1, got {shift_every}")
    if stride < 0:
        raise ConfigError(f"window stride: must be >= 0, got {stride}")
    size = min(size, bound)
    last = bound - size  # the last start with a full window
    moves = step // shift_every
    if stride == 0:
        start = 0
    elif roll_back:
        start = (moves % (last // stride + 1)) * stride
    else:
        start = min(moves * stride, last)
    return range(start, start + size)


def random_window(step: int, num_steps: int, size: int, low: int, high: int, seed: int, index: int = 0) -> range:
    """Flow-GRPO-Fast's window: size w at a start drawn uniformly from the integers [low, high - w].

    Source: yifan123/flow_grpo flux_pipeline_with_logprob_fast.py (879042c lines 113-197, read at the fork
    zhtmike/flow_grpo@a1f47c5): ``start = random.randint(sde_window_range[0], sde_window_range[1] - sde_window_size)``
    (both ends inclusive), window [start, start + w); config geneval_flux_fast / pickscore_flux_fast use w = 3,
    range (0, T // 2) (with T = 6 the start is always 0). MixGRPO's "random" strategy is the same draw with
    range (0, M), M = T - 2 (grpo_states.py, rng.integers(0, M - w + 1)).

    Difference: the source draws once per sampling call from Python's global RNG (so per rank and per batch); here
    the start is a pure function of (seed, step, index) through grpo/data.py's WINDOW stream, so every rank and a
    resumed run agree. Pass index = 0 for one window per GRPO step (all samples), or e.g. a chunk id for one per
    micro-batch. The last transition (into sigma = 0, where the CPS std is 0) is excluded: high <= T - 1.

    Args:
        step: GRPO step. num_steps: T. size: w >= 1. low, high: the start range, 0 <= low, high <= T - 1,
        high - low >= w. seed: the run's seed. index: a further key (default 0).

    Returns:
        range(start, start + size) with low <= start <= high - size.
    """
    if size < 1:
        raise ConfigError(f"window size: must be >= 1, got {size}")
    if not 0 <= low or not high <= num_steps - 1 or high - low < size:
        raise ConfigError(f"window range: ({low}, {high}) must satisfy 0 <= low, high <= num_steps - 1 = "
                          f"{num_steps - 1} and high - low >= size = {size}")
    start = int(torch.randint(low, high - size + 1, (1,), generator=generator(seed, step, index, WINDOW)).item())
    return range(start, start + size)


def sde_mask(win: range, num_steps: int) -> list[bool]:
    """For each denoising step i < T: True if it is an SDE step (inside the window, sampled with noise, its
    log-prob recorded and trained), False for a deterministic ODE (Euler) step.

    Sources: MixGRPO@e5cdd6a fastvideo/train_grpo_flux.py:171-241 (the `determistic` list), Flow-GRPO-Fast's
    noise_level = 0 outside sde_window. For MixGRPO-Flash the steps after win[-1] are replaced by the DPM-Solver++
    tail (grpo/solvers.py flash_sigmas), so this mask covers the original grid up to win[-1] only.
    """
    if len(win) == 0 or win.start < 0 or win.stop > num_steps or win.step != 1:
        raise ValueError(f"window {win} is not a non-empty contiguous range inside [0, {num_steps})")
    return [i in win for i in range(num_steps)]


def rollout_window(s: SamplingConfig, seed: int, step: int, first_sample: int = 0) -> range | None:
    """The SDE window of GRPO step `step` under the preset's `sampling.window`, or None (every step SDE).

    `first_sample`: the global index of a rollout micro-batch's first sample. Only placement "group" reads it: one
    window per prompt group (Flash-GRPO's iso-temporal grouping), drawn as "random" draws but keyed by the group
    s // group_size, so the group's samples share it on any world size (grpo/checks.py makes every rollout
    micro-batch hold whole groups or part of one; groups sharing a micro-batch share its first group's window).
    """
    w = s.window
    if w is None:
        return None
    if w.placement == "progressive":
        return window(step, s.num_steps, w.size, w.shift_every, w.stride)
    index = first_sample // s.group_size if w.placement == "group" else 0
    return random_window(step, s.num_steps, w.size, 0, w.high, seed, index)


def trainable_range(s: SamplingConfig, points: int) -> range:
    """Every transition a run's windows can train, of the `points` a trajectory has: the random and group windows'
    [0, high), the progressive one's [0, T - 2), without a window all of them."""
    w = s.window
    if w is None:
        return range(points)
    if w.placement == "progressive":
        return range(trainable_bound(s.num_steps))
    return range(w.high)
