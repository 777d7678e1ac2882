"""The data one GRPO step passes from phase to phase, typed: trajectories, rollout chunks, update statistics, the
step's result. A leaf of grpo/: the sampler (grpo/rollout.py) and the objectives (grpo/objectives/, e.g. grpo's
replayed chunks) both build these.

A chunk is one update micro-batch of a rank's rollout: the unit of everything after sampling (reward, reference,
update), so that the update recomputes each trained transition on exactly the batch that produced it (the first-pass
ratio is then exactly 1, see grpo/rollout.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from grpo.models import Conditioning


@dataclass
class Trajectories:
    latents: torch.Tensor  # [B, K+1, S, C] float32: x_0 (noise) .. x_K, K = T, or L+1 before a dpm2 tail
    log_probs: torch.Tensor | None  # [B, K] float32 (0 at ODE steps outside the window); None for ODE rollouts
    # [B, S, C] float32: the clean latent that is decoded: x0 predicted at the last step, x - sigma_{T-1}·v (as
    # DanceGRPO@15cc71d fastvideo/train_grpo_flux.py:250-257), or the dpm2 tail's end. With sde: flow and an SDE
    # last step this differs from Flow-GRPO, which decodes the last latent, still carrying that step's noise
    # (flow_grpo@9745241 flow_grpo/diffusers_patch/flux_pipeline_with_logprob.py:145-181). The same for cps (no
    # noise into sigma 0) and for a last step outside the window (an Euler step to sigma 0 lands on x0).
    x0: torch.Tensor
    means: torch.Tensor | None = None  # [B, K, S, C] SDE means of each step, when recorded (GRPO-Guard)
    nfe: int = 0  # transformer calls per trajectory, solver tail included

    def select(self, rows: slice) -> "Trajectories":
        lp = None if self.log_probs is None else self.log_probs[rows]
        means = None if self.means is None else self.means[rows]
        return Trajectories(self.latents[rows], lp, self.x0[rows], means, self.nfe)


@dataclass
class Chunk:
    """One update micro-batch of this rank's trajectories."""

    ids: list[int]  # global sample indices (prompt-major: sample s belongs to prompt slot s // group_size)
    prompt_idx: list[int]  # row of each sample's prompt in the prompt cache
    cond: Conditioning
    traj: Trajectories
    # What the update trains, drawn once per chunk: GRPO's transitions i -> i+1, or the schedule points sigma_i at
    # which nft / awm noise the clean samples (grpo/data.trained_steps, the window's steps with an SDE window).
    trained: list[int]
    images: torch.Tensor | None = None  # [B, 3, H, W] in [0, 1], decoded after the rollout's weights are released
    # Constants of the update, keyed by trained index, computed without gradients before it:
    reference: dict[int, torch.Tensor] = field(default_factory=dict)  # GRPO: reference SDE mean; nft/awm: v_ref
    lagging: dict[int, torch.Tensor] = field(default_factory=dict)  # nft/awm: the lagging policy's velocity
    reference_vnorm: dict[int, torch.Tensor] = field(default_factory=dict)  # GRPO: ||v_ref|| per row (drift/*)
    noised: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # nft/awm: (x_t, eps)
    # A chunk of an objective's extra update block (e.g. grpo's replay, grpo/replay.py): [B] importance weights of
    # its policy loss, and its own advantages; an on-policy chunk: 1 and None (the step's advantages)
    weight: torch.Tensor | float = 1.0
    advantages: torch.Tensor | None = None


