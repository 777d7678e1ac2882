"""BranchGRPO's tree rollouts: the shape of one prompt's tree, and its per-depth advantages.

Source: BranchGRPO@19fbb9f fastvideo/train_branchgrpo_flux.py (split steps :150-167, tree rollout :354-542, reward
fusion :545-652, per-depth advantages :655-689, edges :1193-1225); paper arXiv 2509.06040.

A group of G = factor^len(splits) samples is one tree: they share their initial noise (the root), every node is
advanced by one SDE step, and at a split step each node gets `factor` children with their own noise. The samples are
the leaves, in order, so the node holding sample position p after `d` steps is p // span(d): the samples under one
node are a contiguous block. The rollout computes each step once per node, not once per sample: that is the saving.

Noise stays a pure function of (seed, step, sample index): a node's SDE noise is drawn from the generator of its
first sample, the only one that draws while that node lives, so siblings share their prefix exactly and the tree
does not depend on which rank holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Tree", "depth_advantages"]


@dataclass(frozen=True)
class Tree:
    splits: tuple[int, ...]  # steps whose nodes branch, increasing, in [0, num_steps - 2]
    factor: int  # children per node at a split (BranchGRPO: 2)
    noise_scale: float  # the std multiplier of split steps, at sampling and in the log-prob
    num_steps: int

    @classmethod
    def of(cls, sampling) -> "Tree | None":
        """The tree of a sampling config (sampling.branch), or None."""
        b = sampling.branch
        return None if b is None else cls(tuple(b.splits), b.factor, b.noise_scale, sampling.num_steps)

    @property
    def leaves(self) -> int:
        return self.factor ** len(self.splits)

    def nodes(self, depth: int) -> int:
        """Distinct states x_depth in one tree (after `depth` steps)."""
        return self.factor ** sum(s < depth for s in self.splits)

    def span(self, depth: int) -> int:
        """Samples under one node at `depth`."""
        return self.leaves // self.nodes(depth)

    def heads(self, batch: int, depth: int) -> Tensor:
        """Rows of a batch of whole trees that hold a distinct state at `depth`: each node's first sample."""
        return torch.arange(0, batch, self.span(depth))

    def owner(self, batch: int, depth: int) -> Tensor:
        """For every row, the index into heads(batch, depth) of its node."""
        return torch.arange(batch) // self.span(depth)

    def std_scale(self, step: int) -> float:
        return self.noise_scale if step in self.splits else 1.0

    def trained(self) -> list[int]:
        """The transitions with an advantage: every edge into a depth with more than one node, the last (never
        decoded) transition excepted. BranchGRPO trains every edge; a depth with one node has A = 0."""
        return [j for j in range(self.num_steps - 1) if self.nodes(j + 1) > 1]

    def forwards_per_image(self, trained: list[int], per_trained: int) -> float:
        """Transformer forward-equivalents per sample of one step: one rollout call per node and step, and
        `per_trained` per node at each trained transition (a forward and a backward = 3)."""
        return self.rollout_calls_per_image() + self.trained_forwards_per_image(trained, per_trained)

    def rollout_calls_per_image(self) -> float:
        """The rollout's share: one call per node and step, shared by the leaves under it."""
        return sum(self.nodes(d) for d in range(self.num_steps)) / self.leaves

    def trained_forwards_per_image(self, trained: list[int], per_trained: int) -> float:
        """The update's share: `per_trained` per node at each trained transition, shared by the leaves under it."""
        return per_trained * sum(self.nodes(j) for j in trained) / self.leaves


def depth_advantages(rewards: Tensor, tree: Tree, clip: float | None,
                     eps: float = 1e-8) -> tuple[Tensor, dict[str, Tensor]]:
    """BranchGRPO's advantages: per tree and per depth, over the nodes at that depth.

    A node's reward is the mean of the rewards of the samples under it (the source's default fusion; its softmax
    path weighting is not offered). At each depth d: A = (R - mean_d) / (std_d + eps), std unbiased, over the
    tree's nodes at d; A = 0 where a depth has one node or std_d < 1e-6. The edge into a node at d trains with the
    node's A, clamped to [-clip, clip] (the source's adv_clip_max, applied in its loss).

    Args:
        rewards: [N] rewards in sample order; samples t*G .. t*G + G - 1 are tree t's leaves.
        tree: its shape.
        clip: the clamp, or None.
        eps: added to std_d (BranchGRPO: 1e-8, train_branchgrpo_flux.py:680; the presets' advantage.eps).

    Returns:
        advantages: float32 [N, num_steps + 1]; column d holds each sample's ancestor's A at depth d.
        stats: detached 0-d tensors: zero_std_frac (trees whose leaves all score the same),
            reward_std_in_group_mean (mean unbiased std of the leaves' rewards per tree).
    """
    r = rewards.float().reshape(-1, tree.leaves)
    columns = []
    for depth in range(tree.num_steps + 1):
        n, span = tree.nodes(depth), tree.span(depth)
        if n == 1:
            columns.append(torch.zeros_like(r))
            continue
        node_r = r.reshape(r.shape[0], n, span).mean(dim=2)
        std = node_r.std(dim=1, keepdim=True)
        a = (node_r - node_r.mean(dim=1, keepdim=True)) / (std + eps)
        a = torch.where(std < 1e-6, torch.zeros_like(a), a)
        columns.append(a.repeat_interleave(span, dim=1))
    adv = torch.stack(columns, dim=-1).reshape(-1, tree.num_steps + 1)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    leaf_std = r.std(dim=1)
    stats = {"zero_std_frac": (r.amax(dim=1) == r.amin(dim=1)).float().mean(),
             "reward_std_in_group_mean": leaf_std.mean()}
    return adv, stats
