"""PPO-clip GRPO loss on per-step log-probs (DanceGRPO fastvideo/train_grpo_flux.py, Flow-GRPO
scripts/train_flux.py), optionally with GRPO-Guard's RatioNorm (Flow-GRPO scripts/train_sd3_GRPO_Guard.py), or with
Flow-DPPO's KL trust region in place of the clip (arXiv 2606.11025; see :func:`trust_region_keep`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.sde import kl_same_std

__all__ = ["RatioNorm", "TrustRegion", "grpo_loss", "ratio_norm_log_ratio", "trust_region_keep"]


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


@dataclass
class TrustRegion:
    """What Flow-DPPO's trust region needs for one trained transition j, shared by the whole micro-batch.

    Attributes:
        mean: [B, ...] the transition's SDE mean under the current policy (StepOut.mean).
        old_mean: [B, ...] the same mean stored at rollout (the policy that sampled it).
        std: 0-d or [B]: the transition's std (StepOut.std), the same under both policies (it depends on the
            schedule only), so their KL is exact and closed-form.
        kl_threshold: the transition's KL above which a step that would move further away is masked.
    """

    mean: Tensor
    old_mean: Tensor
    std: Tensor | float
    kl_threshold: float


def trust_region_keep(ratio: Tensor, advantages: Tensor, tr: TrustRegion) -> tuple[Tensor, Tensor]:
    """Flow-DPPO's KL-advantage mask: which samples keep their policy-gradient term.

    Sources, all three the same rule (docs/strategies.md, "Flow-DPPO's trust region"): Tencent-Hunyuan/UniRL@1a7b501
    unirl/algorithms/flowdppo.py:43-51, 92-111; verl-project/verl-omni@a1139ba
    verl_omni/trainer/diffusion/diffusion_algos.py:402-424; X-GenGroup/Flow-Factory PR #181 (79120955, read in the
    fork bwnzheng/Flow-Factory) src/flow_factory/trainers/dppo.py:46-48, 207-224. Paper arXiv 2606.11025, Eq. 14, 18.
        kl = mean_D (mean - old_mean)² / (2·std²)      (the Gaussians' exact KL, averaged over the elements: the
                                                         paper's Eq. 14 sums them; all three sources average, and
                                                         their thresholds are for the average)
        masked = kl >= kl_threshold and ((r > 1 and A > 0) or (r < 1 and A < 0))
    "Further away" is read off the ratio: with A > 0 the gradient raises r, so a step already at r > 1 would move
    further from the rollout policy; with A < 0 it lowers r, so r < 1 is further. A step outside the threshold that
    the gradient pulls back (A > 0, r < 1 or A < 0, r > 1) keeps its term. At the first, on-policy pass (mean ==
    old_mean bit for bit) kl is exactly 0 and nothing is masked. The mask is a constant (no gradient through kl).

    Returns:
        keep: [B] bool.
        kl: [B] float32 detached.
    """
    kl = kl_same_std(tr.mean.detach(), tr.old_mean.detach(), torch.as_tensor(tr.std).detach())
    ratio, adv = ratio.detach(), advantages.detach()
    further = ((ratio > 1.0) & (adv > 0)) | ((ratio < 1.0) & (adv < 0))
    return ~((kl >= tr.kl_threshold) & further), kl


def grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    ratio_norm: RatioNorm | None = None,
    trust_region: TrustRegion | None = None,
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
        trust_region: Flow-DPPO (see :func:`trust_region_keep`); None (default) leaves the loss as it was. When
            given, the policy term is -A·r unclipped where the mask keeps it and 0 where it masks it, still averaged
            over all B (as the three sources do); clip_range then only sets clip_frac. Not with ratio_norm.
        weight: a constant factor of the policy term (Flash-GRPO's timestep rescale), or [B] constant factors per
            sample (a replayed trajectory's importance weight, grpo/replay.py); the KL term keeps its own.

    Returns:
        loss: scalar float32 tensor with graph.
        stats: detached float32 tensors: ratio [B]; scalars clip_frac (share with |r - 1| > eps), approx_kl
            (½·mean((logp - old)²), Flow-GRPO's), policy_loss (mean clipped term), kl (mean, 0 if None); with
            trust_region also dppo/masked_frac (share of masked samples) and dppo/kl (mean KL to the rollout policy).
    """
    if ratio_norm is not None and trust_region is not None:
        raise ValueError("grpo_loss: ratio_norm and trust_region both reshape the ratio's term; give one")
    log_ratio = log_prob.float() - old_log_prob.float().detach()
    if ratio_norm is None:
        ratio = torch.exp(log_ratio)
    else:
        normalised, norm_weight = ratio_norm_log_ratio(log_prob, old_log_prob, ratio_norm)
        ratio = torch.exp(normalised)
    adv = advantages.float().detach()
    unclipped = -adv * ratio
    if trust_region is None:
        clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
        policy = torch.maximum(unclipped, clipped)
    else:
        keep, tr_kl = trust_region_keep(ratio, adv, trust_region)
        # A masked sample's term and gradient are 0, also where its ratio overflowed (inf): its log-ratio is taken
        # out before the exp, as the sources' torch.where does for the loss alone (their gradient is then
        # inf * 0 = nan). A kept sample's ratio is the same exp of the same number, bit for bit.
        kept = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
        policy = torch.where(keep, -adv * kept, torch.zeros_like(kept))
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
    if trust_region is not None:
        stats["dppo/masked_frac"] = (~keep).float().mean()
        stats["dppo/kl"] = tr_kl.mean()
    return loss, stats


def poison_nonfinite(loss: Tensor) -> Tensor:
    """`loss`, or nan with a nan gradient where it is not finite, without a host sync.

    ZeRO-3 skips an optimizer step only when the all-reduced gradient norm is non-finite, so a non-finite loss must
    make a non-finite gradient. Multiplying by a factor of exactly 1 or nan does that and leaves a finite loss and its
    gradient bit for bit unchanged; an `if` would sync with the host every micro-batch, and a torch.where around the
    loss itself would poison finite gradients through its unused nan branch.
    """
    return loss * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
