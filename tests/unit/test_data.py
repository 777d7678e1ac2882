"""Prompt schedule and random streams: pure functions of (seed, step, index)."""

import pytest
import torch

from grpo.data import TIMESTEPS, drawable_points, generator, initial_noise, prompts_for_step, trained_steps
from grpo.errors import ConfigError


def test_prompts_cover_each_epoch_once():
    seen = [i for step in range(9) for i in prompts_for_step(12, 4, seed=1, step=step)]
    for epoch in range(3):
        assert sorted(seen[epoch * 12:(epoch + 1) * 12]) == list(range(12))


def test_prompts_cross_epoch_boundary_and_are_deterministic():
    a = prompts_for_step(10, 4, seed=3, step=2)  # positions 8..11 straddle epochs 0 and 1
    assert a == prompts_for_step(10, 4, seed=3, step=2)
    assert len(a) == 4
    assert prompts_for_step(10, 4, seed=4, step=2) != a or prompts_for_step(10, 4, seed=4, step=0) != \
        prompts_for_step(10, 4, seed=3, step=0)


def test_streams_are_independent_and_reproducible():
    x = initial_noise((2, 3), seed=0, step=1, index=5)
    assert torch.equal(x, initial_noise((2, 3), seed=0, step=1, index=5))
    assert not torch.equal(x, initial_noise((2, 3), seed=0, step=1, index=6))
    assert not torch.equal(x, initial_noise((2, 3), seed=0, step=2, index=5))
    assert generator(0, 0, 0, 0).initial_seed() != generator(0, 0, 0, 1).initial_seed()


def test_trained_steps():
    s = trained_steps(15, 9, seed=0, step=0, chunk_id=0)
    assert len(s) == 9 and len(set(s)) == 9 and s == sorted(s) and max(s) < 15
    draws = {tuple(trained_steps(15, 9, seed=0, step=0, chunk_id=c)) for c in range(20)}
    assert len(draws) > 1


def test_trained_steps_uniform_default_is_unchanged():
    # The numbers the uniform draw gave before the AWM draws existed: randperm of the TIMESTEPS stream, first k.
    for n, k, chunk in [(15, 9, 0), (10, 4, 7), (6, 2, 3)]:
        perm = torch.randperm(n, generator=generator(5, 11, chunk, TIMESTEPS))
        expected = sorted(perm[:k].tolist())
        assert trained_steps(n, k, seed=5, step=11, chunk_id=chunk) == expected
        assert trained_steps(n, k, seed=5, step=11, chunk_id=chunk, draw="uniform") == expected
    assert drawable_points(10, "uniform") == range(10)


def _awm_reference(num_steps: int, train_timesteps: int, rand_u: torch.Tensor, with_zero: bool) -> list[int]:
    """advantage_weighted_matching@be51372 scripts/train_sd3_awm.py:1172-1176 (discrete) / 1197-1202
    (discrete_wo_init), timestep_fraction 0.9, with its torch.rand draw passed in."""
    boundaries = torch.linspace(0 if with_zero else 1, int(num_steps * 0.9), steps=train_timesteps + 1)
    lower_bounds = boundaries[:-1].long()
    upper_bounds = boundaries[1:].long()
    t_indices = lower_bounds + (rand_u * (upper_bounds - lower_bounds)).long()
    return t_indices.tolist()


@pytest.mark.parametrize("draw", ["discrete", "discrete_wo_init"])
@pytest.mark.parametrize("n, k", [(14, 6), (10, 4), (6, 2), (25, 8), (40, 35)])
def test_trained_steps_awm_matches_source(draw, n, k):
    for chunk in range(30):
        u = torch.rand(k, generator=generator(0, 3, chunk, TIMESTEPS))
        s = trained_steps(n, k, seed=0, step=3, chunk_id=chunk, draw=draw)
        assert s == _awm_reference(n, k, u, with_zero=draw == "discrete")
        assert s == sorted(set(s)) and len(s) == k  # distinct, increasing
        assert set(s) <= set(drawable_points(n, draw))


def test_awm_draw_ranges_and_strata():
    # AWM's configs: 14 steps, 6 noise levels, fraction 0.9 -> points 1..11 (never 0, 12, 13), one per stratum.
    assert drawable_points(14, "discrete_wo_init") == range(1, 12)
    assert drawable_points(14, "discrete") == range(0, 12)
    strata = [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]
    seen = [set() for _ in strata]
    for chunk in range(200):
        for i, j in enumerate(trained_steps(14, 6, seed=1, step=0, chunk_id=chunk, draw="discrete_wo_init")):
            assert j in strata[i]
            seen[i].add(j)
    assert seen == strata
    # The FLUX.1-dev awm preset (10 steps, 4 levels) and the tiny one (6 steps, 2 levels).
    assert drawable_points(10, "discrete_wo_init") == range(1, 9)
    assert {j for c in range(200) for j in trained_steps(10, 4, 1, 0, c, draw="discrete_wo_init")} == set(range(1, 9))
    assert {j for c in range(200) for j in trained_steps(6, 2, 1, 0, c, draw="discrete_wo_init")} == set(range(1, 5))
    assert 0 in {j for c in range(200) for j in trained_steps(14, 6, 1, 0, c, draw="discrete")}


def test_awm_draw_errors():
    with pytest.raises(ConfigError, match="do not fit"):
        trained_steps(6, 5, seed=0, step=0, chunk_id=0, draw="discrete_wo_init")  # 4 points: 1..4
    with pytest.raises(ConfigError, match="unknown value"):
        trained_steps(6, 2, seed=0, step=0, chunk_id=0, draw="logit_normal")
    assert len(trained_steps(6, 4, seed=0, step=0, chunk_id=0, draw="discrete_wo_init")) == 4
