"""What every objective provides, and what the recipe hands it to compute with.

An objective (grpo/objectives/grpo.py, nft.py, awm.py) owns its settings section (named after it), what it needs
from the rollout, the fixed targets it computes without gradients before the update, its loss at one trained point,
its start-up checks, its planner terms and its compute per trained point. The recipe holds one objective and calls
these; it never asks which objective it is (the registry, grpo/objectives/__init__.py, maps `algorithm` to a class).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager

import torch

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


@dataclass(frozen=True)
class PlanTerms:
    """What an objective adds to the memory planner (tools/plan.py)."""

    lagging_average: bool  # a sharded fp32 copy of the trained weights (the lagging policy)
    latents_per_point: int  # float32 latents kept per sample and trained point until the update
    reference_phase: bool  # a no-grad pass before the update (reference or lagging forwards)


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
    keep_means: bool = False  # the rollout records each step's SDE mean
    ratio_clip: float | None = None  # the PPO clip whose first-pass ratio the health line watches
    replay: Any = None  # grpo.replay.ReplaySettings: OP-GRPO's trajectory replay (grpo only); None = off

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

    # ----------------------------------------------------------------------------------------- the update
    @torch.no_grad()
    def fixed_targets(self, models: Models, chunks: list[Chunk], step: int) -> None:
        """What the update compares against, computed sharded without gradients, into each chunk."""

    def loss(self, models: Models, c: Chunk, j: int, adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The loss of chunk `c` at trained point `j` with the chunk's advantages, and its detached stats."""
        raise NotImplementedError
