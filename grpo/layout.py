"""Which global samples each rank holds, and the per-rank batch sizes, derived from the global batch and the world size.

Presets state global quantities (prompts per step, group size); everything per rank is derived here, so one preset
runs on 1, 2, 8 or 64 processes and trains the same samples in each optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config import RecipeConfig
from grpo.errors import ConfigError
from grpo.rollout_plan import RolloutPlan


@dataclass(frozen=True)
class Layout:
    """Per-rank sizes derived from the global batch and the world size.

    Samples of a step are numbered 0..N-1, prompt-major (sample s belongs to prompt slot s // G). They are cut into
    `updates_per_step` contiguous update blocks; each block is split evenly and contiguously over the ranks. So the
    samples trained by optimizer step u are the same on any world size, which makes a step world-size invariant.
    """

    world_size: int
    samples_per_step: int  # N = prompts_per_step * group_size
    samples_per_rank: int
    samples_per_rank_per_update: int
    micro_batch_size: int
    rollout_micro_batch_size: int  # a multiple of micro_batch_size
    micro_batches_per_update: int
    trained_transitions: int  # K per trajectory
    grad_accum_steps: int  # backward passes per optimizer step per rank (micro-batches x K)
    # Candidate selection's preview (sampling.candidates): P * pool candidates, each rank a contiguous share cut
    # into whole rollout micro-batches, so a preview batch holds the same candidates on any world size. 0 = none.
    pool_per_step: int = 0

    def rank_sample_ids(self, rank: int) -> list[int]:
        """Global sample indices held by `rank`, in rollout order."""
        per_update_global = self.samples_per_step // self.updates_per_step
        n = self.samples_per_rank_per_update
        return [
            u * per_update_global + rank * n + i for u in range(self.updates_per_step) for i in range(n)
        ]

    def rank_pool_ids(self, rank: int) -> list[int]:
        """Pool indices (prompt slot * pool + candidate) this rank previews."""
        n = self.pool_per_step // self.world_size
        return list(range(rank * n, (rank + 1) * n))

    @property
    def updates_per_step(self) -> int:
        return self.samples_per_rank // self.samples_per_rank_per_update

    @property
    def ds_train_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size


def valid_world_sizes(cfg: RecipeConfig) -> list[int]:
    """Every process count whose layout the batch arithmetic accepts (divisors of the global batch): what a resumed
    run, whose batch is fixed by its checkpoint, may be relaunched on."""
    n = cfg.batch.prompts_per_step * cfg.sampling.group_size
    sizes = []
    for w in (d for d in range(1, n + 1) if n % d == 0):
        try:
            derive_layout(cfg, w)
        except ConfigError:
            continue
        sizes.append(w)
    return sizes


def derive_layout(cfg: RecipeConfig, world_size: int) -> Layout:
    """Check the batch arithmetic for `world_size` processes and return the per-rank layout (`cfg` is validated by
    load_config)."""
    b, s = cfg.batch, cfg.sampling
    n = b.prompts_per_step * s.group_size
    if n % world_size:
        raise ConfigError(
            f"batch.prompts_per_step: {b.prompts_per_step} prompts x group_size {s.group_size} = {n} images do not "
            f"split over {world_size} processes; make prompts_per_step*group_size a multiple of {world_size}"
        )
    per_rank = n // world_size
    unit = b.micro_batch_size * b.updates_per_step
    if per_rank % unit:
        raise ConfigError(
            f"batch.micro_batch_size: {per_rank} images per process do not split into {b.updates_per_step} update(s) "
            f"of micro-batches of {b.micro_batch_size}; choose micro_batch_size*updates_per_step dividing {per_rank}"
        )
    rollout = b.rollout_micro_batch
    if rollout % b.micro_batch_size or per_rank % rollout:
        raise ConfigError(
            f"batch.rollout_micro_batch_size: {rollout} must be a multiple of micro_batch_size {b.micro_batch_size} "
            f"that divides the {per_rank} images per process; e.g. {b.micro_batch_size} or null"
        )
    if s.branch is not None and (per_rank // b.updates_per_step) % s.group_size + b.micro_batch_size % s.group_size:
        raise ConfigError(
            f"batch.micro_batch_size: {b.micro_batch_size}; tree rollouts need whole trees in every micro-batch and "
            f"update block; make micro_batch_size and the {per_rank // b.updates_per_step} images per process and "
            f"update multiples of group_size {s.group_size}"
        )
    pool = b.prompts_per_step * s.candidates.pool if s.candidates is not None else 0
    if pool % (world_size * rollout):
        raise ConfigError(
            f"sampling.candidates.pool: {b.prompts_per_step} prompts x pool {s.candidates.pool} = {pool} candidates "
            f"do not split over {world_size} processes into rollout micro-batches of {rollout}; make "
            f"prompts_per_step*pool a multiple of {world_size * rollout}"
        )
    # Backward passes per trajectory, fixed for a run as DeepSpeed's gradient accumulation needs.
    k = RolloutPlan.of(cfg).trained_per_trajectory
    per_update = per_rank // b.updates_per_step
    micro_per_update = per_update // b.micro_batch_size
    return Layout(
        world_size=world_size,
        samples_per_step=n,
        samples_per_rank=per_rank,
        samples_per_rank_per_update=per_update,
        micro_batch_size=b.micro_batch_size,
        rollout_micro_batch_size=rollout,
        micro_batches_per_update=micro_per_update,
        trained_transitions=k,
        grad_accum_steps=micro_per_update * k,
        pool_per_step=pool,
    )
