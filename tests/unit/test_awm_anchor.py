"""AWM's anchor to the lagging policy (awm.anchor_coef): on, one no-grad forward of the lagging policy per trained
point and the anchor term in the loss; 0, neither (as the source: train_sd3_awm.py:1276, `if config.train.ema_beta >
0`), and the cost model counts one forward less. The transformer calls are counted, not assumed."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.matching import awm_loss, velocity_mse
from grpo.objectives import objective_of
from grpo.rollout_plan import RolloutPlan
from tests.unit.test_rollout_plan import TINY_PRESETS

SHAPE = (4, 8, 8)


class Counting(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.conv, self.calls = torch.nn.Conv2d(SHAPE[0], SHAPE[0], 3, padding=1), 0
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape,
                                               generator=torch.Generator().manual_seed(seed)) * 0.1)

    def forward(self, x):
        self.calls += 1
        return self.conv(x)


def _step(anchor_coef: float):
    """fixed_targets and the loss of one micro-batch of 4 images at one trained point, with counted forwards."""
    cfg = load_config(TINY_PRESETS / "awm_lora.yaml", [f"awm.anchor_coef={anchor_coef}", "awm.timesteps=1"])
    objective = objective_of(cfg)
    policy, lagging = Counting(0), Counting(1)  # the lagging weights differ: the anchor is not zero

    @contextlib.contextmanager
    def inference(reference: bool = False):
        assert not reference  # kl_coef 0: no reference forward either
        yield lagging

    sampler = SimpleNamespace(sigmas=torch.linspace(1.0, 0.0, cfg.sampling.num_steps + 1),
                              velocity_at=lambda model, x, j, cond: model(x))
    models = SimpleNamespace(engine=policy, sampler=sampler, inference=inference,
                             lagging=SimpleNamespace(applied=contextlib.nullcontext))
    x0 = torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(2))
    chunk = SimpleNamespace(ids=[0, 1, 2, 3], trained=[2], traj=SimpleNamespace(x0=x0), noised={}, lagging={},
                            reference={}, cond=None)
    objective.fixed_targets(models, [chunk], step=5)
    no_grad_calls = lagging.calls
    adv = torch.tensor([2.0, -1.0, 0.5, -1.5])
    loss, stats = objective.loss(models, chunk, 2, adv)
    x_t, eps = chunk.noised[2]
    t = sampler.sigmas[2].expand(4)
    with torch.no_grad():
        matching, _ = awm_loss(policy.conv(x_t), x0, eps, t, adv / cfg.advantage.clip, cfg.awm.huber_p)
        anchor = velocity_mse(policy.conv(x_t), lagging.conv(x_t)).mean()
    return cfg, objective, no_grad_calls, float(loss.detach()), stats, float(matching), float(anchor)


def test_the_anchor_costs_one_forward_a_point_and_adds_its_term():
    cfg, objective, calls, loss, stats, matching, anchor = _step(0.1)
    assert calls == 1 and anchor > 0
    assert loss == pytest.approx(matching + 0.1 * anchor, rel=1e-6)
    assert float(stats["anchor"]) == pytest.approx(anchor, rel=1e-6)
    assert objective.forwards_per_point() == 3 + calls
    assert objective.plan_terms().latents_per_point == 3 and objective.plan_terms().reference_phase


def test_no_anchor_no_lagging_forward_and_the_plain_awm_loss():
    cfg, objective, calls, loss, stats, matching, _ = _step(0.0)
    assert calls == 0
    assert loss == pytest.approx(matching, rel=1e-6) and "anchor" not in stats
    assert objective.forwards_per_point() == 3 + calls
    terms = objective.plan_terms()
    assert terms.latents_per_point == 2 and not terms.reference_phase and terms.lagging_average
    # the step's cost: 6 rollout steps + 1 point x 3, against 10 with the anchor
    assert RolloutPlan.of(cfg).forwards_per_image(0) == 9


def test_a_negative_anchor_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"awm.anchor_coef: -0.1; use 0 \(no anchor\) or a positive number"):
        load_config(TINY_PRESETS / "awm_lora.yaml", ["awm.anchor_coef=-0.1"])
