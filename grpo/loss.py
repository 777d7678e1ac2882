"""PPO-clip GRPO loss on per-step log-probs (DanceGRPO fastvideo/train_grpo_flux.py, Flow-GRPO
scripts/train_flux.py)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["grpo_loss"]


def grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean over B of max(-A·r, -A·clip(r, 1-eps, 1+eps)) + kl_coef·kl, with r = exp(log_prob - old_log_prob).

    Args:
        log_prob: [B] element-mean log-probs of the stored transitions under the current policy (with graph).
        old_log_prob: [B] the same from the rollout (treated as constants).
        advantages: [B] group advantages (constants).
        clip_range: eps; tiny (1e-4 in DanceGRPO/Flow-GRPO) because element-mean log-probs keep r within ~1e-3 of 1.
        kl: [B] optional KL to the reference policy (with graph), e.g. grpo.sde.kl_same_std.
        kl_coef: beta multiplying kl.

    Returns:
        loss: scalar float32 tensor with graph.
        stats: detached float32 tensors: ratio [B]; scalars clip_frac (share with |r - 1| > eps), approx_kl
            (½·mean((logp - old)²), Flow-GRPO's), policy_loss (mean clipped term), kl (mean, 0 if None).
    """
    log_ratio = log_prob.float() - old_log_prob.float().detach()
    ratio = torch.exp(log_ratio)
    adv = advantages.float().detach()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy = torch.maximum(unclipped, clipped)
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