@dataclass
class UpdateStats:
    """What an update phase logs. Means are over this rank's backward passes, then over ranks.

    Fields left None are not logged: a step whose update was skipped for a non-finite reward logs skipped_updates
    and lr (its row also has the rewards and the step's timings) but no loss, grad_norm or ratio statistics; the
    ratio statistics exist for grpo only.
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
    extra: dict[str, float] = field(default_factory=dict)  # the objective's own terms, e.g. nft's loss_pos
    extra_blocks: int = 0  # the objective's extra update blocks that ran after the on-policy ones (not logged)

    _NAMES = {"nonfinite_loss": "nonfinite/loss", "nonfinite_grad": "nonfinite/grad"}

    def metrics(self) -> dict[str, float]:
        out = {self._NAMES.get(f.name, f.name): getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("extra", "extra_blocks") and getattr(self, f.name) is not None}
        return {**out, **self.extra}


@dataclass
class LossSums:
    """Running sums of one rank's backward passes, reduced over ranks into UpdateStats.

    The sums stay on the device until `reduce`: one host sync per update phase instead of one per backward pass,
    so the accelerator's queue never drains between micro-batches.
    """

    points: int = 0  # transitions a trajectory has (sampling.num_steps): the length of the per-timestep stats
    per_point: tuple[str, ...] = ()  # scalar stats also logged per point j, "<name>/tJJ" (Objective.stats_per_point)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # "loss" and each scalar stat of the objective
    passes: int = 0
    nonfinite: torch.Tensor | None = None  # backward passes with a non-finite loss
    # grpo only, the on-policy block's |ratio - 1| per transition j: its max, its sum and the rows it was taken over
    ratio_dev: torch.Tensor | None = None  # [3, points]
    # the per_point stats' sums at each point j, and in the last row the passes there: [len(per_point) + 1, points]
    point_sums: torch.Tensor | None = None

    def add(self, loss: torch.Tensor, stats: dict[str, torch.Tensor], on_policy: bool = False,
            point: int = 0) -> None:
        """One backward pass at transition `point`: `loss` and the objective's detached stats ("ratio" [B] for grpo:
        its mean is logged, and its deviation from 1 in the on-policy block, per transition); `on_policy` for the
        first update block."""
        values = {"loss": loss}
        for key, value in stats.items():
            if key == "ratio":
                values["ratio_mean"] = value.mean()
                if self.ratio_dev is None:
                    self.ratio_dev = torch.zeros(3, max(self.points, point + 1), dtype=torch.float32,
                                                 device=value.device)
                if on_policy:
                    dev = (value.detach().float() - 1).abs()
                    self.ratio_dev[0, point] = torch.maximum(self.ratio_dev[0, point], dev.max())
                    self.ratio_dev[1, point] += dev.sum()
                    self.ratio_dev[2, point] += dev.numel()
            else:
                values[key] = value
        if self.per_point:
            if self.point_sums is None:
                self.point_sums = torch.zeros(len(self.per_point) + 1, max(self.points, point + 1),
                                              dtype=torch.float32, device=loss.device)
            for i, key in enumerate(self.per_point):
                self.point_sums[i, point] += stats[key].detach().float()
            self.point_sums[-1, point] += 1
        for key, value in values.items():
            value = value.detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        bad = (~torch.isfinite(loss.detach())).float()
        self.nonfinite = bad if self.nonfinite is None else self.nonfinite + bad
        self.passes += 1

    def reduce(self, device: torch.device) -> UpdateStats:
        """Collective: means over ranks, the non-finite count summed, the ratio deviation's max."""
        keys = list(self.sums)
        nonfinite = self.nonfinite if self.nonfinite is not None else torch.zeros(())
        summed = torch.stack([self.sums[k].to(device) / self.passes for k in keys] + [nonfinite.to(device)])
        dist.all_reduce(summed)
        summed[:-1] /= dist.get_world_size()
        values = dict(zip(keys, summed[:-1].tolist()))
        named = {f.name for f in dataclasses.fields(UpdateStats)}
        stats = UpdateStats(**{k: v for k, v in values.items() if k in named}, nonfinite_loss=summed[-1].item(),
                            extra={k: v for k, v in values.items() if k not in named})
        if self.ratio_dev is not None:
            worst, totals = self.ratio_dev[0].to(device), self.ratio_dev[1:].to(device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            dist.all_reduce(totals)
            stats.ratio_max_dev = worst.max().item()
            # Which timestep drifts, when one does (an accelerator's kernels differ between rollout and update):
            # the transitions some rank trained in the on-policy block, over all ranks.
            for j in torch.nonzero(totals[1] > 0).flatten().tolist():
                stats.extra[f"ratio_dev/t{j:02d}_max"] = worst[j].item()
                stats.extra[f"ratio_dev/t{j:02d}_mean"] = (totals[0, j] / totals[1, j]).item()
        if self.per_point:  # every rank reduces it, also one that trained no point (the collective must match)
            at = (self.point_sums if self.point_sums is not None
                  else torch.zeros(len(self.per_point) + 1, self.points)).to(device)
            dist.all_reduce(at)
            for j in torch.nonzero(at[-1] > 0).flatten().tolist():  # the points some rank trained
                for i, key in enumerate(self.per_point):
                    stats.extra[f"{key}/t{j:02d}"] = (at[i, j] / at[-1, j]).item()
        return stats


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
