"""Forward-process objectives (grpo/matching.py) against float64 transcriptions of the official code, and the
behaviours the papers state.

References are transcribed line by line from
- DiffusionNFT: NVlabs/DiffusionNFT@24af555 scripts/train_nft_sd3.py:169-189 (return_decay), :862-960 (loss);
- AWM: scxue/advantage_weighted_matching@be51372 advantage_weighted_matching/scripts/train_sd3_awm.py:237-252
  (compute_log_prob_awm, weighting 'ghuber'), :1292-1329 (advantage scaling, exp_first PPO-clip), :1409-1419 (EMA
  anchor decay), with the config of config/dgx_awm.py (clip_range 1, ghuber_power 0.25, advantage_max 1,
  off_policy False, kl_ema_decay 0.3 'linear').
They run in float64 on the same float32 inputs; grpo/matching.py runs in float32.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo.matching import awm_loss, decay, forward_noise, nft_loss, optimality_weight, velocity_mse

A_MAX = 5.0
SHAPES = [(4, 3, 5, 6), (3, 7, 16)]  # [B, C, H, W] latents and packed FLUX latents [B, L, C]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(shape, seed=0, t=None):
    g = _gen(seed)
    b = shape[0]
    x0 = torch.randn(shape, generator=g)
    eps = torch.randn(shape, generator=g)
    if t is None:
        t = torch.rand(b, generator=g) * 0.9 + 0.05
    v_old = (eps - x0) + 0.3 * torch.randn(shape, generator=g)  # a policy that is off the target
    v_theta = v_old + 0.2 * torch.randn(shape, generator=g)
    adv = torch.randn(b, generator=g) * 4.0
    return x0, eps, t, v_old, v_theta, adv


# ----------------------------------------------------------------------------------------------------------------
# Transcriptions of the official code (float64).


def ref_return_decay(step, decay_type):
    """train_nft_sd3.py:169-189, verbatim."""
    if decay_type == 0:
        flat, uprate, uphold = 0, 0.0, 0.0
    elif decay_type == 1:
        flat, uprate, uphold = 0, 0.001, 0.5
    elif decay_type == 2:
        flat, uprate, uphold = 75, 0.0075, 0.999
    else:
        raise AssertionError
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


def ref_nft(forward_prediction, old_prediction, x0, noise, t, advantages, beta, adv_clip_max):
    """train_nft_sd3.py:862-960 (adv_mode 'all'), float64; returns (policy_loss, positive_loss, negative_loss)."""
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    xt = (1 - t_expanded) * x0 + t_expanded * noise
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    r = torch.clamp(normalized_advantages_clip, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (
            torch.abs(x0_prediction.double() - x0.double()).mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(
                min=0.00001)
        )
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (
            torch.abs(negative_x0_prediction.double() - x0.double()).mean(dim=tuple(range(1, x0.ndim)),
                                                                            keepdim=True).clip(min=0.00001)
        )
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    return policy_loss, positive_loss, negative_loss


def ref_awm_log_prob(noise_pred, timestep, clean_latents, random_noise, ghuber_power):
    """train_sd3_awm.py:237-252 (weighting 'ghuber')."""
    model_output = noise_pred.double()
    log_prob = -(model_output - (random_noise.double() - clean_latents.double())) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    floor = torch.pow(torch.tensor(1e-10, dtype=log_prob.dtype), ghuber_power)
    log_prob = -(torch.pow(-log_prob + 1e-10, ghuber_power) - floor) * timestep.view(-1) / ghuber_power
    return log_prob


def ref_awm_policy_loss(noise_pred, timestep, clean_latents, random_noise, raw_advantages, *, ghuber_power=0.25,
                        adv_clip_max=5.0, advantage_max=1.0, clip_range=1.0):
    """train_sd3_awm.py:1292-1329: on-policy (old_log_probs = log_prob.detach()), loss_type 'exp_first'."""
    log_prob = ref_awm_log_prob(noise_pred, timestep, clean_latents, random_noise, ghuber_power)
    old_log_probs = log_prob.detach()
    advantages = torch.clamp(raw_advantages, -adv_clip_max, adv_clip_max)
    advantages = advantages / adv_clip_max * advantage_max
    ratio = torch.exp(log_prob - old_log_probs.detach())
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss)), log_prob, advantages


def _leaf64(x):
    return x.detach().double().requires_grad_(True)


def _leaf32(x):
    return x.detach().float().clone().requires_grad_(True)


# ----------------------------------------------------------------------------------------------------------------
# forward_noise


def test_forward_noise_endpoints_and_broadcast():
    x0, eps, _, _, _, _ = _batch((4, 3, 5, 6), seed=1)
    torch.testing.assert_close(forward_noise(x0, eps, torch.zeros(4)), x0, rtol=0, atol=0)
    torch.testing.assert_close(forward_noise(x0, eps, torch.ones(4)), eps, rtol=0, atol=0)
    # One noise level per sample: sample 0 clean, 1 pure noise, 2 and 3 in between.
    t = torch.tensor([0.0, 1.0, 0.25, 0.7])
    xt = forward_noise(x0.to(torch.bfloat16), eps, t)
    assert xt.dtype == torch.float32
    torch.testing.assert_close(xt[0], x0[0].to(torch.bfloat16).float(), rtol=0, atol=0)
    torch.testing.assert_close(xt[1], eps[1], rtol=0, atol=0)
    x0b = x0.to(torch.bfloat16).double()
    torch.testing.assert_close(xt[2].double(), 0.75 * x0b[2] + 0.25 * eps[2].double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xt[3].double(), 0.3 * x0b[3] + 0.7 * eps[3].double(), rtol=1e-6, atol=1e-6)
    # The path is linear in t with velocity eps - x0 (the target both methods use).
    d = forward_noise(x0, eps, torch.full((4,), 0.75)) - forward_noise(x0, eps, torch.full((4,), 0.25))
    torch.testing.assert_close(d, 0.5 * (eps - x0), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# optimality_weight


def test_optimality_weight_anchor_values():
    a = torch.tensor([-A_MAX, 0.0, A_MAX, -2 * A_MAX, 3 * A_MAX, A_MAX / 2, -A_MAX / 4])
    r = optimality_weight(a, A_MAX)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.5, 1.0, 0.0, 1.0, 0.75, 0.375]), rtol=0, atol=1e-7)
    assert r.dtype == torch.float32


def test_optimality_weight_range_monotone_and_matches_source():
    a = torch.linspace(-40, 40, 2001, dtype=torch.float64)
    r = optimality_weight(a, A_MAX)
    assert float(r.min()) == 0.0 and float(r.max()) == 1.0
    assert bool((r[1:] >= r[:-1]).all())
    ref = torch.clamp(torch.clamp(a, -A_MAX, A_MAX) / A_MAX / 2.0 + 0.5, 0, 1)  # train_nft_sd3.py:910-932
    torch.testing.assert_close(r.double(), ref, rtol=0, atol=1e-7)
    # Another A_max: the clip point moves with it.
    torch.testing.assert_close(optimality_weight(torch.tensor([-1.0, 0.0, 1.0, 2.0]), 1.0),
                               torch.tensor([0.0, 0.5, 1.0, 1.0]))


# ----------------------------------------------------------------------------------------------------------------
# decay


@pytest.mark.parametrize("k, d0, d1, d2", [
    (0, 0.0, 0.0, 0.0),
    (1, 0.0, 0.001, 0.0),
    (74, 0.0, 0.074, 0.0),
    (75, 0.0, 0.075, 0.0),
    (76, 0.0, 0.076, 0.0075),
    (100, 0.0, 0.1, 0.1875),
    (208, 0.0, 0.208, 0.9975),
    (209, 0.0, 0.209, 0.999),
    (500, 0.0, 0.5, 0.999),
    (5000, 0.0, 0.5, 0.999),
])
def test_nft_decay_types(k, d0, d1, d2):
    assert decay(k, 0.0, 0.0) == 0.0 == d0
    assert decay(k, 0.001, 0.5) == pytest.approx(d1, abs=1e-12)
    assert decay(k, 0.0075, 0.999, start=75) == pytest.approx(d2, abs=1e-12)


def test_decay_matches_source_everywhere():
    for k in range(0, 1200):
        assert decay(k, 0.0, 0.0, 0) == ref_return_decay(k, 0)
        assert decay(k, 0.001, 0.5, 0) == pytest.approx(ref_return_decay(k, 1), abs=1e-12)
        assert decay(k, 0.0075, 0.999, 75) == pytest.approx(ref_return_decay(k, 2), abs=1e-12)
        # AWM anchor: min(kl_ema_decay, 0.001 * global_step), train_sd3_awm.py:1412-1413.
        assert decay(k, 0.001, 0.3) == pytest.approx(min(0.3, 0.001 * k), abs=1e-12)
    assert decay(300, 0.001, 0.3) == pytest.approx(0.3) and decay(150, 0.001, 0.3) == pytest.approx(0.15)


# ----------------------------------------------------------------------------------------------------------------
# DiffusionNFT loss


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("beta", [1.0, 0.1, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_nft_loss_matches_source(shape, beta, seed):
    x0, eps, t, v_old, v_theta, adv = _batch(shape, seed=seed)
    adv[0] = 9.0  # beyond the clip on both sides
    adv[-1] = -7.0
    # Ours (float32).
    vt = _leaf32(v_theta)
    x_t = forward_noise(x0, eps, t)
    loss, stats = nft_loss(vt, v_old, x_t, x0, t, optimality_weight(adv, A_MAX), beta, A_MAX)
    loss.backward()
    # Source (float64).
    vt64 = _leaf64(v_theta)
    ref, pos, neg = ref_nft(vt64, v_old.double(), x0.double(), eps.double(), t.double(), adv.double(), beta, A_MAX)
    ref.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-5, atol=0)
    torch.testing.assert_close(stats["loss_pos"].double(), pos.detach().mean(), rtol=2e-5, atol=0)
    torch.testing.assert_close(stats["loss_neg"].double(), neg.detach().mean(), rtol=2e-5, atol=0)
    g_scale = float(vt64.grad.abs().max())
    assert g_scale > 0
    torch.testing.assert_close(vt.grad.double(), vt64.grad, rtol=1e-4, atol=1e-5 * g_scale)


def test_nft_v_old_and_r_get_no_gradient():
    x0, eps, t, v_old, v_theta, adv = _batch((4, 3, 5, 6), seed=3)
    vo = _leaf32(v_old)
    a = _leaf32(adv)
    vt = _leaf32(v_theta)
    loss, _ = nft_loss(vt, vo, forward_noise(x0, eps, t), x0, t, optimality_weight(a, A_MAX), 0.3, A_MAX)
    loss.backward()
    assert vo.grad is None and a.grad is None
    assert float(vt.grad.abs().sum()) > 0


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_equal_rewards_at_old_policy_give_zero_gradient(beta):
    """r = 1/2 for every sample and v_theta == v_old: the positive and negative terms cancel (paper §3)."""
    x0, eps, t, v_old, _, _ = _batch((4, 3, 5, 6), seed=4)
    x_t = forward_noise(x0, eps, t)
    vt = _leaf32(v_old)
    loss, _ = nft_loss(vt, v_old, x_t, x0, t, torch.full((4,), 0.5), beta, A_MAX)
    loss.backward()
    assert float(loss.detach()) > 0  # the loss itself is not zero, only its gradient
    # The same point with unequal rewards has a clearly non-zero gradient: the cancellation is not an accident.
    vt2 = _leaf32(v_old)
    loss2, _ = nft_loss(vt2, v_old, x_t, x0, t, torch.tensor([0.9, 0.1, 0.7, 0.3]), beta, A_MAX)
    loss2.backward()
    g_ref = float(vt2.grad.abs().max())
    assert g_ref > 1e-3
    assert float(vt.grad.abs().max()) <= 1e-5 * g_ref
    # And at r = 1/2 away from v_old the gradient pulls v_theta back towards v_old (descent lowers |v_theta - v_old|).
    _, _, _, _, v_theta, _ = _batch((4, 3, 5, 6), seed=4)
    vt3 = _leaf32(v_theta)
    loss3, _ = nft_loss(vt3, v_old, x_t, x0, t, torch.full((4,), 0.5), beta, A_MAX)
    loss3.backward()
    before = velocity_mse(v_theta, v_old)
    after = velocity_mse(v_theta - 1e-2 * vt3.grad / vt3.grad.abs().max(), v_old)
    assert bool((after < before).all())


def test_nft_weight_floor_keeps_exact_predictions_finite():
    """A sample whose x̂0 error is exactly zero (t = 0: x̂0 = x_t = x0) hits the 1e-5 floor of w^±: its loss and
    gradient are 0, not 0/0; the others match the source transcription."""
    shape = (3, 2, 4, 4)
    x0, eps, _, v_old, v_theta, adv = _batch(shape, seed=13)
    t = torch.tensor([0.0, 0.5, 0.8])
    vt = _leaf32(v_theta)
    loss, stats = nft_loss(vt, v_old, forward_noise(x0, eps, t), x0, t, optimality_weight(adv, A_MAX), 0.5, A_MAX)
    loss.backward()
    assert math.isfinite(float(loss.detach())) and bool(torch.isfinite(vt.grad).all())
    assert float(vt.grad[0].abs().max()) == 0.0 and float(vt.grad[1:].abs().max()) > 0
    v64 = _leaf64(v_theta)
    ref, _, _ = ref_nft(v64, v_old.double(), x0.double(), eps.double(), t.double(), adv.double(), 0.5, A_MAX)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-5, atol=0)
    torch.testing.assert_close(vt.grad.double(), v64.grad, rtol=1e-4, atol=1e-7)


def test_nft_positive_only_beta_one_is_self_normalised_x0_matching():
    """r = 1, beta = 1: loss = A_max · mean_B[mean_D (x̂0_θ - x0)² / sg(mean_D |x̂0_θ - x0|)], independent of v_old."""
    shape = (4, 3, 5, 6)
    x0, eps, t, v_old, v_theta, _ = _batch(shape, seed=5)
    x_t = forward_noise(x0, eps, t)
    r = torch.ones(4)
    vt = _leaf32(v_theta)
    loss, stats = nft_loss(vt, v_old, x_t, x0, t, r, 1.0, A_MAX)
    loss.backward()
    # Direct float64 computation.
    v64 = _leaf64(v_theta)
    tb = t.double().view(-1, 1, 1, 1)
    res = x_t.double() - tb * v64 - x0.double()
    w = res.detach().abs().mean(dim=(1, 2, 3))
    direct = A_MAX * ((res ** 2).mean(dim=(1, 2, 3)) / w).mean()
    direct.backward()
    torch.testing.assert_close(loss.double(), direct.detach(), rtol=2e-5, atol=0)
    torch.testing.assert_close(vt.grad.double(), v64.grad, rtol=1e-4, atol=1e-6)
    # Closed-form gradient: -(A_max / B) · 2 t res / (D w).
    d = 3 * 5 * 6
    torch.testing.assert_close(v64.grad, -(A_MAX / 4) * 2 * tb * res.detach() / (d * w.view(-1, 1, 1, 1)))
    # v_old plays no role.
    vt2 = _leaf32(v_theta)
    loss2, _ = nft_loss(vt2, v_old + 3.0 * torch.randn(shape, generator=_gen(9)), x_t, x0, t, r, 1.0, A_MAX)
    loss2.backward()
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(vt2.grad, vt.grad)
    # Gradient descent lowers the x0-matching error of every sample.
    err = lambda v: ((x_t - t.view(-1, 1, 1, 1) * v - x0) ** 2).mean(dim=(1, 2, 3))  # noqa: E731
    assert bool((err(v_theta - 0.05 * vt.grad / vt.grad.abs().max()) < err(v_theta)).all())


def test_nft_small_beta_limit():
    """As beta → 0 the loss grows like C/beta with C = A_max·mean_B[mean_D R²/w] independent of v_theta
    (R = x̂0_old - x0, w = max(mean_D|R|, 1e-5)), so it stays finite for every beta > 0, while the gradient converges to the bounded
    (A_max/B)·(2t/D)·(1 - 2r)·R/w: a reward-signed push of x̂0_θ towards (r > 1/2) or away from (r < 1/2) x0 that no
    longer depends on v_theta - v_old. At beta = 0 exactly the loss is C/0 (inf) and the gradient inf·0 (nan): beta
    must be > 0."""
    shape = (4, 3, 5, 6)
    x0, eps, t, v_old, v_theta, adv = _batch(shape, seed=6)
    x_t = forward_noise(x0, eps, t)
    r = optimality_weight(adv, A_MAX)
    assert bool((r - 0.5).abs().min() > 0.05)  # a non-degenerate limit for every sample
    tb = t.double().view(-1, 1, 1, 1)
    R = x_t.double() - tb * v_old.double() - x0.double()
    w = R.abs().mean(dim=(1, 2, 3)).clamp(min=1e-5)
    c = A_MAX * ((R ** 2).mean(dim=(1, 2, 3)) / w).mean()
    d = 3 * 5 * 6
    g_lim = (A_MAX / 4) * (2 * tb / d) * (1 - 2 * r.double().view(-1, 1, 1, 1)) * R / w.view(-1, 1, 1, 1)
    errs = []
    for beta in [1e-1, 1e-2, 1e-3, 1e-4, 1e-6]:
        vt = _leaf32(v_theta)
        loss, _ = nft_loss(vt, v_old, x_t, x0, t, r, beta, A_MAX)
        loss.backward()
        assert math.isfinite(float(loss.detach())) and bool(torch.isfinite(vt.grad).all())
        assert float(loss.detach()) * beta == pytest.approx(float(c), rel=max(5e-2 * beta / 1e-1, 2e-4))
        assert float(vt.grad.abs().max()) <= 2 * float(g_lim.abs().max())
        errs.append(float((vt.grad.double() - g_lim).abs().max()) / float(g_lim.abs().max()))
    # The gradient converges (O(beta)) to the limit; float32 noise floors the last ones.
    assert errs[0] > 1e-3 and errs[1] < errs[0] / 5 and errs[2] < errs[1] / 5
    assert errs[-1] < 1e-4


# ----------------------------------------------------------------------------------------------------------------
# AWM loss


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_awm_loss_matches_source(shape, seed):
    x0, eps, t, _, v_theta, adv = _batch(shape, seed=seed)
    adv[0] = 8.0  # beyond AWM's clip (±5 before scaling to ±1)
    # Ours, fed the source's scaled advantages clamp(A, ±5) / 5 · 1.
    a_scaled = adv.clamp(-5, 5) / 5
    vt = _leaf32(v_theta)
    loss, stats = awm_loss(vt, x0, eps, t, a_scaled, 0.25)
    loss.backward()
    # Source.
    vt64 = _leaf64(v_theta)
    ref, log_prob, a_ref = ref_awm_policy_loss(vt64, t.double(), x0.double(), eps.double(), adv.double())
    ref.backward()
    torch.testing.assert_close(a_scaled.double(), a_ref, rtol=0, atol=1e-7)
    # The source's value is -mean(A) (ratio ≡ 1); ours is the surrogate -mean(A·ℓ) with the same gradient.
    torch.testing.assert_close(ref.detach(), -a_ref.mean())
    torch.testing.assert_close(loss.double(), -(a_ref * log_prob.detach()).mean(), rtol=2e-5, atol=1e-7)
    e = ((v_theta.double() - (eps - x0).double()) ** 2).mean(dim=tuple(range(1, len(shape))))
    torch.testing.assert_close(stats["matching_error"].double(), e.mean(), rtol=2e-5, atol=0)
    g_scale = float(vt64.grad.abs().max())
    assert g_scale > 0
    torch.testing.assert_close(vt.grad.double(), vt64.grad, rtol=1e-4, atol=1e-5 * g_scale)


def test_awm_sum_first_variant_has_the_same_gradient():
    """The source's other loss_type ('sum_first', ratio of the timestep-mean log-prob) gives the same on-policy
    gradient, so the per-(t, sample) form here covers both."""
    shape = (6, 3, 4, 4)  # 2 timesteps × 3 samples, rows ordered [t0 s0..s2, t1 s0..s2] as in the source
    x0, eps, t, _, v_theta, adv = _batch(shape, seed=7)
    a = adv[:3].clamp(-5, 5) / 5
    vt = _leaf32(v_theta)
    loss, _ = awm_loss(vt, x0, eps, t, a.repeat(2), 0.25)
    loss.backward()
    v64 = _leaf64(v_theta)
    lp = ref_awm_log_prob(v64, t.double(), x0.double(), eps.double(), 0.25).reshape(2, 3)
    ratio = torch.exp(lp.mean(dim=0) - lp.mean(dim=0).detach())
    a64 = a.double()
    ref = torch.mean(torch.maximum(-a64 * ratio, -a64 * torch.clamp(ratio, 0.0, 2.0)))
    ref.backward()
    torch.testing.assert_close(vt.grad.double(), v64.grad, rtol=1e-4, atol=1e-8)


def test_awm_zero_advantage_gives_zero_loss_and_gradient():
    x0, eps, t, _, v_theta, _ = _batch((4, 3, 5, 6), seed=8)
    vt = _leaf32(v_theta)
    loss, stats = awm_loss(vt, x0, eps, t, torch.zeros(4), 0.25)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert float(vt.grad.abs().max()) == 0.0
    assert float(stats["matching_error"]) > 0


def test_awm_advantage_sign_sets_the_direction():
    """Positive advantage: a descent step lowers the matching error e; negative: raises it (the source's sign)."""
    shape = (4, 3, 5, 6)
    x0, eps, t, _, v_theta, _ = _batch(shape, seed=10)
    target = eps - x0

    def err(v):
        return ((v - target) ** 2).mean(dim=(1, 2, 3))

    adv = torch.tensor([1.0, 0.4, -0.6, -1.0])
    vt = _leaf32(v_theta)
    loss, _ = awm_loss(vt, x0, eps, t, adv, 0.25)
    loss.backward()
    stepped = v_theta - 1e-2 * vt.grad / vt.grad.abs().max()
    e0, e1 = err(v_theta), err(stepped)
    assert bool((e1[:2] < e0[:2]).all()), (e0, e1)
    assert bool((e1[2:] > e0[2:]).all()), (e0, e1)
    # Each sample's gradient is A·t·e^(p-1)·de/dv (the generalised-Huber weight).
    d = 3 * 5 * 6
    e = err(v_theta).double()
    w = adv.double() * t.double() * (e + 1e-10) ** (0.25 - 1) / 4
    expect = w.view(-1, 1, 1, 1) * 2 * (v_theta - target).double() / d
    torch.testing.assert_close(vt.grad.double(), expect, rtol=1e-4, atol=1e-9)


def test_awm_gradient_is_finite_at_zero_matching_error():
    """At e = 0 the 1e-10 guard keeps (e + 1e-10)^(p-1) finite: the gradient is 0, not nan."""
    x0, eps, t, _, _, _ = _batch((3, 2, 4, 4), seed=11)
    vt = _leaf32(eps - x0)
    loss, _ = awm_loss(vt, x0, eps, t, torch.tensor([1.0, -1.0, 0.5]), 0.25)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)
    assert bool(torch.isfinite(vt.grad).all()) and float(vt.grad.abs().max()) == 0.0


# ----------------------------------------------------------------------------------------------------------------
# velocity_mse


def test_velocity_mse_value_and_gradient_only_to_first_argument():
    g = _gen(12)
    a = torch.randn(3, 4, 5, generator=g)
    b = torch.randn(3, 4, 5, generator=g)
    al, bl = _leaf32(a), _leaf32(b)
    m = velocity_mse(al, bl)
    torch.testing.assert_close(m.double(), ((a.double() - b.double()) ** 2).mean(dim=(1, 2)), rtol=1e-6, atol=0)
    m.mean().backward()
    assert bl.grad is None
    torch.testing.assert_close(al.grad.double(), 2 * (a - b).double() / (3 * 20), rtol=1e-5, atol=1e-8)
