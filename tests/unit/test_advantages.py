"""Group advantages against a plain python reference."""

import statistics

import pytest
import torch

from grpo.advantages import group_advantages
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
