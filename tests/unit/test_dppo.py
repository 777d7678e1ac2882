"""Flow-DPPO's trust region (grpo.trust_region, grpo/loss.py): the KL against its closed form, the mask's direction,
the loss against transcriptions of the three official implementations, the first pass (KL exactly 0, nothing
masked), the per-transition masked share, trees keeping their edges' means, and the one-line config errors."""

import math

import pytest
import torch

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.loss import TrustRegion, grpo_loss, trust_region_keep
from grpo.models.flux1 import FLUX1
from grpo.rollout import SDEParams, sample, transition
from grpo.sde import sde_step
from tests import ROOT, TINY

PRESET = ROOT / "recipes/configs/tiny/grpo_lora.yaml"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------- the KL


@pytest.mark.parametrize("std", [0.3, torch.tensor([0.1, 0.2, 0.4])])
def test_the_kl_is_the_gaussians_closed_form(std):
    """N(mu + d, s²) against N(mu, s²), d the same in every element: KL = d² / (2 s²) per element, and its element
    mean is the same number."""
    mu = torch.randn(3, 5, 4, generator=_gen(0))
    d = torch.tensor([0.01, -0.02, 0.05])
    tr = TrustRegion(mu + d[:, None, None], mu, std, kl_threshold=1.0)
    _, kl = trust_region_keep(torch.ones(3), torch.ones(3), tr)
    s = torch.as_tensor(std).expand(3)
    torch.testing.assert_close(kl, d**2 / (2 * s**2), rtol=1e-4, atol=0)


def test_a_varying_difference_averages_over_the_elements():
    mu = torch.zeros(1, 2, 2)
    new = torch.tensor([[[0.1, 0.0], [0.0, 0.3]]])
    _, kl = trust_region_keep(torch.ones(1), torch.ones(1), TrustRegion(new, mu, 0.5, kl_threshold=1.0))
    assert kl.item() == pytest.approx((0.01 + 0.09) / (2 * 0.25) / 4)


# ------------------------------------------------------------------------------------------ the direction


# (ratio, advantage, KL over the threshold) -> masked. "Further" is the advantage's push on the ratio: A > 0 raises r,
# A < 0 lowers it; a step the gradient pulls back towards r = 1, one at r = 1, one with A = 0, and any step under
# the threshold keep their term.
DIRECTION = [
    (1.01, 1.0, True, True), (0.99, 1.0, True, False), (0.99, -1.0, True, True), (1.01, -1.0, True, False),
    (1.0, 1.0, True, False), (1.0, -1.0, True, False), (1.01, 0.0, True, False), (0.99, 0.0, True, False),
    (1.01, 1.0, False, False), (0.99, -1.0, False, False),
]


@pytest.mark.parametrize("ratio,adv,high,masked", DIRECTION)
def test_the_mask_takes_the_step_that_would_move_further(ratio, adv, high, masked):
    old = torch.zeros(1, 4)
    new = old + (0.1 if high else 1e-4)  # KL 0.02 or 2e-9 at std 0.5, threshold 1e-5
    keep, _ = trust_region_keep(torch.tensor([ratio]), torch.tensor([adv]), TrustRegion(new, old, 0.5, 1e-5))
    assert keep.item() is (not masked)


def test_the_threshold_itself_is_outside():
    """kl >= threshold is outside (verl-omni and Flow-Factory; UniRL's kl < threshold keeps, the same rule)."""
    old, new = torch.zeros(1, 1), torch.full((1, 1), 0.5)
    keep, kl = trust_region_keep(torch.tensor([2.0]), torch.tensor([1.0]), TrustRegion(new, old, 0.5, 0.5))
    assert kl.item() == 0.5 and not keep.item()


def test_masked_samples_have_no_gradient_and_the_kept_ones_the_unclipped_one():
    old_lp = torch.zeros(4)
    lp = torch.tensor([1e-3, -1e-3, -1e-3, 1e-3], requires_grad=True)  # far outside any clip of 1e-4
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    old_mean = torch.zeros(4, 3)
    mean = old_mean + 0.1  # every KL over the threshold
    loss, stats = grpo_loss(lp, old_lp, adv, clip_range=1e-4, trust_region=TrustRegion(mean, old_mean, 0.5, 1e-5))
    loss.backward()
    r = torch.exp(lp.detach())
    # 0 and 1 move further (masked), 2 and 3 are pulled back: -A·r unclipped, averaged over all 4
    assert lp.grad[0].item() == 0.0 and lp.grad[1].item() == 0.0
    torch.testing.assert_close(lp.grad[2:], -adv[2:] * r[2:] / 4)
    assert loss.item() == pytest.approx(float(-(adv[2:] * r[2:]).sum() / 4))
    assert stats["dppo/masked_frac"].item() == 0.5 and stats["dppo/kl"].item() == pytest.approx(0.02)
    assert stats["clip_frac"].item() == 1.0  # still reported against clip_range, which no longer clips


