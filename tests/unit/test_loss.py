"""PPO-clip GRPO loss: closed forms and gradients."""

import math

import pytest
import torch

from grpo.loss import grpo_loss

EPS = 1e-4


def test_ratio_one_gives_minus_mean_advantage():
    lp = torch.tensor([-1.2, 0.3, 2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])
    loss, stats = grpo_loss(lp, lp.detach().clone(), adv, clip_range=EPS)
    assert loss.item() == pytest.approx(-adv.mean().item())
    assert torch.equal(stats["ratio"], torch.ones(4))
    assert stats["clip_frac"].item() == 0.0 and stats["approx_kl"].item() == 0.0
    assert stats["kl"].item() == 0.0
    loss.backward()
    # d loss / d logp = -A / B at ratio 1.
    torch.testing.assert_close(lp.grad, -adv / 4)


def test_closed_form_values_and_stats():
    old = torch.zeros(4)
    d = torch.tensor([0.5e-4, 3e-4, -3e-4, 2e-4])  # log-ratios
    adv = torch.tensor([2.0, 1.0, 1.0, -1.0])
    loss, stats = grpo_loss(old + d, old, adv, clip_range=EPS)
    r = [math.exp(x) for x in d.tolist()]
    clip = [min(max(x, 1 - EPS), 1 + EPS) for x in r]
    per = [max(-a * x, -a * c) for a, x, c in zip(adv.tolist(), r, clip)]
    assert loss.item() == pytest.approx(sum(per) / 4, rel=1e-6)
    assert stats["policy_loss"].item() == pytest.approx(sum(per) / 4, rel=1e-6)
    torch.testing.assert_close(stats["ratio"], torch.tensor(r))
    assert stats["clip_frac"].item() == pytest.approx(3 / 4)
    assert stats["approx_kl"].item() == pytest.approx(0.5 * sum(x * x for x in d.tolist()) / 4, rel=1e-5)
    # Sample 1 (A>0, r>1+eps) is held at the clipped value; sample 2 (A>0, r<1-eps) keeps its unclipped value.
    assert per[1] == pytest.approx(-(1 + EPS)) and per[2] == pytest.approx(-r[2])


def test_positive_advantage_raises_log_prob():
    lp = torch.tensor([0.1, 0.2], requires_grad=True)
    adv = torch.tensor([1.5, -1.5])
    loss, _ = grpo_loss(lp, lp.detach(), adv, clip_range=0.2)
    loss.backward()
    # Gradient descent moves log-prob up for A > 0 and down for A < 0.
    assert lp.grad[0] < 0 and lp.grad[1] > 0


def test_clipped_samples_have_zero_gradient():
    old = torch.zeros(4)
    d = torch.tensor([5e-4, -5e-4, -5e-4, 5e-4])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    lp = (old + d).requires_grad_(True)
    loss, stats = grpo_loss(lp, old, adv, clip_range=EPS)
    loss.backward()
    # A>0 & r>1+eps and A<0 & r<1-eps: the clipped term wins -> no gradient.
    assert lp.grad[0].item() == 0.0 and lp.grad[1].item() == 0.0
    # The pessimistic side keeps its gradient: -A·r/B.
    ratio = stats["ratio"]
    torch.testing.assert_close(lp.grad[2:], -adv[2:] * ratio[2:] / 4)


def test_kl_term_is_added_with_its_gradient():
    lp = torch.tensor([0.0, 0.0], requires_grad=True)
    kl = torch.tensor([0.2, 0.6], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(lp, lp.detach(), adv, clip_range=EPS, kl=kl, kl_coef=0.5)
    assert loss.item() == pytest.approx(0.0 + 0.5 * 0.4)
    assert stats["kl"].item() == pytest.approx(0.4)
    assert stats["policy_loss"].item() == pytest.approx(0.0)
    loss.backward()
    torch.testing.assert_close(kl.grad, torch.tensor([0.25, 0.25]))


def test_old_log_prob_and_advantages_get_no_gradient_and_float32():
    lp = torch.tensor([0.1, 0.2], dtype=torch.bfloat16, requires_grad=True)
    old = torch.tensor([0.1, 0.25], requires_grad=True)
    adv = torch.tensor([1.0, 1.0], requires_grad=True)
    loss, stats = grpo_loss(lp, old, adv, clip_range=0.2)
    assert loss.dtype == torch.float32 and stats["ratio"].dtype == torch.float32
    loss.backward()
    assert old.grad is None and adv.grad is None and lp.grad is not None
    assert all(not v.requires_grad for v in stats.values())
