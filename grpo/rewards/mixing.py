"""Combining reward components into the scalar reward GRPO uses, and catching non-finite scores.

NaN policy: nothing here hides a NaN. `finite_check` counts non-finite scores per reward for the log, and `mix`
propagates them: a non-finite component makes that sample's mixed reward non-finite, and with per-group
normalisation the whole group's (its mean and std are non-finite), so the caller can drop those groups or skip the
step. Averaging with nanmean would silently train on a reward the model never produced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grpo.advantages import group_advantages

__all__ = ["mix", "finite_check"]


def mix(
    components: Tensor,
    weights: Tensor,
    group_ids: Tensor | None = None,
    normalize_per_group: bool = False,
    eps: float = 1e-4,
) -> Tensor:
    """Weighted sum of reward components, optionally normalising each within its group first.

    Call it on the components all-gathered over ranks: a group (the G images of one prompt) may span ranks.

    With normalize_per_group each column becomes (x - group mean) / (group std + eps) before weighting (TRL's
    normalize_then_sum), using the same statistics as grpo.advantages.group_advantages (unbiased std, a group of
    equal scores gives exactly 0). This keeps a reward with a large spread (a JPEG size in kB) from drowning one with
    a small spread (a cosine of ~0.3) whatever its weight; without it the raw scales add up (Flow-GRPO's weighted
    "avg", TRL's sum_then_normalize). It is not MixGRPO's "advantage_aggr" when the sum is then normalised again by
    group_advantages: MixGRPO uses the weighted sum of z-scores as the advantage itself
    (grpo.advantages.per_reward_advantages).

    Args:
        components: [N, R] raw scores, one column per reward.
        weights: [R] weights.
        group_ids: [N] group labels (any values); required when normalize_per_group.
        normalize_per_group: normalise each component within its group before weighting.
        eps: added to the group std.

    Returns:
        float32 [N] on the components' device; non-finite where a component is (the whole group when normalising).
    """
    if components.ndim != 2 or weights.ndim != 1 or components.shape[1] != weights.shape[0]:
        raise ValueError(f"mix: components must be [N, R] and weights [R], got {tuple(components.shape)} and "
                         f"{tuple(weights.shape)}")
    x = components.float()
    w = weights.to(device=x.device, dtype=torch.float32)
    if normalize_per_group:
        if group_ids is None or group_ids.shape != (x.shape[0],):
            raise ValueError("mix: normalize_per_group needs group_ids of shape [N]")
        gid = group_ids.to(x.device)
        x = torch.stack([group_advantages(x[:, r], gid, clip=None, eps=eps)[0] for r in range(x.shape[1])], dim=1)
    # A plain sum of products, not a matmul: NaN * 0 stays NaN, and no BLAS path may skip zero weights.
    return (x * w).sum(dim=1)


def finite_check(components: Tensor, names: Sequence[str]) -> dict[str, int]:
    """Number of non-finite (NaN or +-inf) scores per reward.

    Args:
        components: [N, R] raw scores.
        names: the R reward names (Rewards.names).

    Returns:
        {name: count} for every reward, 0 included, so the counts can be logged every step.
    """
    if components.ndim != 2 or components.shape[1] != len(names):
        raise ValueError(f"finite_check: components {tuple(components.shape)} do not match {len(names)} names")
    bad = (~torch.isfinite(components)).sum(dim=0).tolist()
    return {name: int(n) for name, n in zip(names, bad)}
