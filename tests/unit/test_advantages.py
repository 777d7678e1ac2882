"""Group advantages against a plain python reference; MixGRPO's per-reward advantages against its own lines."""

import statistics

import numpy as np
import pytest
import torch

from grpo.advantages import group_advantages, per_reward_advantages
from grpo.errors import ConfigError


def _reference(rewards, group_ids, std_scope="group", clip=5.0, eps=1e-4):
    r, ids = rewards.tolist(), group_ids.tolist()
    groups = {}
    for value, gid in zip(r, ids):
        groups.setdefault(gid, []).append(value)
    batch_std = statistics.stdev(r)
    out = []
    for value, gid in zip(r, ids):
        members = groups[gid]
        if max(members) == min(members):
            out.append(0.0)
            continue
        std = statistics.stdev(members) if std_scope == "group" else batch_std
        a = (value - statistics.fmean(members)) / (std + eps)
        out.append(a if clip is None else max(-clip, min(clip, a)))
    stds = [statistics.stdev(m) for m in groups.values()]
    zero = sum(max(m) == min(m) for m in groups.values()) / len(groups)
    return torch.tensor(out), zero, sum(stds) / len(stds)


def _random_batch(seed=0, num_groups=7):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 6, (num_groups,), generator=g).tolist()
    labels = torch.randperm(1000, generator=g)[:num_groups] * 13  # arbitrary, sparse labels
    ids = torch.cat([torch.full((n,), int(lbl)) for n, lbl in zip(sizes, labels)])
    perm = torch.randperm(len(ids), generator=g)  # non-contiguous groups
    rewards = torch.rand(len(ids), generator=g)
    return rewards, ids[perm].long()


@pytest.mark.parametrize("std_scope", ["group", "batch"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_python_reference(std_scope, seed):
    rewards, ids = _random_batch(seed)
    adv, stats = group_advantages(rewards, ids, std_scope=std_scope, clip=None)
    ref, zero, std_mean = _reference(rewards, ids, std_scope, clip=None)
    assert adv.dtype == torch.float32 and adv.shape == rewards.shape
    torch.testing.assert_close(adv, ref, atol=1e-5, rtol=1e-5)
    assert stats["zero_std_frac"].item() == pytest.approx(zero)
    assert stats["reward_std_in_group_mean"].item() == pytest.approx(std_mean, rel=1e-5)


def test_zero_std_groups_are_exactly_zero():
    # 0.1 three times: its float32 mean is not exactly 0.1, the advantage must still be 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.9, 0.7, 0.7])
    ids = torch.tensor([4, 4, 4, 9, 9, 2, 2])
    for scope in ("group", "batch"):
        adv, stats = group_advantages(rewards, ids, std_scope=scope)
        assert torch.equal(adv[[0, 1, 2, 5, 6]], torch.zeros(5))
        assert (adv[3] < 0) and (adv[4] > 0)
        assert stats["zero_std_frac"].item() == pytest.approx(2 / 3)
    adv, _ = group_advantages(torch.full((6,), 0.5), torch.tensor([0, 0, 0, 1, 1, 1]))
    assert torch.equal(adv, torch.zeros(6))


def test_group_closed_form_and_clipping():
    # Pair {0, 1}: mean 0.5, unbiased std sqrt(0.5) -> A = ±0.5/(sqrt(0.5)+eps).
    rewards = torch.tensor([0.0, 1.0])
    ids = torch.tensor([3, 3])
    adv, _ = group_advantages(rewards, ids, eps=0.0, clip=None)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0]) * 0.5 / 0.5**0.5)
    adv, _ = group_advantages(rewards, ids, eps=0.0, clip=0.5)
    assert torch.equal(adv, torch.tensor([-0.5, 0.5]))
    # One outlier in a big group is clipped at 5 (unclipped ≈ 5.8 with 40 members).
    rewards = torch.zeros(40)
    rewards[0] = 1.0
    adv, _ = group_advantages(rewards, torch.zeros(40, dtype=torch.long))
    unclipped, _ = group_advantages(rewards, torch.zeros(40, dtype=torch.long), clip=None)
    assert unclipped[0] > 5.0 and adv[0].item() == 5.0
    torch.testing.assert_close(adv[1:], unclipped[1:])


