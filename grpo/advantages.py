"""Group-relative advantages: each reward compared with the other samples of the same prompt (DanceGRPO
fastvideo/train_grpo_flux.py --use_group, Flow-GRPO flow_grpo/stat_tracking.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.errors import ConfigError

__all__ = ["group_advantages"]

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
