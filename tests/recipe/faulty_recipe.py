"""The recipe of the fault tests: recipes/flux_grpo.py itself, with NaN rewards or losses injected where a real fault
would enter, as GRPO_FAULT_INJECT asks. Launched as any copied recipe is: RECIPE=tests/recipe/faulty_recipe.py
bash launch/run.sh CONFIG ... (tests/recipe/test_faults.py).

    GRPO_FAULT_INJECT="nan_reward@2,nan_loss@3:1"   this rank's rewards of step 2 (every rank), and its losses of
                                                    step 3 (rank 1 only), turned into NaN

nan_reward: a rank's own reward scores of a step, before they are gathered (a reward model that returned NaN);
nan_loss: each loss the objective returns on that rank and step, before the recipe's non-finite guard (a forward that
overflowed). Everything after that is the real recipe's: the skip, the counts, the health line, the exit code.
"""

from __future__ import annotations

import logging
import os

import torch

from grpo.distributed import end_process
from tools._recipe import load_recipe

FAULT_ENV = "GRPO_FAULT_INJECT"
log = logging.getLogger("faulty_recipe")
real = load_recipe()


def faults(spec: str | None = None) -> list[tuple[str, int, int | None]]:
    """(kind, step, rank or None for every rank) of each fault a GRPO_FAULT_INJECT spec asks for."""
    spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        out.append((kind, int(step), int(rank) if rank else None))
    return out


def inject(kind: str, step: int, rank: int, x: torch.Tensor, spec: str | None = None) -> torch.Tensor:
    """`x` filled with NaN if the spec (default: GRPO_FAULT_INJECT) asks for `kind` at this step on this rank, else
    `x` itself."""
    for k, s, r in faults(spec):
        if k == kind and s == step and r in (None, rank):
            log.warning("fault injection: %s at step %d on rank %d", kind, step, rank)
            return x + float("nan")  # keeps the autograd graph, so backward still runs
    return x


class FluxGRPORecipe(real.FluxGRPORecipe):
    """The real recipe; its step's reward scores and the objective's losses pass through :func:`inject`."""

    scoring: int | None = None  # the step whose rewards score() is computing, else None (a preview, an eval)
    training: int = -1  # the step running

    def setup(self) -> None:
        super().setup()
        loss = self.objective.loss

        def poisoned(models, c, j, adv):
            value, stats = loss(models, c, j, adv)
            return inject("nan_loss", self.training, self.rank, value), stats

        self.objective.loss = poisoned  # this instance's: the recipe calls self.objective.loss

    def step(self, step: int, phase=None):
        self.training = step
        return super().step(step, phase)

    def score(self, chunks, step: int):
        self.scoring = step
        try:
            return super().score(chunks, step)
        finally:
            self.scoring = None

    def _rewards_of(self, batches):
        local, ids = super()._rewards_of(batches)
        if self.scoring is not None:  # this rank's scores of the step, before they are gathered
            local = inject("nan_reward", self.scoring, self.rank, local)
        return local, ids


if __name__ == "__main__":
    end_process(real.main(recipe_class=FluxGRPORecipe))
