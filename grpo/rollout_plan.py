"""The rollout plan of a run: which transitions (grpo) or schedule points (nft, awm) each micro-batch trains, what
a step costs in transformer forward-equivalents, and how rewards become advantages for that shape of rollout.

One plan serves the recipe (what to train, the cost it logs), the memory planner (tools/plan.py) and
benchmarks/time_to_reward.py, so there is one cost model (with the objective's extra update blocks). Three shapes:
    window   an SDE window (MixGRPO, Flow-GRPO-Fast): its steps are trained, the rest are ODE (or a dpm2 tail)
    tree     BranchGRPO's trees: every edge with an advantage is trained; a model call per node
    share    otherwise: K of the objective's points, drawn per micro-batch as a pure function of (seed, step, first
             sample), so the update's micro-batches are the rollout's and the first-pass ratio stays exactly 1
Candidate selection (grpo/candidates.py) adds its preview to any shape but a tree: pool / group_size candidates of
preview_steps calls per trained image. True CFG (sampling.true_cfg) makes every guided velocity two calls: the
rollout's and the preview's always, the update's where it trains the guided velocity (grpo; nft/awm with train: guided).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.advantages import group_advantages, per_reward_advantages
from grpo.config import RecipeConfig
from grpo.data import trained_steps
from grpo.objectives import Objective, objective_of
from grpo.rewards.mixing import mix
from grpo.solvers import tail_points
from grpo.tree import Tree, depth_advantages
from grpo.windows import rollout_window


@dataclass
class RolloutPlan:
    cfg: RecipeConfig
    objective: Objective
    tree: Tree | None

    @classmethod
    def of(cls, cfg: RecipeConfig) -> "RolloutPlan":
        return cls(cfg, objective_of(cfg), Tree.of(cfg.sampling))

    # ------------------------------------------------------------------------------------------ what is trained
    def window(self, step: int, first_sample: int = 0) -> range | None:
        """The SDE window of step `step` for the rollout micro-batch starting at global sample `first_sample`
        (grpo/windows.py; only a window per group reads it), or None: every step SDE (or ODE with eta 0)."""
        return rollout_window(self.cfg.sampling, self.cfg.seed, step, first_sample)

    @property
    def trained_per_trajectory(self) -> int:
        """K, fixed for a run (DeepSpeed's gradient accumulation needs it): the backward passes per trajectory."""
        s = self.cfg.sampling
        if self.tree is not None:
            return len(self.tree.trained())
        if s.window is not None:
            return s.window.size
        return self.objective.trained_per_trajectory(s.num_steps)

    def trained(self, step: int, window: range | None, first_id: int) -> list[int]:
        """The points one micro-batch trains, increasing; `first_id` is the global index of its first sample."""
        if window is not None:
            return list(window)
        if self.tree is not None:
            return self.tree.trained()
        points = self.objective.points(self.cfg.sampling.num_steps)
        return trained_steps(points, self.trained_per_trajectory, self.cfg.seed, step, first_id,
                             draw=self.objective.point_draw)

    # ------------------------------------------------------------------------------------------------- cost
    def rollout_calls(self, window: range | None) -> int:
        """Transformer calls of one trajectory's rollout: the schedule's steps, or, with a dpm2 tail, the grid up to
        the window's end (nft/awm: the first step) and then the tail's solver steps."""
        s = self.cfg.sampling
        if s.tail != "dpm2":
            return s.num_steps
        last = window[-1] if window is not None else 0
        return last + tail_points(s.num_steps, last, s.compress_ratio)

    def forwards_per_image(self, step: int, extra_blocks: int | None = None) -> float:
        """Transformer forward-equivalents per image of step `step`: the rollout's calls, then per trained point
        the objective's (a forward and a backward = 3, +1 per no-grad forward of its fixed targets), then the
        objective's extra update blocks (grpo's replay block): `extra_blocks` of them, as many as ran (the recipe),
        or by default as many as the objective expects (the planner, the benchmarks). A tree pays once per node,
        shared by the images under it."""
        return sum(self.phase_forwards(step, extra_blocks).values())

    def phase_forwards(self, step: int, extra_blocks: int | None = None) -> dict[str, float]:
        """:meth:`forwards_per_image` split by the step's timed phases (the recipe's clock): "rollout" (candidate
        preview and the trajectories' sampling) and "update" (the fixed targets' no-grad forwards: reference and
        lagging policy; the trained points' forward and backward; the extra blocks). What grpo.perf turns into
        FLOPs per phase."""
        # True CFG: a guided velocity is its two branches, two calls on the same rows
        sampled, trained = self.cfg.sampling.sampled_calls, self.cfg.sampling.trained_calls
        per_point = self.objective.forwards_per_point()
        if self.tree is not None:  # grpo's: its rollout and its update call the same (guided) velocity
            rollout = trained * self.tree.rollout_calls_per_image()
            update = trained * self.tree.trained_forwards_per_image(self.tree.trained(), per_point)
        else:
            rollout = sampled * (self.preview_calls() + self.rollout_calls(self.window(step)))
            update = trained * self.trained_per_trajectory * per_point
        return {"rollout": rollout, "update": update + trained * self.objective.extra_forwards_per_image(step,
                                                                                                      extra_blocks)}

    def preview_calls(self) -> float:
        """Candidate selection's preview per trained image: pool / group_size candidates of preview_steps calls."""
        s = self.cfg.sampling
        if s.candidates is None:
            return 0
        return s.candidates.pool * s.candidates.preview_steps / s.group_size

    # ----------------------------------------------------------------------------------------------- advantages
    def advantages(self, components: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """From the gathered [N, R] scores of the R rewards and their weights: [N] group advantages, or with a tree
        [N, num_steps + 1] (column d for the edges into depth d)."""
        a = self.cfg.advantage
        groups = torch.arange(len(components), device=components.device) // self.cfg.sampling.group_size
        if a.per_reward:  # MixGRPO: the weighted sum of each reward's in-group z-score is the advantage
            adv, stats = per_reward_advantages(components, weights, groups, eps=a.eps, clip=a.clip)
            return adv, {k: float(v) for k, v in stats.items()}
        rewards = mix(components, weights)
        if self.tree is not None:
            adv, stats = depth_advantages(rewards, self.tree, clip=a.clip, eps=a.eps)
        else:
            adv, stats = group_advantages(rewards, groups, std_scope=a.std_scope, clip=a.clip, eps=a.eps)
        return adv, {k: float(v) for k, v in stats.items()}
