"""The best held-out eval of a run, and the collapse alarm: what the run keeps of its evals.

Every held-out eval of a run draws the very same images' starting noise (grpo/eval.py), so two evals are paired image
by image. The run keeps the best one so far (:class:`Best`: its step, its per-image rewards, their mean and standard
error) and the recipe exports that eval's weights to ``output_dir/best/`` beside ``final/``:

* a new best is an eval whose mean is strictly higher than the best's; the first eval of a run (step 0: the base
  model) is always one, so once an eval ran ``best/`` exists;
* the alarm compares an eval with the best before it, pairwise: the mean of the per-image differences (now - best)
  and its standard error (:func:`paired`, what ``python -m tools.compare`` prints); it fires when the
  difference is below minus ``logging.collapse_alarm.sigmas`` of those errors (:func:`below_best`).

The state travels in every checkpoint (rank 0's file, ``best/*`` tensors; it is the same on every rank: each gathers
every image's reward), so a resumed run takes the same decisions as an uninterrupted one. It holds a digest of what
the eval is (:func:`definition`): a run resumed with another held-out set, eval_seeds, eval steps or eval
guidance compares nothing with the old best and starts afresh, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from grpo.settings import RecipeSettings

log = logging.getLogger(__name__)


def paired(before: list[float], after: list[float]) -> dict:
    """Mean of after - before over the pairs, its standard error, t (0 for no spread) and the share of pairs up."""
    d = [b - a for a, b in zip(before, after, strict=True)]
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    return {"mean": mean, "se": se, "t": mean / se if se > 0 else 0.0, "higher": sum(x > 0 for x in d) / n, "n": n}


def definition(prompts: list[str], cfg: RecipeSettings) -> str:
    """What makes two evals' images the same images, their rewards comparable image by image: the held-out prompts,
    logging.eval_seeds, the eval's steps and guidance."""
    s = cfg.sampling
    return json.dumps({"prompts": list(prompts), "eval_seeds": cfg.logging.eval_seeds,
                       "eval_num_steps": s.eval_num_steps or s.num_steps, "eval_cfg_scale": s.eval_cfg_scale},
                      sort_keys=True)


@dataclass(frozen=True)
class HeldOut:
    """One held-out eval: its step and the weighted reward of every eval image (image j: the same noise every eval)."""

    step: int
    per_image: torch.Tensor  # [n] float32 on the CPU

    @property
    def mean(self) -> float:
        return self.per_image.mean().item()  # as the eval logs it (eval/reward_mean)

    @property
    def se(self) -> float:
        """Standard error of the mean over the images (n - 1 in the variance); 0 for one image."""
        n = self.per_image.numel()
        return (self.per_image.double().std() / n ** 0.5).item() if n > 1 else 0.0


@dataclass(frozen=True)
class Drop:
    """An eval against the best before it, image by image: `mean` of now - best, its standard error, and `sigmas`,
    how many of them the eval lies below the best (negative: above it)."""

    mean: float
    se: float

    @property
    def sigmas(self) -> float:
        if self.se > 0:
            return -self.mean / self.se
        return 0.0 if self.mean == 0 else (float("inf") if self.mean < 0 else float("-inf"))


def below_best(drop: Drop, sigmas: float) -> bool:
    """The collapse alarm: the eval is below the best by more than `sigmas` paired standard errors."""
    return drop.mean < 0 and drop.sigmas > sigmas


class Best:
    """The best held-out eval of the run so far (None before the first), as a checkpoint part (grpo/checkpoint/)."""

    replicated: ClassVar[bool] = True  # every rank holds the same: rank 0's file keeps it

    def __init__(self, definition: str):
        self.definition = definition  # definition() of this run's evals
        self.held: HeldOut | None = None

    def drop(self, now: HeldOut) -> Drop | None:
        """`now` against the best (None before the first eval)."""
        if self.held is None:
            return None
        p = paired(self.held.per_image.tolist(), now.per_image.tolist())
        return Drop(p["mean"], p["se"])

    def observe(self, now: HeldOut) -> bool:
        """Keep `now` when it is the first eval or its mean is strictly higher than the best's; True when kept."""
        if self.held is not None and not now.mean > self.held.mean:
            return False
        self.held = now
        return True

    def summary(self) -> dict:
        """What best/best.json says about the eval whose weights it holds."""
        h = self.held
        return {"step": h.step, "reward_mean": h.mean, "reward_se": h.se, "images": h.per_image.numel(),
                "se": "of the mean over the eval images, n - 1 in the variance"}

    # ------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        if self.held is None:
            return {}, {}
        return {"best/step": torch.tensor([self.held.step], dtype=torch.int64),
                "best/per_image": self.held.per_image.contiguous(),
                "best/definition": _digest(self.definition)}, {}

    def load_state_dict(self, saved) -> None:
        tensors = saved.rank0()
        if "best/step" not in tensors:  # no eval before that checkpoint, or written before the best was kept
            return
        if not torch.equal(tensors["best/definition"], _digest(self.definition)):
            if saved.rank == 0:
                log.warning("the held-out eval changed since the checkpoint (prompts, logging.eval_seeds, "
                            "sampling.eval_num_steps or eval_cfg_scale): its best (step %d) is not comparable; the "
                            "best starts afresh at the next eval", int(tensors["best/step"].item()))
            return
        self.held = HeldOut(int(tensors["best/step"].item()), tensors["best/per_image"].clone())


def _digest(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8)
