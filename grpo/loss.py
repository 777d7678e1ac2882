"""PPO-clip GRPO loss on per-step log-probs (DanceGRPO fastvideo/train_grpo_flux.py, Flow-GRPO
scripts/train_flux.py), optionally with GRPO-Guard's RatioNorm (Flow-GRPO scripts/train_sd3_GRPO_Guard.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RatioNorm", "grpo_loss", "ratio_norm_log_ratio"]


@dataclass
class RatioNorm:
    """What GRPO-Guard's ratio normalisation needs for one trained step j, shared by the whole micro-batch.

    Only for the Flow-SDE kernel (grpo.sde.sde_step kind "flow"): with CPS the log-prob is already unnormalised.

    Attributes:
        mean: [B, ...] the transition's SDE mean under the current policy (StepOut.mean, with graph).
        old_mean: [B, ...] the same mean stored at rollout (constant).
        std_scale: 0-d or [B]: the Flow-SDE scale s_j = eta·sqrt(sigma/(1 - sigma)) WITHOUT sqrt(delta)
            (Flow-GRPO's std_dev_t), e.g. StepOut.std / sqrt_dt.
        sqrt_dt: 0-d or [B]: sqrt(sigma_j - sigma_{j+1}).
        per_sample_bias: True (default): the bias b is averaged per sample (as verl-omni's GRPOGuardLoss, what the
            analytic identity needs); False: the official script's scalar b, averaged over the whole batch (its
            ``.mean(dim=tuple(range(1, log_prob.ndim)))`` on a 1-D tensor reduces over everything).
    """

    mean: Tensor
    old_mean: Tensor
    std_scale: Tensor | float
    sqrt_dt: Tensor | float
    per_sample_bias: bool = True


def ratio_norm_log_ratio(log_prob: Tensor, old_log_prob: Tensor, rn: RatioNorm) -> tuple[Tensor, Tensor]:
    """GRPO-Guard's normalised log-ratio and its gradient reweighting.

    Source: yifan123/flow_grpo scripts/train_sd3_GRPO_Guard.py (merged 9745241; lines 913-937 at 879042c, read at
    the fork zhtmike/flow_grpo@2e2f712, training loop ``if config.rationorm``); paper arXiv 2510.22319 (RatioNorm,
    gradient reweighting). With s̄ = batch mean of std_scale, d̄ = batch mean of sqrt_dt, S = s̄·d̄:
        b = mean_D (mean - old_mean)² / (2·S²)
        log ρ̂ = (log_prob - old_log_prob + b)·S
        weight = 1 / d̄²   (the policy loss is divided by d̄², i.e. by delta_j)
    For x' = old_mean + S·ε (Gaussian Flow-SDE log-probs, shared j) this equals mean_D ε·(mean - old_mean): mean 0
    in log space, variance independent of the step's noise scale. There are no running statistics. At the first,
    on-policy pass (log_prob == old_log_prob and mean == old_mean bit for bit) b = 0 and log ρ̂ = 0, so ρ̂ is
    exactly 1. b keeps the graph of `mean`, as in the source.

    Returns:
        log_ratio: [B] float32 normalised log-ratio (with graph).
        weight: 0-d float32 constant 1/d̄².
    """
    std_scale = torch.as_tensor(rn.std_scale, dtype=torch.float32, device=log_prob.device).detach()
    sqrt_dt = torch.as_tensor(rn.sqrt_dt, dtype=torch.float32, device=log_prob.device).detach()
    scale = sqrt_dt.mean() * std_scale.mean()
    sq = (rn.mean.float() - rn.old_mean.float().detach()) ** 2
    bias = sq.mean(dim=tuple(range(1, sq.ndim))) if rn.per_sample_bias else sq.mean()
    bias = bias / (2 * scale**2)
    log_ratio = (log_prob.float() - old_log_prob.float().detach() + bias) * scale
    return log_ratio, 1.0 / sqrt_dt.mean() ** 2


def grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    ratio_norm: RatioNorm | None = None,
    weight: float | Tensor = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean over B of max(-A·r, -A·clip(r, 1-eps, 1+eps)) + kl_coef·kl, with r = exp(log_prob - old_log_prob).

    Args:
        log_prob: [B] element-mean log-probs of the stored transitions under the current policy (with graph).
        old_log_prob: [B] the same from the rollout (treated as constants).
        advantages: [B] group advantages (constants).
        clip_range: eps; tiny (1e-4 in DanceGRPO/Flow-GRPO) because element-mean log-probs keep r within ~1e-3 of 1.
        kl: [B] optional KL to the reference policy (with graph), e.g. grpo.sde.kl_same_std.
        kl_coef: beta multiplying kl.
        ratio_norm: GRPO-Guard (see :func:`ratio_norm_log_ratio`); None (default) leaves the loss as it was. When
            given, r is the normalised ratio exp(log ρ̂) (also in the stats and the clip fraction), the policy term
            is divided by d̄² (gradient reweighting) and approx_kl stays on the raw log-ratio, as in the source.
        weight: a constant factor of the policy term (Flash-GRPO's timestep rescale), or [B] constant factors per
            sample (a replayed trajectory's importance weight, grpo/replay.py); the KL term keeps its own.

    Returns:
        loss: scalar float32 tensor with graph.
        stats: detached float32 tensors: ratio [B]; scalars clip_frac (share with |r - 1| > eps), approx_kl
            (½·mean((logp - old)²), Flow-GRPO's), policy_loss (mean clipped term), kl (mean, 0 if None).
    """
    log_ratio = log_prob.float() - old_log_prob.float().detach()
    if ratio_norm is None:
        ratio = torch.exp(log_ratio)
    else:
        normalised, norm_weight = ratio_norm_log_ratio(log_prob, old_log_prob, ratio_norm)
        ratio = torch.exp(normalised)
    adv = advantages.float().detach()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy = torch.maximum(unclipped, clipped)
    if ratio_norm is not None:
        policy = policy * norm_weight
    if isinstance(weight, Tensor):
        policy = policy * weight.float().detach()
    elif weight != 1.0:
        policy = policy * weight
    per_sample = policy
    if kl is not None:
        per_sample = per_sample + kl_coef * kl.float()
    loss = per_sample.mean()
    stats = {
        "ratio": ratio.detach(),
        "clip_frac": ((ratio.detach() - 1.0).abs() > clip_range).float().mean(),
        "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        "policy_loss": policy.detach().mean(),
        "kl": kl.detach().float().mean() if kl is not None else torch.zeros((), device=loss.device),
    }
    return loss, stats


def poison_nonfinite(loss: Tensor) -> Tensor:
    """`loss`, or nan with a nan gradient where it is not finite, without a host sync.

    ZeRO-3 skips an optimizer step only when the all-reduced gradient norm is non-finite, so a non-finite loss must
    make a non-finite gradient. Multiplying by a factor of exactly 1 or nan does that and leaves a finite loss and its
    gradient bit for bit unchanged; an `if` would sync with the host every micro-batch, and a torch.where around the
    loss itself would poison finite gradients through its unused nan branch.
    """
    return loss * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
