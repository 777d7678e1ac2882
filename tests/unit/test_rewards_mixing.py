"""Weighted mixing, per-group normalisation and non-finite detection (grpo.rewards.mixing)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.rewards import finite_check, mix


def _naive_normalized(col: list[float], groups: list[int], eps: float) -> list[float]:
    """Reference: per group, (x - mean) / (unbiased std + eps), 0 for a group of equal values."""
    out = [0.0] * len(col)
    for g in set(groups):
        idx = [i for i, k in enumerate(groups) if k == g]
        vals = [col[i] for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in idx:
            out[i] = 0.0 if max(vals) == min(vals) else (col[i] - mean) / (std + eps)
    return out


def test_weighted_sum_closed_form() -> None:
    comps = torch.tensor([[0.3, 5.0, -1.0], [0.1, 2.0, 4.0]])
    w = torch.tensor([2.0, 0.5, -1.0])
    # Row 0: 0.6 + 2.5 + 1.0; row 1: 0.2 + 1.0 - 4.0.
    torch.testing.assert_close(mix(comps, w), torch.tensor([4.1, -2.8]))


def test_zero_weight_keeps_nan() -> None:
    # A zero weight must not hide a NaN in that component: the caller has to see it (and skip the sample).
    out = mix(torch.tensor([[1.0, float("nan")], [1.0, 2.0]]), torch.tensor([1.0, 0.0]))
    assert torch.isnan(out[0]) and out[1] == 1.0


def test_per_group_normalisation_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    groups = [3, 3, 3, 7, 7, 7, 7, 1, 1]  # arbitrary labels, unequal sizes, interleaved order below
    order = torch.randperm(len(groups), generator=g)
    group_ids = torch.tensor(groups)[order]
    comps = torch.stack([torch.rand(9, generator=g) * 0.1 + 0.3, torch.rand(9, generator=g) * 50.0], dim=1)
    comps[group_ids == 1, 1] = 4.0  # a group where one reward is constant -> exactly 0
    w = torch.tensor([1.0, 0.25])
    eps = 1e-4
    expected = torch.zeros(9)
    for r in range(2):
        col = _naive_normalized(comps[:, r].tolist(), group_ids.tolist(), eps)
        expected += w[r] * torch.tensor(col)
    out = mix(comps, w, group_ids, normalize_per_group=True, eps=eps)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Normalised components are scale-free: rescaling one reward changes nothing.
    scaled = comps * torch.tensor([100.0, 0.01])
    torch.testing.assert_close(mix(scaled, w, group_ids, normalize_per_group=True, eps=0.0),
                               mix(comps, w, group_ids, normalize_per_group=True, eps=0.0), atol=1e-4, rtol=1e-4)


def test_per_group_nan_spreads_to_its_group_only() -> None:
    comps = torch.tensor([[1.0], [float("nan")], [3.0], [1.0], [2.0], [3.0]])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    out = mix(comps, torch.tensor([1.0]), group_ids, normalize_per_group=True)
    assert torch.isnan(out[:3]).all()
    assert torch.isfinite(out[3:]).all()
    inf = mix(torch.tensor([[float("inf")], [1.0], [1.0], [2.0]]), torch.tensor([1.0]), torch.tensor([0, 0, 1, 1]),
              normalize_per_group=True)
    assert not torch.isfinite(inf[:2]).any() and torch.isfinite(inf[2:]).all()


def test_mix_argument_errors() -> None:
    with pytest.raises(ValueError, match="group_ids"):
        mix(torch.zeros(4, 2), torch.ones(2), normalize_per_group=True)
    with pytest.raises(ValueError, match=r"\[N, R\]"):
        mix(torch.zeros(4, 2), torch.ones(3))


def test_finite_check_counts_per_reward() -> None:
    comps = torch.tensor([[1.0, float("nan"), 0.0], [float("inf"), float("nan"), 1.0], [-float("inf"), 2.0, 3.0]])
    assert finite_check(comps, ["hpsv2", "pickscore", "jpeg"]) == {"hpsv2": 2, "pickscore": 2, "jpeg": 0}
    with pytest.raises(ValueError):
        finite_check(comps, ["only_one"])