def test_an_overflowing_masked_ratio_stays_finite():
    """The sources keep the loss finite (torch.where); here its gradient too, where theirs is inf * 0 = nan."""
    lp = torch.tensor([200.0, 0.0], requires_grad=True)
    old_mean = torch.zeros(2, 3)
    loss, _ = grpo_loss(lp, torch.zeros(2), torch.tensor([1.0, 1.0]), clip_range=1e-4,
                        trust_region=TrustRegion(old_mean + 1, old_mean, 0.5, 1e-5))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and lp.grad[0].item() == 0.0


def test_ratio_norm_and_the_trust_region_are_one_or_the_other():
    from grpo.loss import RatioNorm

    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="give one"):
        grpo_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), clip_range=1e-4, ratio_norm=RatioNorm(x, x, 1.0, 1.0),
                  trust_region=TrustRegion(x, x, 1.0, 1e-5))


# ------------------------------------------------------------------------------------- the reference code


def _unirl_flowdppo_kl_adv_loss(new_logp, old_logp, new_means, old_means, advantages, sigma_t, kl_mask_threshold):
    """Tencent-Hunyuan/UniRL@1a7b501 unirl/algorithms/flowdppo.py:43-51 (_gaussian_kl_div) and 53-111
    (_flowdppo_kl_adv_loss), the loss and masked_fraction, transcribed; [B, S'] log-probs, [B, S', ...] means; the
    caller (:319) takes loss_per_elem.mean()."""
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages.detach()
    unclipped_loss = -adv * ratio
    kl_per_elem = (new_means - old_means) ** 2 / (2 * sigma_t**2)
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(2, kl_per_elem.ndim)))
    kl_mask = kl_per_sample < kl_mask_threshold
    pos_rm_mask = (~kl_mask) & (ratio > 1.0) & (adv > 0)
    neg_rm_mask = (~kl_mask) & (ratio < 1.0) & (adv < 0)
    rm_mask = pos_rm_mask | neg_rm_mask
    keep_adv_mask = (~rm_mask).detach()
    zero = torch.zeros((), dtype=unclipped_loss.dtype, device=unclipped_loss.device)
    loss_per_elem = torch.where(keep_adv_mask, unclipped_loss, zero)
    return loss_per_elem.mean(), rm_mask.float().mean()


def _verl_omni_flow_dppo_loss(old_log_prob, log_prob, advantages, old_prev_sample_mean, prev_sample_mean, std_dev_t,
                              sqrt_dt, kl_mask_threshold):
    """verl-project/verl-omni@a1139ba verl_omni/trainer/diffusion/diffusion_algos.py:396-424 (FlowDPPOLoss.compute_
    loss, add_kl_coefficient=True, no rollout IS weights), the loss and masked_fraction, transcribed."""
    advantages = advantages.detach()
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    sigma_t = std_dev_t * sqrt_dt.reshape(sqrt_dt.shape[0], *([1] * (std_dev_t.ndim - 1)))
    kl_per_elem = mean_diff_sq / (2 * sigma_t.pow(2))
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(1, kl_per_elem.ndim)))
    high_kl_mask = kl_per_sample >= kl_mask_threshold
    pos_rm_mask = high_kl_mask & (ratio > 1.0) & (advantages > 0)
    neg_rm_mask = high_kl_mask & (ratio < 1.0) & (advantages < 0)
    rm_mask = pos_rm_mask | neg_rm_mask
    keep_mask = (~rm_mask).detach()
    zero = torch.zeros((), dtype=unclipped_loss.dtype, device=unclipped_loss.device)
    return torch.mean(torch.where(keep_mask, unclipped_loss, zero)), rm_mask.float().mean()


def _flow_factory_dppo_loss(log_prob, old_log_prob, adv, next_latents_mean, old_mask_tensor, std_dev_t, dt,
                            kl_mask_threshold):
    """X-GenGroup/Flow-Factory PR #181 (79120955, read in the fork bwnzheng/Flow-Factory)
    src/flow_factory/trainers/dppo.py:46-48, 77 (Flow-SDE / Dance-SDE sigma) and 198-224 (x-based mask), the
    policy loss and masked_ratio, transcribed (advantage clipping and the optional KL to the reference left out)."""
    ratio = torch.exp(log_prob - old_log_prob)
    sigma_t = std_dev_t * torch.sqrt(-dt)
    kl_elem = (next_latents_mean - old_mask_tensor) ** 2 / (2 * sigma_t**2)
    kl_new_old = kl_elem.mean(dim=tuple(range(1, kl_elem.ndim)))
    unclipped_loss = -adv * ratio
    violate = kl_new_old >= kl_mask_threshold
    pos_rm = violate & (ratio > 1.0) & (adv > 0)
    neg_rm = violate & (ratio < 1.0) & (adv < 0)
    keep_mask = torch.logical_not(pos_rm | neg_rm).to(dtype=unclipped_loss.dtype).detach()
    return torch.mean(unclipped_loss * keep_mask), 1.0 - keep_mask.mean()


