"""GARDO's gate and reference refresh for grpo (grpo.gardo): a KL applied only to the samples whose reward is
uncertain, against a reference that is a copy of the policy refreshed now and then.

Source: tinnerhrhe/GARDO@1cc77fb (2026-01-06; the official code of arXiv 2512.24138, "GARDO: Reinforcing Diffusion
Models without Reward Hacking"), scripts/train_flux_grpo_gardo.py with config/gardo.py:hps_flux, launched by
scripts/single_node/grpo_gardo_flux.sh. (Issue 54 cites yifan123/flow_grpo@94e23ee `train_flux_gardo.py`; that
commit and file are not in the flow_grpo snapshot fetched on 2026-12-07 (newest ac4c86e), so the authors' own
repository is read instead.) What the script does, line by line:

- Uncertainty (lines 819-826): over the step's gathered samples, rank each reward descending (rank 1 = the highest;
  ``torch.sort(descending=True)``, ``ranks[indices] = arange(1, N + 1)``), and
  ``u = rank(main) - (rank(aesthetic) + rank(imagereward)) / 2``: the main (trained) reward's rank minus the mean
  rank of the auxiliary rewards. Read literally, u > 0 is a sample the main reward ranks *below* where the
  auxiliary rewards put it. This module transcribes that sign as it is; the paper's prose ("uncertain" samples) does
  not settle the sign, so it is stated here rather than changed.
- Gate (lines 828-830, the RiskCompensator at 220-239): of the non-negative u, the top `share` (threshold = the
  ``np.percentile`` of the non-negative u at 100 - 100·share, linear interpolation; gated: u > threshold strictly).
  The share adapts once a step from the mean m of the non-negative u against the last 20 steps' means: the first
  step sets it to its base (0.1); m above every remembered mean multiplies it by 1.1, below every one by 0.9; it is
  clipped to [0.02, 0.2]; then m is remembered.
- KL (lines 913-939): ``mean over gated samples of (mean - mean_ref)² / (2·std_dev_t²)`` times ``train.beta``
  (0.01 in hps_flux), added to the clipped policy loss; std_dev_t is Flow-GRPO's SDE scale WITHOUT sqrt(dt)
  (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:50, the step's std being std_dev_t·sqrt(dt)), so the source's
  KL is the exact Gaussian KL times dt = sigma_j - sigma_{j+1}. No KL where no sample of the micro-batch is gated.
- Reference (lines 455-464, 640-645, 781-791, 994-995): a second LoRA adapter "old", a copy of the policy's; copied
  again at the start of an epoch (after its rollout, before its update) when an optimizer step of the epoch before
  logged a mean KL above ``kl_thres`` (3e-4, config/gardo.py:107: "set this according to specific tasks"), or when
  more than 15 epochs have passed since the last copy (``epoch - prev_epoch > 15``; the config's ``reset_freq`` is
  not read by the script). Not an EMA.

Here one GARDO epoch is one recipe step (one rollout, then its update blocks). Two choices differ from the script,
both so that a run on N processes is the run on 1 (the micro-batches a rank holds depend on the world size):
the KL's mean over gated samples is taken over the step, not each micro-batch (each gated sample's KL weighs
1 / (the step's gated share), each other sample's 0: the same expectation), and the refresh trigger is the step's
mean KL over its gated samples and trained transitions, not any one optimizer step's mean (the same with one
update block a step, the presets' setting). GARDO's third part, diversity-aware advantages (DINOv3 features,
flow_grpo/stat_tracking.py type 'gardo'), is not implemented (issue 54 item 3 asks for the gated KL and refresh).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from grpo.sde import kl_same_std

__all__ = ["SHARE_MAX", "SHARE_MIN", "Gardo", "ShareController", "gate", "ranks", "uncertainty"]

# The RiskCompensator's constants (train_flux_grpo_gardo.py:221-238): the rate the share moves by, its bounds and
# how many steps' means it remembers. The base share is grpo.gardo.share.
RATE, SHARE_MIN, SHARE_MAX, WINDOW = 0.1, 0.02, 0.2, 20


def ranks(values: Tensor) -> Tensor:
    """[N] float64 ranks, 1 = the highest value (the source's descending sort). Ties keep their index order (a
    stable sort: the source's default sort leaves ties to the kernel, which would make the gate differ between
    runs)."""
    order = torch.sort(values.double(), descending=True, stable=True).indices
    out = torch.empty(len(values), dtype=torch.float64, device=values.device)
    out[order] = torch.arange(1, len(values) + 1, dtype=torch.float64, device=values.device)
    return out


def uncertainty(main: Tensor, aux: Tensor) -> Tensor:
    """u = rank(main) - mean over the auxiliary rewards of their ranks. main: [N]; aux: [N, A]. Returns [N] float64."""
    return ranks(main) - torch.stack([ranks(aux[:, a]) for a in range(aux.shape[1])]).mean(0)


@dataclass
class ShareController:
    """The share of the non-negative u that is gated, adapted once a step (the source's RiskCompensator)."""

    base: float
    share: float = 0.0
    means: list[float] = field(default_factory=list)  # the last WINDOW steps' means of the non-negative u

    def update(self, nonneg: Tensor) -> float:
        m = float(nonneg.double().mean())
        if not self.means:
            self.share = self.base
        elif m > max(self.means):
            self.share *= 1 + RATE
        elif m < min(self.means):
            self.share *= 1 - RATE
        self.share = min(max(self.share, SHARE_MIN), SHARE_MAX)
        self.means = (self.means + [m])[-WINDOW:]
        return self.share

    def state(self) -> dict[str, Tensor]:
        return {"gardo/means": torch.tensor(self.means, dtype=torch.float64),
                "gardo/share": torch.tensor([self.share], dtype=torch.float64)}

    def load(self, tensors: dict[str, Tensor]) -> None:
        self.means, self.share = [float(v) for v in tensors["gardo/means"].tolist()], float(tensors["gardo/share"])


def gate(u: Tensor, controller: ShareController) -> Tensor:
    """[N] bool: u above the (100 - 100·share)-th percentile of the non-negative u, the share updated first.

    The u sum to 0 (both sides are means of the ranks 1..N), so some u is >= 0 and the percentile is defined.
    torch.quantile's default interpolation is numpy.percentile's ("linear")."""
    nonneg = u[u >= 0]
    share = controller.update(nonneg)
    threshold = torch.quantile(nonneg.double(), (100 - share * 100) / 100)
    return u > threshold


class Gardo:
    """grpo's GARDO state across the steps, the same on every rank: the gate of the current step, the share
    controller, the KL sums that trigger a refresh and when the reference was last refreshed. The reference's weights
    are the recipe's lagging copy of the policy (grpo.ema.ShardedEMA, Models.lagging, kept in checkpoints as
    "lagging"), which never moves on its own (grpo's lagging decay is 1) and is set to the policy by `scored` when a
    refresh is due."""

    def __init__(self, settings, reward_names: list[str]) -> None:
        self.settings = settings
        self.aux = [reward_names.index(n) for n in settings.aux_rewards]
        self.controller = ShareController(settings.share)
        self.gated: Tensor | None = None  # [N] bool of the current step, by global sample index
        self.weight: Tensor | None = None  # [N] float32: gated / (the step's gated share), else 0
        self.refresh_due = False  # set by a step whose gated KL exceeded kl_threshold
        self.refreshed_at = 0  # the step whose update the reference was copied before (0: the initial weights)
        self.kl_sums: Tensor | None = None  # [2]: this rank's sum of gated KL and its count, over the step

    def scored(self, models, step: int, components: Tensor, weights: Tensor) -> dict[str, float]:
        """The step's gate from its gathered per-reward scores [N, R], and the reference refreshed first if due."""
        stats = {"gardo/refreshed": 0.0}
        if self.refresh_due or step - self.refreshed_at >= self.settings.refresh_every:
            models.lagging.update(0.0)  # the policy's weights now, after the last step's update
            self.refresh_due, self.refreshed_at, stats["gardo/refreshed"] = False, step, 1.0
        # The gate's float64 ranks and quantile on the host: N numbers, and float64 is poison on an Ascend NPU (ops
        # missing or emulated); self.weight moves to the loss's device in kl()
        components, weights = components.detach().cpu(), weights.detach().cpu()
        if torch.isfinite(components).all():
            main = components.double() @ weights.double()  # the trained reward (mix's sum)
            self.gated = gate(uncertainty(main, components[:, self.aux]), self.controller)
        else:  # the update is skipped (a non-finite reward); the share stays as it was
            self.gated = torch.zeros(len(components), dtype=torch.bool, device=components.device)
        share = self.gated.double().mean()
        self.weight = torch.where(self.gated, 1.0 / share.clamp_min(1e-12), 0.0).float()
        self.kl_sums = None
        return {**stats, "gardo/gated_frac": float(share), "gardo/share": self.controller.share}

    def kl(self, mean: Tensor, ref_mean: Tensor, std: Tensor, dt: float, ids: list[int]) -> tuple[Tensor, Tensor]:
        """[B] the gated KL of one transition, each weighted as in the step's mean over its gated samples (with
        graph), on the source's scale (times dt); and the micro-batch's mean over its gated rows, for the log."""
        kl = kl_same_std(mean, ref_mean, std) * dt
        w = self.weight[torch.as_tensor(ids, device=self.weight.device)].to(kl.device)
        g = (w > 0).float()
        sums = torch.stack([(kl.detach() * g).sum(), g.sum()])
        self.kl_sums = sums if self.kl_sums is None else self.kl_sums + sums
        return kl * w, sums[0] / sums[1].clamp_min(1.0)

    def remember(self) -> None:
        """Collective: the step's mean gated KL over every rank; above kl_threshold, the next step refreshes first."""
        if self.kl_sums is None:  # no update ran (skipped), or nothing trained
            return
        sums = self.kl_sums.float()  # float32 on the device: HCCL has no float64 all-reduce to count on
        if dist.is_initialized():
            dist.all_reduce(sums)
        if sums[1] > 0 and float(sums[0] / sums[1]) > self.settings.kl_threshold:
            self.refresh_due = True

    def state(self) -> dict[str, Tensor]:
        """What a checkpoint keeps (the objective's part, rank 0's file): float64, so the share comes back exact."""
        return {**self.controller.state(),
                "gardo/refresh": torch.tensor([float(self.refresh_due), float(self.refreshed_at)], dtype=torch.float64)}

    def load(self, tensors: dict[str, Tensor]) -> None:
        if "gardo/share" not in tensors:
            raise ValueError("the checkpoint has no GARDO state (written without grpo.gardo); resume it with the "
                             "settings it was written with")
        self.controller.load(tensors)
        self.refresh_due, self.refreshed_at = bool(tensors["gardo/refresh"][0]), int(tensors["gardo/refresh"][1])