def test_batch_scope_uses_global_std():
    rewards = torch.tensor([0.0, 1.0, 10.0, 30.0])
    ids = torch.tensor([0, 0, 1, 1])
    adv, _ = group_advantages(rewards, ids, std_scope="batch", eps=0.0, clip=None)
    std = rewards.std()
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -10.0, 10.0]) / std)


@pytest.mark.parametrize("std_scope", ["group", "batch"])
def test_permutation_invariance(std_scope):
    rewards, ids = _random_batch(5)
    adv, _ = group_advantages(rewards, ids, std_scope=std_scope)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(6))
    adv_p, _ = group_advantages(rewards[perm], ids[perm], std_scope=std_scope)
    torch.testing.assert_close(adv_p, adv[perm], atol=1e-6, rtol=1e-6)


def test_inputs_in_other_dtypes_give_float32():
    rewards, ids = _random_batch(3)
    adv, _ = group_advantages(rewards.bfloat16(), ids)
    assert adv.dtype == torch.float32


def test_errors():
    with pytest.raises(ConfigError, match="std_scope"):
        group_advantages(torch.rand(4), torch.tensor([0, 0, 1, 1]), std_scope="global")
    with pytest.raises(ValueError, match=">= 2"):
        group_advantages(torch.rand(3), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match=r"\[N\]"):
        group_advantages(torch.rand(4), torch.tensor([0, 0, 1]))


# ---------------------------------------------------------------------------------------------------------------
# per_reward_advantages against a direct transcription of MixGRPO@e5cdd6a fastvideo/train_grpo_flux.py.


def _mixgrpo_reference(rewards: dict, weights: dict, num_generations: int, adv_clip_max: float) -> np.ndarray:
    """MixGRPO's "advantage_aggr" (:428-456), weight normalisation (:764-767) and loss-time clamp (:567-571), in
    numpy float32 as its torch float32 code: contiguous groups, torch .std() = ddof 1, + 1e-8."""
    total_weight = sum(weights.values())
    reward_weights = {k: v / total_weight for k, v in weights.items()}
    model_advantages = {}
    for model_name, model_rewards in rewards.items():
        n = len(model_rewards) // num_generations
        advantages = np.zeros_like(model_rewards)
        for i in range(n):
            start_idx, end_idx = i * num_generations, (i + 1) * num_generations
            group_rewards = model_rewards[start_idx:end_idx]
            group_mean = group_rewards.mean()
            group_std = group_rewards.std(ddof=1) + np.float32(1e-8)
            advantages[start_idx:end_idx] += (group_rewards - group_mean) / group_std
        model_advantages[model_name] = advantages
    merged_advantages = np.zeros_like(next(iter(rewards.values())))
    for model_name, model_advs in model_advantages.items():
        merged_advantages += model_advs * np.float32(reward_weights[model_name])
    return np.clip(merged_advantages, -adv_clip_max, adv_clip_max)


def _three_rewards(seed: int, groups: int = 4, g: int = 12) -> dict:
    rng = np.random.default_rng(seed)  # HPS-, ImageReward- and PickScore-like spreads
    return {"hps": (0.30 + 0.01 * rng.standard_normal(groups * g)).astype(np.float32),
            "image_reward": (0.5 + 1.0 * rng.standard_normal(groups * g)).astype(np.float32),
            "pick_score": (21.0 + 0.5 * rng.standard_normal(groups * g)).astype(np.float32)}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("clip", [5.0, 0.5])
def test_per_reward_matches_mixgrpo(seed, clip):
    rewards = _three_rewards(seed)
    weights = {"hps": 1.0, "image_reward": 1.0, "pick_score": 1.0}  # MixGRPO's script: all 1 -> 1/3 each
    ref = _mixgrpo_reference(rewards, weights, 12, clip)
    comps = torch.from_numpy(np.stack(list(rewards.values()), axis=1))
    ids = torch.arange(48) // 12
    adv, stats = per_reward_advantages(comps, torch.tensor(list(weights.values())), ids, eps=1e-8, clip=clip)
    assert adv.dtype == torch.float32 and adv.shape == (48,)
    torch.testing.assert_close(adv, torch.from_numpy(ref), atol=1e-5, rtol=1e-5)
    assert set(stats) == set(group_advantages(comps[:, 0], ids)[1])
    if clip == 0.5:
        assert (adv.abs() == 0.5).any()  # the clamp binds on the summed advantage