@pytest.mark.parametrize("seed", range(4))
def test_the_loss_matches_the_three_official_implementations(seed):
    """Random SDE means and log-probs of one transition, a threshold that masks some of them: our loss, its
    gradient in the log-probs and the masked share equal each source's."""
    g = _gen(seed)
    b = 16
    shape = (b, 6, 4)
    old_mean = torch.randn(shape, generator=g)
    mean = old_mean + 0.05 * torch.randn(shape, generator=g) * torch.rand(b, 1, 1, generator=g)
    old_lp = torch.randn(b, generator=g) * 0.01
    lp0 = old_lp + torch.randn(b, generator=g) * 1e-3
    adv = torch.randn(b, generator=g)
    sigma, sigma_next, eta = 0.8, 0.7, 0.7
    std_dev_t = eta * math.sqrt(sigma / (1 - sigma))  # Flow-GRPO's std_dev_t, the std without sqrt(delta)
    sqrt_dt = math.sqrt(sigma - sigma_next)
    std = std_dev_t * sqrt_dt
    threshold = 1e-3

    lp = lp0.clone().requires_grad_(True)
    ours, stats = grpo_loss(lp, old_lp, adv, clip_range=1e-4, trust_region=TrustRegion(mean, old_mean, std, threshold))
    (grad,) = torch.autograd.grad(ours, lp)
    masked = stats["dppo/masked_frac"]
    assert 0 < masked < 1  # the case is not trivial

    refs = {
        "unirl": lambda x: _unirl_flowdppo_kl_adv_loss(x[:, None], old_lp[:, None], mean[:, None], old_mean[:, None],
                                                       adv[:, None], torch.tensor(std), threshold),
        "verl-omni": lambda x: _verl_omni_flow_dppo_loss(old_lp, x, adv, old_mean, mean,
                                                         torch.full((b, 1, 1), std_dev_t),
                                                         torch.full((b,), sqrt_dt), threshold),
        "flow-factory": lambda x: _flow_factory_dppo_loss(x, old_lp, adv, mean, old_mean, torch.tensor(std_dev_t),
                                                          torch.tensor(sigma_next - sigma), threshold),
    }
    for name, ref in refs.items():
        x = lp0.clone().requires_grad_(True)
        loss, share = ref(x)
        (ref_grad,) = torch.autograd.grad(loss, x)
        torch.testing.assert_close(ours, loss, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-8, msg=name)
        assert masked.item() == pytest.approx(share.item()), name


# ----------------------------------------------------------------------------------------- the first pass


@pytest.mark.parametrize("kind", ["dance", "flow", "cps"])
def test_the_first_pass_has_kl_zero_nothing_masked_and_ratio_one(kind):
    """The rollout's step and the update's recomputation of it give the same mean bit for bit: KL exactly 0, so
    even the smallest threshold masks nothing, and the loss is -mean(A) with ratio exactly 1."""
    x = torch.randn(3, 8, 4, generator=_gen(10))
    v = torch.randn(x.shape, generator=_gen(11)).requires_grad_(True)
    noise = torch.randn(x.shape, generator=_gen(12))
    with torch.no_grad():
        roll = sde_step(x, v, 0.8, 0.7, eta=0.7, kind=kind, noise=noise)
    train = sde_step(x, v, 0.8, 0.7, eta=0.7, kind=kind, prev_sample=roll.prev_sample)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, stats = grpo_loss(train.log_prob, roll.log_prob, adv, clip_range=1e-4,
                            trust_region=TrustRegion(train.mean, roll.mean, train.std, 1e-30))
    assert torch.equal(stats["ratio"], torch.ones(3))
    assert stats["dppo/kl"].item() == 0.0 and stats["dppo/masked_frac"].item() == 0.0
    torch.testing.assert_close(loss, -adv.mean())
    loss.backward()
    assert torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


@pytest.mark.parametrize("kind,window,tail", [("dance", None, False), ("flow", range(1, 3), False),
                                              ("cps", range(0, 2), True)])
