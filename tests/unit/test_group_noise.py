"""nft/awm's `group_noise`: a group's images share their forward-process noise at a point (common random numbers).

Each image's noise is still the pure function of (seed, step, key, point) that resume and 1 vs N processes rely on;
only the key changes (its group instead of itself). What it buys, exactly: the group's advantages sum to zero, so
when the images share x_t's noise and t, whatever part of their gradients does not depend on their own x0 cancels.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo.config import load_config
from grpo.data import matching_noise
from grpo.matching import awm_loss
from grpo.objectives import objective_of
from tests.unit.test_rollout_plan import TINY_PRESETS

SHAPE = (4, 8, 8)  # one image's latents (C, H, W)


def _noised(preset: str, group_noise: bool, ids: list[int], x0: torch.Tensor, step: int = 3, point: int = 2):
    cfg = load_config(TINY_PRESETS / preset, [f"{preset.split('_')[0]}.group_noise={str(group_noise).lower()}"])
    objective = objective_of(cfg)
    models = SimpleNamespace(sampler=SimpleNamespace(sigmas=torch.linspace(1.0, 0.0, cfg.sampling.num_steps + 1)))
    chunk = SimpleNamespace(ids=ids, trained=[point], traj=SimpleNamespace(x0=x0), noised={})
    objective._noise_clean_samples(models, [chunk], step)
    x_t, eps = chunk.noised[point]
    return cfg, x_t, eps


@pytest.mark.parametrize("preset", ["awm_lora.yaml", "nft_lora.yaml"])
def test_a_group_shares_its_noise_and_the_draw_is_the_groups(preset):
    ids = list(range(8, 16))  # two groups of 4 (group_size 4): 2 and 3
    x0 = torch.randn(len(ids), *SHAPE, generator=torch.Generator().manual_seed(0))
    cfg, x_t, eps = _noised(preset, True, ids, x0)
    g = cfg.sampling.group_size
    assert g == 4
    for k, i in enumerate(ids):
        expected = matching_noise(SHAPE, cfg.seed, 3, i // g, 2, cfg.sampling.num_steps)
        assert torch.equal(eps[k], expected)
    assert torch.equal(eps[0], eps[3]) and torch.equal(eps[4], eps[7]) and not torch.equal(eps[0], eps[4])
    t = float(torch.linspace(1.0, 0.0, cfg.sampling.num_steps + 1)[2])
    torch.testing.assert_close(x_t, (1 - t) * x0 + t * eps)

    # Off (the sources' way): one noise per image, keyed on the image, as before the setting existed.
    _, _, own = _noised(preset, False, ids, x0)
    for k, i in enumerate(ids):
        assert torch.equal(own[k], matching_noise(SHAPE, cfg.seed, 3, i, 2, cfg.sampling.num_steps))
    assert len({tuple(r.flatten()[:4].tolist()) for r in own}) == len(ids)


def test_what_does_not_depend_on_the_image_cancels_across_the_group():
    """Four identical clean images with advantages summing to zero: the AWM gradient is exactly what their
    difference gives, zero, when they share the noise; with one noise each, the noise alone moves the model."""
    torch.manual_seed(0)
    x0 = torch.randn(1, *SHAPE).expand(4, *SHAPE).contiguous()
    adv = torch.tensor([0.2, -0.2, 0.4, -0.4])  # AWM's scaled advantages of one group: zero sum
    norms = {}
    for group_noise in (True, False):
        _, x_t, eps = _noised("awm_lora.yaml", group_noise, [0, 1, 2, 3], x0)
        model = torch.nn.Conv2d(SHAPE[0], SHAPE[0], 3, padding=1)
        with torch.no_grad():
            model.weight.copy_(torch.randn(model.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
        t = torch.full((4,), 0.75)
        loss, _ = awm_loss(model(x_t), x0, eps, t, adv, 0.25)
        loss.backward()
        norms[group_noise] = float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    assert norms[False] > 1e-3
    assert norms[True] <= 1e-6 * norms[False]
