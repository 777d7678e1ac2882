"""Reward models for GRPO on text-to-image models: a registry, start-up checks, loading, mixing.

Interface used by the recipe::

    check_rewards(cfg.rewards)                       # at start-up, before any model is built
    rewards = build_rewards(cfg.rewards, device)     # once per rank, outside deepspeed.zero.Init
    with rewards.on_device():                        # loads / offloads rewards with `offload: true`
        comps = rewards(images, prompts, metadata)   # [B, R] raw scores of this rank's images (metadata: one
                                                     # dict per image, its dataset row's other fields, or None)
    comps = gather_by_index(comps, index, total)     # all ranks: groups may span ranks
    bad = finite_check(comps, rewards.names)         # log reward/<name>_nonfinite; skip non-finite groups
    reward = mix(comps, rewards.weights, group_ids, normalize_per_group)

Registered names: hpsv2, pickscore, clip_score, aesthetic, imagereward, hpsv3, tiny_world, tiny_world_meta, jpeg_compressibility,
jpeg_incompressibility, remote (a reward served by `python -m tools.rewards serve`), vlm_judge (a VLM behind an
OpenAI-compatible chat API); "pkg.module:factory" adds your own. `python -m tools.rewards --list` shows every option.
"""

from grpo.rewards.base import ModelReward, Reward
from grpo.rewards.mixing import finite_check, mix
from grpo.rewards.registry import (REGISTRY, Rewards, build_rewards, check_reward_metadata, check_rewards,
                                   normalize_spec, reward_class)

__all__ = [
    "REGISTRY",
    "Reward",
    "ModelReward",
    "Rewards",
    "build_rewards",
    "check_reward_metadata",
    "check_rewards",
    "finite_check",
    "mix",
    "normalize_spec",
    "reward_class",
]
