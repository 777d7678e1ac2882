"""The data one GRPO step passes from phase to phase, typed: rollout chunks, update statistics, the step's result.

A chunk is one update micro-batch of a rank's rollout: the unit of everything after sampling (reward, reference,
update), so that the update recomputes each trained transition on exactly the batch that produced it (the first-pass
ratio is then exactly 1, see grpo/rollout.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from grpo.flux import Conditioning
from grpo.rollout import Trajectories


@dataclass
class Chunk:
    """One update micro-batch of this rank's trajectories."""

    ids: list[int]  # global sample indices (prompt-major: sample s belongs to prompt slot s // group_size)
    prompt_idx: list[int]  # row of each sample's prompt in the prompt cache
    cond: Conditioning
    traj: Trajectories
    trained: list[int]  # the transitions the update trains, drawn once per chunk (grpo/data.trained_steps)
    images: torch.Tensor | None = None  # [B, 3, H, W] in [0, 1], decoded after the rollout's weights are released
    reference: dict[int, torch.Tensor] = field(default_factory=dict)  # transition -> reference SDE mean (KL only)


@dataclass
class UpdateStats:
    """What an update phase logs. Means are over this rank's backward passes, then over ranks.

    Fields left None are not logged: a step whose update was skipped for a non-finite reward logs only
    skipped_updates.
    """

    loss: float | None = None
    kl: float | None = None
    clip_frac: float | None = None
    approx_kl: float | None = None
    ratio_mean: float | None = None
    nonfinite_loss: float | None = None  # backward passes with a non-finite loss, summed over ranks
    ratio_max_dev: float | None = None  # max |ratio - 1| of the first (exactly on-policy) update block, over ranks
    grad_norm: float | None = None
    lr: float | None = None
    skipped_updates: float = 0.0  # optimizer steps DeepSpeed skipped (non-finite gradient) or never took
    nonfinite_grad: float | None = None

    _NAMES = {"nonfinite_loss": "nonfinite/loss", "nonfinite_grad": "nonfinite/grad"}

    def metrics(self) -> dict[str, float]:
        return {self._NAMES.get(f.name, f.name): getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


@dataclass
class LossSums:
    """Running sums of one rank's backward passes, reduced over ranks into UpdateStats."""

    loss: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    approx_kl: float = 0.0
    ratio_mean: float = 0.0
    passes: int = 0
    nonfinite: int = 0
    ratio_max_dev: float = 0.0

    def add(self, loss: torch.Tensor, stats: dict[str, torch.Tensor], on_policy: bool) -> None:
        """One backward pass: `loss` and the stats of grpo.loss.grpo_loss; `on_policy` for the first update block."""
        self.loss += loss.item()
        self.kl += stats["kl"].item()
        self.clip_frac += stats["clip_frac"].item()
        self.approx_kl += stats["approx_kl"].item()
        self.ratio_mean += stats["ratio"].mean().item()
        self.passes += 1
        self.nonfinite += int(not torch.isfinite(loss))
        if on_policy:
            self.ratio_max_dev = max(self.ratio_max_dev, (stats["ratio"] - 1).abs().max().item())

    def reduce(self, device: torch.device) -> UpdateStats:
        """Collective: means over ranks, the non-finite count summed, the ratio deviation's max."""
        means = ("loss", "kl", "clip_frac", "approx_kl", "ratio_mean")
        summed = torch.tensor([getattr(self, k) / self.passes for k in means] + [float(self.nonfinite)], device=device)
        dev = torch.tensor([self.ratio_max_dev], device=device)
        dist.all_reduce(summed)
        summed[:-1] /= dist.get_world_size()
        dist.all_reduce(dev, op=dist.ReduceOp.MAX)
        values = summed.tolist()
        return UpdateStats(**dict(zip(means, values[:-1])), nonfinite_loss=values[-1], ratio_max_dev=dev.item())


@dataclass
class StepResult:
    """One GRPO step on this rank: its chunks, every sample's reward and advantage, and what it logs."""

    chunks: list[Chunk]
    rewards: torch.Tensor  # [N] mixed rewards of every global sample (gathered)
    advantages: torch.Tensor  # [N]
    stats: dict[str, float]  # the metrics row (all-reduced where it spans ranks)

    @property
    def images(self) -> torch.Tensor:
        return torch.cat([c.images for c in self.chunks])
