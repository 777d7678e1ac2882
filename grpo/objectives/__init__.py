"""The objectives, by the name `algorithm` gives them. Each module owns its settings section (named after it), its
checks, fixed targets, loss, planner terms and cost (grpo/objectives/base.py says what an objective provides).

A fourth objective: one module here with its Settings and class, one line below, one preset overlay, its tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.objectives.awm import AWM
from grpo.objectives.base import Models, Objective, PlanTerms
from grpo.objectives.grpo import GRPO
from grpo.objectives.nft import NFT

if TYPE_CHECKING:
    # RecipeConfig (grpo/config.py) is these settings plus the objectives' sections; it sits above the registry
    from grpo.settings import RecipeSettings as RecipeConfig

__all__ = ["OBJECTIVES", "Models", "Objective", "PlanTerms", "objective_of"]

OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (GRPO, NFT, AWM)}


def objective_of(cfg: RecipeConfig) -> Objective:
    """The objective `cfg.algorithm` names, with its settings (load_config has checked them)."""
    return OBJECTIVES[cfg.algorithm](cfg)
