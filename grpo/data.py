"""Which prompts and which random numbers each GRPO step uses, as pure functions of (seed, step, index).

Nothing here depends on the rank or the world size, so one global batch gives the same prompts, the same noise
and the same trained timesteps on 1 or on 64 processes, and a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import numpy as np
import torch

from grpo.errors import ConfigError

# Independent random streams, so that e.g. changing the timestep fraction does not change the noise.
# New streams go at the end so that the existing ones keep their numbers (and their random draws).
INIT_NOISE, STEP_NOISE, TIMESTEPS, PROMPTS, EVAL_NOISE, WINDOW, MATCH_NOISE = range(7)
# Candidate selection: a candidate's starting and SDE noise, keyed by its pool index (prompt slot * pool + c),
# never by a sample index, so a kept candidate's full rollout does not depend on the slot it is kept in.
POOL_NOISE, POOL_STEP_NOISE = 7, 8


def rng_seed(seed: int, step: int, index: int, stream: int) -> int:
    """A well-mixed 63-bit seed for one (step, index, stream) triple."""
    return int(np.random.SeedSequence([seed, step, index, stream]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def generator(seed: int, step: int, index: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(rng_seed(seed, step, index, stream))


def prompts_for_step(num_prompts: int, prompts_per_step: int, seed: int, step: int) -> list[int]:
    """Prompt indices of step `step`: walk through seeded per-epoch permutations of the prompt file.

    Step t takes positions [t*P, (t+1)*P) of the endless sequence perm(epoch 0) ++ perm(epoch 1) ++ ...
    """
    out: list[int] = []
    pos = step * prompts_per_step
    while len(out) < prompts_per_step:
        epoch, offset = divmod(pos, num_prompts)
        perm = torch.randperm(num_prompts, generator=generator(seed, epoch, 0, PROMPTS)).tolist()
        take = min(prompts_per_step - len(out), num_prompts - offset)
        out.extend(perm[offset : offset + take])
        pos += take
    return out


def initial_noise(shape: tuple[int, ...], seed: int, step: int, index: int, stream: int = INIT_NOISE) -> torch.Tensor:
    """Float32 CPU noise for one trajectory; drawn on the CPU so every device type sees identical noise."""
    return torch.randn(shape, generator=generator(seed, step, index, stream))


def step_noise_generator(seed: int, step: int, sample_id: int, stream: int = STEP_NOISE) -> torch.Generator:
    """The generator that draws the SDE noise of every denoising step of one trajectory, in order."""
    return generator(seed, step, sample_id, stream)


# How nft/awm pick the schedule points they train (grpo's transitions always use "uniform"):
#   uniform           k distinct of all N points, index 0 (sigma 1, pure noise) included. DiffusionNFT@24af555
#                     scripts/train_nft_sd3.py:569, 810-815, 855-867 draws the same way per image (a permutation
#                     of its N = 10 points, the first int(N * 0.99) = 9 trained), here per micro-batch.
#   discrete          AWM's stratified draw: one point from each of k equal strata of [0, int(N * fraction)).
#   discrete_wo_init  the same over [1, int(N * fraction)): never index 0 nor the last N - int(N * fraction)
#                     points. advantage_weighted_matching@be51372 scripts/train_sd3_awm.py:1172-1180, 1197-1205
#                     (one draw per micro-batch, repeated over its images). Its README (:135) and geneval/ocr
#                     configs use discrete_wo_init (config/dgx_awm.py:88, 157, 228, 297), its pickscore configs
#                     discrete (:367, 437), all with timestep_fraction 0.9. N = 14, k = 6: discrete_wo_init draws
#                     one of {1}, {2,3}, {4,5}, ..., {10,11}; discrete one of {0,1}, {2,3}, ..., {10,11}.
POINT_DRAWS = ("uniform", "discrete", "discrete_wo_init")


def drawable_points(num_points: int, draw: str, fraction: float = 0.9) -> range:
    """The schedule points `draw` can pick from: all of them, or AWM's [0 or 1, int(num_points * fraction))."""
    if draw not in POINT_DRAWS:
        raise ConfigError(f"timestep draw: unknown value {draw!r}; use one of {POINT_DRAWS}")
    if draw == "uniform":
        return range(num_points)
    return range(0 if draw == "discrete" else 1, int(num_points * fraction))


def trained_steps(num_transitions: int, k: int, seed: int, step: int, chunk_id: int, *, draw: str = "uniform",
                  fraction: float = 0.9) -> list[int]:
    """The k of `num_transitions` transitions (nft/awm: schedule points) trained for one micro-batch, increasing.

    One draw per micro-batch (not per trajectory) keeps the update's batches identical to the rollout's, which is
    what makes the first-pass ratio exactly 1 at any batch size (see grpo/rollout.py). `draw` (POINT_DRAWS above):
    "uniform" (k distinct of all, unchanged numbers), or AWM's stratified "discrete" / "discrete_wo_init" over
    :func:`drawable_points`, which need k <= its length. Both take their numbers from the TIMESTEPS stream.
    """
    points = drawable_points(num_transitions, draw, fraction)
    g = generator(seed, step, chunk_id, TIMESTEPS)
    if draw == "uniform":
        perm = torch.randperm(num_transitions, generator=g)
        return sorted(perm[:k].tolist())
    if not 1 <= k <= len(points):
        raise ConfigError(f"timestep draw {draw}: {k} noise levels do not fit the {len(points)} schedule points "
                          f"{points.start}..{points.stop - 1} it draws from ({num_transitions} points, fraction "
                          f"{fraction}); train fewer noise levels or sample more steps")
    # As AWM: float32 linspace boundaries truncated to integers (k <= len(points) makes every stratum non-empty and
    # the draws distinct), then lower + floor(u * width) with u ~ U[0, 1).
    bounds = torch.linspace(points.start, points.stop, k + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    u = torch.rand(k, generator=g)
    return (lower + (u * (upper - lower)).long()).tolist()


def matching_noise(shape: tuple[int, ...], seed: int, step: int, sample_id: int, point: int, points: int) -> torch.Tensor:
    """nft/awm's forward-process noise of one sample at schedule point `point` (of `points`): one draw per pair, so a
    sample's noise at a point does not depend on which other points its chunk trains."""
    return torch.randn(shape, generator=generator(seed, step, sample_id * points + point, MATCH_NOISE))


def micro_batches(ids: list[int], size: int) -> list[list[int]]:
    """`ids` cut into consecutive micro-batches of `size` (the last one shorter when size does not divide)."""
    return [ids[i : i + size] for i in range(0, len(ids), size)]
