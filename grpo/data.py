"""Which prompts and which random numbers each GRPO step uses, as pure functions of (seed, step, index).

Nothing here depends on the rank or the world size, so one global batch gives the same prompts, the same noise
and the same trained timesteps on 1 or on 64 processes, and a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import numpy as np
import torch

# Independent random streams, so that e.g. changing the timestep fraction does not change the noise.
# New streams go at the end so that the existing ones keep their numbers (and their random draws).
INIT_NOISE, STEP_NOISE, TIMESTEPS, PROMPTS, EVAL_NOISE, WINDOW, MATCH_NOISE = range(7)


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


def step_noise_generator(seed: int, step: int, sample_id: int) -> torch.Generator:
    """The generator that draws the SDE noise of every denoising step of one trajectory, in order."""
    return generator(seed, step, sample_id, STEP_NOISE)


def trained_steps(num_transitions: int, k: int, seed: int, step: int, chunk_id: int) -> list[int]:
    """The k of `num_transitions` transitions trained for one micro-batch, in increasing order.

    One draw per micro-batch (not per trajectory) keeps the update's batches identical to the rollout's, which is
    what makes the first-pass ratio exactly 1 at any batch size (see grpo/rollout.py).
    """
    perm = torch.randperm(num_transitions, generator=generator(seed, step, chunk_id, TIMESTEPS))
    return sorted(perm[:k].tolist())


def matching_noise(shape: tuple[int, ...], seed: int, step: int, sample_id: int, point: int, points: int) -> torch.Tensor:
    """nft/awm's forward-process noise of one sample at schedule point `point` (of `points`): one draw per pair, so a
    sample's noise at a point does not depend on which other points its chunk trains."""
    return torch.randn(shape, generator=generator(seed, step, sample_id * points + point, MATCH_NOISE))


def micro_batches(ids: list[int], size: int) -> list[list[int]]:
    """`ids` cut into consecutive micro-batches of `size` (the last one shorter when size does not divide)."""
    return [ids[i : i + size] for i in range(0, len(ids), size)]
