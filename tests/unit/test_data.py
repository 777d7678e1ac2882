"""Prompt schedule and random streams: pure functions of (seed, step, index)."""

import torch

from grpo.data import generator, initial_noise, prompts_for_step, trained_steps


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