def test_per_reward_is_not_normalised_again_and_ignores_weight_scale():
    rewards = _three_rewards(2)
    comps = torch.from_numpy(np.stack(list(rewards.values()), axis=1))
    ids = torch.arange(48) // 12
    w = torch.tensor([2.0, 1.0, 1.0])
    adv, _ = per_reward_advantages(comps, w, ids, eps=1e-8, clip=None)
    # Not re-standardised: a mean of z-scores has an in-group std below 1 (what the old path renormalised away).
    assert (adv.reshape(4, 12).std(dim=1) < 0.95).all()
    # Only the weights' ratios count (MixGRPO divides them by their sum).
    torch.testing.assert_close(per_reward_advantages(comps, 10 * w, ids, eps=1e-8, clip=None)[0], adv)
    # One reward: exactly group_advantages' in-group z-score with the same eps.
    one, _ = per_reward_advantages(comps[:, :1], torch.tensor([3.0]), ids, eps=1e-8, clip=5.0)
    torch.testing.assert_close(one, group_advantages(comps[:, 0], ids, eps=1e-8, clip=5.0)[0])


def test_per_reward_groups_in_any_order_and_constant_rewards():
    rewards, ids = _random_batch(4)
    comps = torch.stack([rewards, rewards**2, torch.ones_like(rewards)], dim=1)  # a reward constant everywhere
    w = torch.tensor([1.0, 0.5, 1.0])
    adv, stats = per_reward_advantages(comps, w, ids, eps=1e-8, clip=None)
    expected = sum(w[r] / w.sum() * group_advantages(comps[:, r], ids, eps=1e-8, clip=None)[0] for r in range(3))
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=1e-6)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1))
    adv_p, _ = per_reward_advantages(comps[perm], w, ids[perm], eps=1e-8, clip=None)
    torch.testing.assert_close(adv_p, adv[perm], atol=1e-6, rtol=1e-6)
    assert stats["zero_std_frac"].item() == 0.0
    # A group where every weighted reward is constant: exactly 0 there (MixGRPO would divide rounding noise by
    # 1e-8), counted in zero_std_frac; a zero-weight reward does not count.
    comps = torch.tensor([[0.1, 5.0, 1.0], [0.1, 5.0, 2.0], [0.1, 5.0, 3.0], [0.2, 1.0, 0.0], [0.4, 3.0, 0.0],
                          [0.35, 2.5, 0.0]])
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, stats = per_reward_advantages(comps, torch.tensor([1.0, 1.0, 0.0]), ids, eps=1e-8, clip=5.0)
    assert torch.equal(adv[:3], torch.zeros(3)) and (adv[3:] != 0).all()
    assert stats["zero_std_frac"].item() == 0.5
    mixed = comps[:, 0] + comps[:, 1]  # the logged reward's in-group std
    assert stats["reward_std_in_group_mean"].item() == pytest.approx(
        group_advantages(mixed, ids)[1]["reward_std_in_group_mean"].item())


def test_per_reward_nan_spreads_to_its_group_only():
    comps = torch.tensor([[1.0, 0.0], [float("nan"), 1.0], [3.0, 2.0], [1.0, 0.0], [2.0, 5.0], [3.0, 1.0]])
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    for w in (torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])):  # a zero weight does not hide the NaN
        adv, _ = per_reward_advantages(comps, w, ids, eps=1e-8, clip=5.0)
        assert torch.isnan(adv[:3]).all() and torch.isfinite(adv[3:]).all()


def test_per_reward_errors():
    ids = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"\[N, R\]"):
        per_reward_advantages(torch.rand(4, 2), torch.ones(3), ids, eps=1e-8, clip=5.0)
    with pytest.raises(ValueError, match="group_ids"):
        per_reward_advantages(torch.rand(4, 2), torch.ones(2), ids[:3], eps=1e-8, clip=5.0)
    with pytest.raises(ValueError, match="all zero"):
        per_reward_advantages(torch.rand(4, 2), torch.zeros(2), ids, eps=1e-8, clip=5.0)
    with pytest.raises(ValueError, match=">= 2"):
        per_reward_advantages(torch.rand(3, 1), torch.ones(1), torch.tensor([0, 0, 1]), eps=1e-8, clip=5.0)