def test_the_rollouts_means_are_the_updates_bit_for_bit(kind, window, tail):
    """Every step, an SDE window between ODE steps (MixGRPO) and a DPM-Solver++ tail after it (MixGRPO-Flash): the
    means the rollout keeps are those its trained transitions recompute, so the first pass's KL is exactly 0. A
    stand-in velocity: the rollout and the update call it alike (true CFG only composes it)."""
    from grpo.sde import shifted_sigmas
    from grpo.solvers import flash_sigmas

    def velocity(x, t, cond):
        return torch.tanh(1.3 * x) - x * t.view(-1, 1, 1)

    sigmas = shifted_sigmas(6, 3.0)
    sde = SDEParams(0.7, kind)
    init = torch.randn(4, 8, 3, generator=_gen(20))
    gens = [_gen(40 + k) for k in range(4)]
    cut = flash_sigmas(sigmas, window[-1], 0.5, 3.0)[window[-1] + 1:] if tail else None
    traj = sample(velocity, None, init, sigmas, sde, gens, window, cut, keep_means=True)
    for j in window if window is not None else range(5):
        out = transition(velocity, None, traj.latents, sigmas, j, sde)
        assert torch.equal(out.log_prob, traj.log_probs[:, j]) and torch.equal(out.mean, traj.means[:, j])
        _, kl = trust_region_keep(torch.ones(4), torch.ones(4), TrustRegion(out.mean, traj.means[:, j], out.std, 1.0))
        assert (kl == 0).all()


def test_trees_keep_each_edges_mean_for_the_update():
    """BranchGRPO's tree rollout records every row's SDE mean (its edge's): the update's one row per edge gives the
    same means bit for bit, so the first pass's KL is exactly 0 on every edge."""
    if not (TINY / "model_index.json").exists():
        pytest.skip("tiny model not built")
    from grpo.tree import Tree

    tree = Tree(splits=(0, 2), factor=2, noise_scale=2.0, num_steps=6)
    parts = FLUX1.load_parts(str(TINY))
    size = parts.latent_size(64)
    torch.manual_seed(1)
    rows = [0, 0, 0, 0, 1, 1, 1, 1]
    embeds = torch.randn(2, 8, parts.transformer.config.joint_attention_dim)[rows]
    pooled = torch.randn(2, 32)[rows][:, :parts.transformer.config.pooled_projection_dim]
    cond = FLUX1.conditioning({"prompt_embeds": embeds, "pooled": pooled}, size, 3.5, True, torch.device("cpu"),
                              torch.float32)
    init = FLUX1.pack(torch.randn(2, parts.transformer.config.in_channels // 4, size, size)[rows])
    sigmas = FLUX1.dynamic_sigmas(6, (size // 2) ** 2, parts.scheduler_config)
    sde, velocity = SDEParams(0.7, "dance"), FLUX1.velocity_of(parts.transformer)
    gens = [torch.Generator().manual_seed(300 + i) for i in range(8)]
    traj = sample(velocity, cond, init, sigmas, sde, gens, keep_means=True, tree=tree)
    assert traj.means.shape == traj.latents[:, 1:].shape
    for j in tree.trained():
        out = transition(velocity, cond, traj.latents, sigmas, j, sde, tree)
        edges = tree.heads(8, j + 1)
        assert torch.equal(out.mean, traj.means[edges, j])
        keep, kl = trust_region_keep(torch.ones(len(edges)), torch.ones(len(edges)),
                                     TrustRegion(out.mean, traj.means[edges, j], out.std, 1e-30))
        assert keep.all() and (kl == 0).all()


# ------------------------------------------------------------------------------------------------ settings


def test_the_trust_region_is_off_by_default_and_keeps_the_means_when_on():
    from grpo.objectives.grpo import GRPO

    cfg = load_config(PRESET)
    assert cfg.grpo.trust_region is None
    assert GRPO(cfg).rollout_records() == {"keep_means": False} and GRPO(cfg).stats_per_point() == ()
    on = GRPO(load_config(PRESET, ["grpo.trust_region.kl_threshold=1e-5"]))
    assert on.settings.trust_region.kl_threshold == 1e-5
    assert on.rollout_records() == {"keep_means": True} and on.stats_per_point() == ("dppo/masked_frac",)


@pytest.mark.parametrize("overrides,match", [
    (["grpo.trust_region.kl_threshold=0"], r"grpo.trust_region.kl_threshold: 0.0 must be > 0"),
    (["grpo.trust_region.kl_threshold=-1e-5"], r"grpo.trust_region.kl_threshold: -1e-05 must be > 0"),
    (["grpo.trust_region={}"], "grpo.trust_region.kl_threshold: missing"),
    (["grpo.trust_region.kl_threshold=1e-5", "sampling.sde=flow", "grpo.ratio_norm=true"],
     "grpo.trust_region: Flow-DPPO's KL mask replaces the ratio clip that grpo.ratio_norm normalises"),
])
def test_bad_trust_region_settings_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(PRESET, overrides)
    assert "\n" not in str(e.value)
