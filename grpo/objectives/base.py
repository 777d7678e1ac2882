"""What every objective provides, and what the recipe hands it to compute with.

An objective (grpo/objectives/grpo.py, nft.py, awm.py) owns its settings section (named after it), what it needs
from the rollout, the fixed targets it computes without gradients before the update, its loss at one trained point,
its start-up checks, its planner terms and its compute per trained point; and, with no-op defaults, what it adds
beyond the on-policy update: extra update blocks after the on-policy ones and their cost, what it remembers after a
step, its own state in checkpoints (grpo's trajectory replay, grpo/replay.py, is all four). The recipe holds one
objective and calls these; it never asks which objective it is (the registry, grpo/objectives/__init__.py, maps
`algorithm` to a class).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager

import torch

from grpo import health

if TYPE_CHECKING:
    # RecipeConfig (grpo/config.py) is these settings plus the objectives' sections; it sits above the registry
    from grpo.settings import RecipeSettings as RecipeConfig
    from grpo.step import Chunk


@dataclass
class Models:
    """What an objective computes with. `inference(reference=False)` is a context yielding a no-grad forward
    module: the policy (its lagging weights inside `lagging.applied()`), or with reference=True the frozen initial
    model (LoRA: the policy with its adapters off)."""

    engine: Any  # the trained ZeRO-3 engine: the update's differentiable forwards
    sampler: Any  # grpo.rollout.FluxSampler: the schedule, transitions, velocities
    lagging: Any  # grpo.ema.ShardedEMA of the lagging policy, or None
    inference: Callable[..., ContextManager[torch.nn.Module]]
    prompts: Any = None  # grpo.prompts.PromptCache of the train set: for samples an objective brings itself (replay)
    layout: Any = None  # grpo.layout.Layout: the run's per-rank sizes


@dataclass(frozen=True)
class PlanTerms:
    """What an objective adds to the memory planner (tools/plan.py)."""

    lagging_average: bool  # a sharded fp32 copy of the trained weights (the lagging policy)
    latents_per_point: int  # float32 latents kept per sample and trained point until the update
    reference_phase: bool  # a no-grad pass before the update (reference or lagging forwards)
    # trajectories kept across steps on every rank (host memory; an extra block takes its share to the device), and
    # the transitions kept of each: float32 latents x_0 .. x_L and L log-probs an entry (grpo's replay buffer)
    kept_trajectories: int = 0
    kept_transitions: int = 0


@dataclass
class ExtraBlocks:
    """Update blocks an objective trains after the on-policy ones, each a whole block of micro-batches (one optimizer
    step) on every rank, each chunk with its own advantages and weight (grpo: the replay block)."""

    name: str = ""  # their loss statistics are logged apart from the on-policy blocks', as "<name>/loss", ...
    chunks: list = field(default_factory=list)  # this rank's micro-batches (grpo.step.Chunk); none: no extra block
    stats: dict[str, float] = field(default_factory=dict)  # logged with the step, also when no block runs


class Objective:
    """The part of a step that differs between objectives. Subclasses set the class attributes and override
    `fixed_targets` and `loss`; the defaults below are the common case."""

    name: ClassVar[str]
    Settings: ClassVar[type]
    help: ClassVar[str]  # one line for --help: what the section is
    # True: trains the rollout's SDE transitions i -> i+1 through their log-probs (needs eta > 0; SDE windows and
    # trees select them); False: trains the clean samples, noised at points of the rollout's schedule.
    trains_transitions: ClassVar[bool]

    def __init__(self, cfg: RecipeConfig) -> None:
        self.cfg = cfg
        self.settings = getattr(cfg, self.name)

    # -------------------------------------------------------------------------------------- start-up checks
    @classmethod
    def check(cls, cfg: RecipeConfig) -> None:
        """One-line ConfigErrors for this objective's settings and what they need of the rest (grpo/checks.py)."""

    # ------------------------------------------------------------------------------------------- what it needs
    @property
    def kl_coef(self) -> float:
        """Weight of the KL term to the initial model; 0 = no reference model at all."""
        return self.settings.kl_coef

    uses_lagging: ClassVar[bool] = False  # keeps a lagging copy of the policy (grpo.ema.ShardedEMA)

    def rollout_records(self) -> dict[str, bool]:
        """What the rollout records beyond latents and log-probs, as keywords of grpo.rollout.FluxSampler.sample
        (grpo with GRPO-Guard: each step's SDE mean)."""
        return {}

    def points(self, num_steps: int) -> int:
        """The trainable points of a trajectory: transitions, or schedule points."""
        raise NotImplementedError

    def trained_per_trajectory(self, num_steps: int) -> int:
        """K drawn from `points` when no window or tree chooses them."""
        raise NotImplementedError

    # How a random share picks its points (grpo.data.POINT_DRAWS): "uniform" = k distinct of all of them
    point_draw: str = "uniform"

    def forwards_per_point(self) -> int:
        """Transformer forward-equivalents per trained point and image: a forward and a backward (3), +1 for each
        no-grad forward of its fixed targets."""
        return 3 + (self.kl_coef > 0)

    def rollout_weights(self, models: Models) -> ContextManager:
        """The weights the rollout samples with (the policy's, unless the objective says otherwise)."""
        return contextlib.nullcontext()

    def lagging_decay(self, optimizer_steps: int) -> float:
        raise NotImplementedError

    def plan_terms(self) -> PlanTerms:
        return PlanTerms(lagging_average=False, latents_per_point=0, reference_phase=self.kl_coef > 0)

    def extra_forwards_per_image(self, step: int, blocks: int | None = None) -> float:
        """Forward-equivalents per image of step `step` that its extra update blocks cost (the rollout plan adds
        them): `blocks` of them when given (the recipe: those that ran), else as many as the objective expects to
        run (the planner, the benchmarks). Default: none."""
        return 0.0

    def stats_per_point(self) -> tuple[str, ...]:
        """The loss stats also logged per trained point j, as "<name>/tJJ" (grpo with Flow-DPPO: its masked share).
        Default: none."""
        return ()

    def health_line(self, step: int, stats: dict[str, float]) -> str:
        """The step's health line (grpo.health.health_line), with the warnings this objective's stats call for."""
        return health.health_line(step, stats)

    # ----------------------------------------------------------------------------------------- the update
    @torch.no_grad()
    def fixed_targets(self, models: Models, chunks: list[Chunk], step: int) -> None:
        """What the update compares against, computed sharded without gradients, into each chunk."""

    def loss(self, models: Models, c: Chunk, j: int, adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The loss of chunk `c` at trained point `j` with the chunk's advantages, and its detached stats."""
        raise NotImplementedError

    def extra_blocks(self, models: Models, step: int) -> ExtraBlocks:
        """Collective: update blocks to train after the on-policy ones, drawn with the weights those left (so their
        first pass stays exactly on-policy), their fixed targets filled in. Default: none."""
        return ExtraBlocks()

    # ------------------------------------------------------------------------------------- across the steps
    def scored(self, models: Models, step: int, components: torch.Tensor, weights: torch.Tensor) -> dict[str, float]:
        """After the step's rewards are gathered ([N, R] per-reward scores by global sample index, the same on every
        rank, and their [R] weights), before its fixed targets: what the objective takes from them (grpo with GARDO:
        the gate, and the reference refreshed when due). Returns stats logged with the step. Default: nothing."""
        return {}

    def remember(self, models: Models, step: int, chunks: list[Chunk], advantages: torch.Tensor) -> None:
        """After the step's update, whether it ran or was skipped: what later steps use, from its chunks and the
        gathered advantages (collective where the objective gathers). Default: nothing."""

    # A checkpoint holds the state once, in rank 0's file, and every rank loads that (grpo/checkpoint/): what an
    # objective remembers is the same on every rank (computed from gathered values)
    replicated: ClassVar[bool] = True

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """What a checkpoint keeps of the objective: safetensors tensors (names prefixed by the objective's own
        part, e.g. "replay/") and string metadata. Default: nothing."""
        return {}, {}

    def load_state_dict(self, saved: Any) -> None:
        """Restore from a checkpoint (a grpo.checkpoint.Saved: its rank files; the state is in rank 0's), which may
        predate the objective's state. Default: nothing to restore."""
