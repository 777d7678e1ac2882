"""Group-relative advantages: each reward compared with the other samples of the same prompt (DanceGRPO
fastvideo/train_grpo_flux.py --use_group, Flow-GRPO flow_grpo/stat_tracking.py), and MixGRPO's per-reward form
(each reward's in-group z-score, weighted and summed)."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.errors import ConfigError

__all__ = ["group_advantages", "per_reward_advantages"]

STD_SCOPES = ("group", "batch")


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std_scope: str = "group",
    clip: float | None = 5.0,
    eps: float = 1e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """A = (r - mean of its group) / (std + eps), clamped to [-clip, clip].

    "group" divides by the group's own unbiased std (DanceGRPO --use_group, TRL scale_rewards="group"); "batch"
    divides by the unbiased std of all rewards (Flow-GRPO global_std=True). A group whose rewards are all equal gets
    A = 0 exactly: it carries no preference, and (r - mean) would otherwise be rounding noise.

    Args:
        rewards: [N] rewards, gathered over all ranks (any float dtype; computed in float32).
        group_ids: [N] long, equal for samples of the same prompt; any values, any order, groups of size >= 2.
        std_scope: "group" or "batch".
        clip: advantage clamp (DanceGRPO/Flow-GRPO adv_clip_max 5); None disables it.
        eps: added to the std (Flow-GRPO and TRL use 1e-4).

    Returns:
        advantages: float32 [N] on the rewards' device.
        stats: detached 0-d float32 tensors: zero_std_frac (fraction of groups with all-equal rewards),
            reward_std_in_group_mean (mean over groups of the unbiased in-group std).
    """
    if std_scope not in STD_SCOPES:
        raise ConfigError(f"std_scope: unknown value {std_scope!r}; use one of {STD_SCOPES}")
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    r = rewards.float()
    # Dense ids 0..G-1 so any labelling (prompt hashes, global indices) works with index_add.
    _, gid = torch.unique(group_ids, return_inverse=True)
    num_groups = int(gid.max()) + 1
    count = torch.zeros(num_groups, dtype=torch.float32, device=r.device).index_add_(0, gid, torch.ones_like(r))
    if bool((count < 2).any()):
        raise ValueError("group_advantages: every group needs >= 2 samples (group size G >= 2)")

    mean = torch.zeros_like(count).index_add_(0, gid, r) / count
    dev = r - mean[gid]
    group_std = torch.sqrt(torch.zeros_like(count).index_add_(0, gid, dev**2) / (count - 1))
    # Exact test for "all equal", immune to rounding in the mean.
    gmax = torch.full_like(count, -torch.inf).scatter_reduce_(0, gid, r, reduce="amax")
    gmin = torch.full_like(count, torch.inf).scatter_reduce_(0, gid, r, reduce="amin")
    zero_std = gmax == gmin

    std = group_std[gid] if std_scope == "group" else r.std(unbiased=True).expand_as(r)
    adv = torch.where(zero_std[gid], torch.zeros_like(r), dev / (std + eps))
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    stats = {
        "zero_std_frac": zero_std.float().mean().detach(),
        "reward_std_in_group_mean": group_std.mean().detach(),
    }
    return adv, stats


def per_reward_advantages(
    components: Tensor,
    weights: Tensor,
    group_ids: Tensor,
    *,
    eps: float,
    clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """MixGRPO's "advantage_aggr": A = clamp(sum_r w_r · (x_r - group mean) / (group std + eps), -clip, clip).

    The weighted sum of the per-reward z-scores *is* the advantage; it is not normalised again (feeding it to
    :func:`group_advantages` would re-standardise it and move the clip). As MixGRPO@e5cdd6a
    fastvideo/train_grpo_flux.py: per group, mean and unbiased std (torch .std(), ddof=1) + eps of each reward
    (:428-451; its eps is 1e-8), the weights divided by their sum (:764-767), the weighted sum (:452-456), clamped
    to [-adv_clip_max, adv_clip_max] at the loss (:567-571; its script: 5). Here the weights are divided by the sum
    of their absolute values: the same for MixGRPO's non-negative weights, and bounded when a weight is negative.
    The one deliberate difference: a reward whose scores are all equal within a group contributes exactly 0 there
    (:func:`group_advantages`' rule), where MixGRPO divides their rounding noise by 1e-8. Its trimmed_ratio
    (0 in its script) is not offered. With G samples a z-score is at most (G - 1)/sqrt(G) in magnitude (3.18 for
    G = 12), so with non-negative weights a clip of 5 only binds for G >= 28.

    NaN policy as grpo.rewards.mixing.mix: a non-finite score makes its whole group's advantages non-finite, even
    with a zero weight, so the caller can drop the group.

    Args:
        components: [N, R] raw scores, one column per reward, gathered over all ranks.
        weights: [R] reward weights (any scale: only their ratios count); not all zero.
        group_ids: [N] equal for samples of the same prompt; any values, any order, groups of size >= 2.
        eps: added to each reward's in-group std (MixGRPO: 1e-8).
        clip: clamp of the summed advantage; None disables it.

    Returns:
        advantages: float32 [N] on the components' device.
        stats: as :func:`group_advantages`: zero_std_frac (fraction of groups whose advantages are all exactly 0:
            every weighted reward constant there), reward_std_in_group_mean (mean over groups of the unbiased
            in-group std of the weighted reward sum, the reward that is logged).
    """
    if components.ndim != 2 or weights.ndim != 1 or components.shape[1] != weights.shape[0]:
        raise ValueError(f"per_reward_advantages: components must be [N, R] and weights [R], got "
                         f"{tuple(components.shape)} and {tuple(weights.shape)}")
    if group_ids.shape != (components.shape[0],):
        raise ValueError(f"per_reward_advantages: group_ids must be [N] = [{components.shape[0]}], got "
                         f"{tuple(group_ids.shape)}")
    x = components.float()
    w = weights.to(device=x.device, dtype=torch.float32)
    total = w.abs().sum()
    if not bool(total > 0):
        raise ValueError("per_reward_advantages: the reward weights are all zero")
    gid = group_ids.to(x.device)
    z = torch.stack([group_advantages(x[:, r], gid, clip=None, eps=eps)[0] for r in range(x.shape[1])], dim=1)
    # A plain sum of products, not a matmul: NaN * 0 stays NaN, and no BLAS path may skip zero weights.
    adv = (z * (w / total)).sum(dim=1)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    _, dense = torch.unique(gid, return_inverse=True)
    nonzero = torch.zeros(int(dense.max()) + 1, device=x.device).index_add_(0, dense, (adv != 0).float())
    mixed_stats = group_advantages((x * w).sum(dim=1), gid, clip=None, eps=eps)[1]
    stats = {
        "zero_std_frac": (nonzero == 0).float().mean().detach(),
        "reward_std_in_group_mean": mixed_stats["reward_std_in_group_mean"],
    }
    return adv, stats
