"""NormGuard ({nft,awm}.norm_guard, arXiv 2606.27771) and the velocity's drift stats every objective logs
(drift/vnorm, drift/vnorm_ratio): the hinge against its closed form (zero with a zero gradient below the threshold,
above it the slope 1/||v_ref|| along v), the stats against a hand computation, the velocity it compares with (the
reference where one is loaded, else the lagging policy's), and the first pass, where v == v_ref: the guarded loss and
its gradient are the unguarded ones bit for bit."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.matching import awm_loss, drift_stats, nft_loss, norm_guard, optimality_weight, velocity_mse
from grpo.objectives import objective_of
from tests.unit.test_rollout_plan import TINY_PRESETS

SHAPE = (4, 8, 8)


def _v(seed: int, b: int = 3) -> torch.Tensor:
    return torch.randn(b, *SHAPE, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- the closed form
@pytest.mark.parametrize("scale, margin", [(0.5, 0.0), (0.9, 0.0), (1.0, 0.0), (1.0, 0.05), (1.04, 0.05)])
def test_the_hinge_is_zero_with_a_zero_gradient_at_or_below_the_threshold(scale, margin):
    # below the threshold, or at it with v == v_ref bit for bit (no rounding can lift the ratio above 1)
    ref = _v(0)
    v = (ref * scale).requires_grad_()
    h = norm_guard(v, ref, margin)
    (g,) = torch.autograd.grad(h.sum(), v)
    assert h.shape == (3,) and torch.equal(h, torch.zeros(3)) and torch.equal(g, torch.zeros_like(g))


def test_the_first_pass_hinge_is_exactly_zero():
    v = _v(1).requires_grad_()
    h = norm_guard(v, v.detach().clone(), 0.0)  # v_theta == v_ref bit for bit
    (g,) = torch.autograd.grad(h.mean(), v)
    assert torch.equal(h, torch.zeros(3)) and torch.equal(g, torch.zeros_like(g))


def test_above_the_threshold_the_hinge_is_the_excess_ratio_and_its_gradient_shrinks_v_along_itself():
    ref = _v(2)
    v = (_v(3) * 2.0).requires_grad_()  # another direction, about twice the norm
    margin = 0.1
    h = norm_guard(v, ref, margin)
    vn, rn = v.detach().double().flatten(1).norm(dim=1), ref.double().flatten(1).norm(dim=1)
    torch.testing.assert_close(h.double(), vn / rn - 1 - margin, rtol=1e-6, atol=0)
    (g,) = torch.autograd.grad(h.mean(), v)
    # d/dv mean_B (||v|| / ||v_ref||) = v / (B·||v||·||v_ref||): along v itself, so descent only shrinks its norm
    want = v.detach().double() / (3 * vn * rn)[:, None, None, None]
    torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=1e-12)
    # the reference is a constant: no gradient into it
    assert not norm_guard(v.detach(), ref.clone().requires_grad_(), margin).requires_grad


def test_the_drift_stats_are_the_hand_computed_norms():
    v, ref = _v(4), _v(5) * 0.5
    st = drift_stats(v, ref.flatten(1).norm(dim=1))
    d = v[0].numel()
    vn = [float(torch.sqrt((v[i].double() ** 2).sum())) for i in range(3)]
    rn = [float(torch.sqrt((ref[i].double() ** 2).sum())) for i in range(3)]
    assert float(st["drift/vnorm"]) == pytest.approx(sum(vn) / 3 / d**0.5, rel=1e-6)
    assert float(st["drift/vnorm_ratio"]) == pytest.approx(sum(a / b for a, b in zip(vn, rn)) / 3, rel=1e-6)
    assert set(drift_stats(v, None)) == {"drift/vnorm"}  # nothing to compare with: the norm alone


# ------------------------------------------------------------------------------------------ in the objectives
class Conv(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.conv, self.calls = torch.nn.Conv2d(SHAPE[0], SHAPE[0], 3, padding=1), 0
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape,
                                               generator=torch.Generator().manual_seed(seed)) * 0.1)
            self.conv.bias.zero_()

    def forward(self, x):
        self.calls += 1
        return self.conv(x)


def _step(preset: str, overrides: list[str], *, lagging_seed: int = 1, reference_seed: int = 7):
    """fixed_targets and the loss of one micro-batch of 4 images at one trained point; the forwards are counted."""
    cfg = load_config(TINY_PRESETS / preset, [*overrides, f"{preset.split('_')[0]}.timesteps=1"])
    objective = objective_of(cfg)
    policy, lagging, initial = Conv(0), Conv(lagging_seed), Conv(reference_seed)
    applied = {"lagging": False}

    @contextlib.contextmanager
    def lagging_applied():
        applied["lagging"] = True
        yield
        applied["lagging"] = False

    @contextlib.contextmanager
    def inference(reference: bool = False):
        yield initial if reference else (lagging if applied["lagging"] else policy)

    sampler = SimpleNamespace(sigmas=torch.linspace(1.0, 0.0, cfg.sampling.num_steps + 1),
                              velocity_at=lambda model, x, j, cond: model(x))
    models = SimpleNamespace(engine=policy, sampler=sampler, inference=inference,
                             lagging=SimpleNamespace(applied=lagging_applied))
    x0 = torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(2))
    chunk = SimpleNamespace(ids=[0, 1, 2, 3], trained=[2], traj=SimpleNamespace(x0=x0), noised={}, lagging={},
                            reference={}, cond=None)
    objective.fixed_targets(models, [chunk], step=5)
    adv = torch.tensor([2.0, -1.0, 0.5, -1.5])
    loss, stats = objective.loss(models, chunk, 2, adv)
    (grad,) = torch.autograd.grad(loss, policy.conv.weight)
    return SimpleNamespace(cfg=cfg, objective=objective, policy=policy, lagging=lagging, reference=initial,
                           chunk=chunk, adv=adv, loss=loss.detach(), stats=stats, grad=grad,
                           t=sampler.sigmas[2].expand(4))


GUARD = ["norm_guard.weight=0.5", "norm_guard.margin=0.0"]


def _on(algorithm: str, settings: list[str]) -> list[str]:
    return [f"{algorithm}.{s}" for s in settings]


def _hinge(v: torch.Tensor, target: torch.Tensor) -> float:
    ratio = v.flatten(1).norm(dim=1) / target.flatten(1).norm(dim=1)
    return float(torch.relu(ratio - 1).mean())


def test_awm_without_reference_guards_against_the_lagging_policy_and_pays_its_forward():
    """awm, no anchor, no KL: the guard alone asks for the lagging forward, and the loss is AWM's + weight·hinge."""
    s = _step("awm_lora.yaml", ["awm.anchor_coef=0", *_on("awm", GUARD)], lagging_seed=11)
    assert s.lagging.calls == 1 and s.reference.calls == 0 and s.objective.forwards_per_point() == 4
    x_t, eps = s.chunk.noised[2]
    with torch.no_grad():
        v, v_lag = s.policy.conv(x_t), s.lagging.conv(x_t)
        matching, _ = awm_loss(v, s.chunk.traj.x0, eps, s.t, s.adv / s.cfg.advantage.clip, s.cfg.awm.huber_p)
    hinge = _hinge(v, v_lag)
    assert hinge > 0  # the lagging weights (seed 11) give a smaller velocity here: the hinge acts
    assert float(s.loss) == pytest.approx(float(matching) + 0.5 * hinge, rel=1e-6)
    assert float(s.stats["norm_guard"]) == pytest.approx(hinge, rel=1e-6)
    ratio = (v.flatten(1).norm(dim=1) / v_lag.flatten(1).norm(dim=1)).mean()
    assert float(s.stats["drift/vnorm_ratio"]) == pytest.approx(float(ratio), rel=1e-6)
    assert "anchor" not in s.stats


def test_awm_without_anchor_kl_or_guard_logs_the_norm_alone_and_makes_no_forward():
    s = _step("awm_lora.yaml", ["awm.anchor_coef=0"])
    assert s.lagging.calls == 0 and s.objective.forwards_per_point() == 3
    assert "drift/vnorm" in s.stats and "drift/vnorm_ratio" not in s.stats and "norm_guard" not in s.stats


@pytest.mark.parametrize("preset, algorithm", [("nft_lora.yaml", "nft"), ("awm_lora.yaml", "awm")])
def test_with_a_reference_the_guard_and_the_ratio_compare_with_it(preset, algorithm):
    s = _step(preset, [f"{algorithm}.kl_coef=1e-4", *_on(algorithm, GUARD)])
    assert s.reference.calls == 1
    x_t = s.chunk.noised[2][0]
    with torch.no_grad():
        v, v_ref = s.policy.conv(x_t), s.reference.conv(x_t)
    ratio = (v.flatten(1).norm(dim=1) / v_ref.flatten(1).norm(dim=1)).mean()
    assert float(s.stats["drift/vnorm_ratio"]) == pytest.approx(float(ratio), rel=1e-6)
    assert float(s.stats["norm_guard"]) == pytest.approx(_hinge(v, v_ref), rel=1e-6)


def test_nft_guard_adds_its_term_to_the_nft_loss():
    s = _step("nft_lora.yaml", _on("nft", GUARD), lagging_seed=11)
    x_t = s.chunk.noised[2][0]
    with torch.no_grad():
        v, v_old = s.policy.conv(x_t), s.lagging.conv(x_t)
        base, _ = nft_loss(v, v_old, x_t, s.chunk.traj.x0, s.t, optimality_weight(s.adv, s.cfg.advantage.clip),
                           s.cfg.nft.beta, s.cfg.advantage.clip)
    hinge = _hinge(v, v_old)
    assert hinge > 0 and float(s.loss) == pytest.approx(float(base) + 0.5 * hinge, rel=1e-6)


@pytest.mark.parametrize("preset, algorithm, extra", [("nft_lora.yaml", "nft", []),
                                                      ("awm_lora.yaml", "awm", []),
                                                      ("awm_lora.yaml", "awm", ["awm.anchor_coef=0"])])
def test_at_the_first_pass_the_guard_changes_nothing_bit_for_bit(preset, algorithm, extra):
    """The lagging policy is the policy (step 0): the hinge is exactly 0, the ratio exactly 1, and the loss and its
    gradient are those of the unguarded run."""
    plain = _step(preset, extra, lagging_seed=0)
    guarded = _step(preset, [*extra, *_on(algorithm, GUARD)], lagging_seed=0)
    assert float(guarded.stats["norm_guard"]) == 0.0 and float(guarded.stats["drift/vnorm_ratio"]) == 1.0
    assert torch.equal(guarded.loss, plain.loss) and torch.equal(guarded.grad, plain.grad)


def test_the_guard_is_off_by_default_and_its_settings_are_checked():
    for preset, algorithm in (("nft_lora.yaml", "nft"), ("awm_lora.yaml", "awm")):
        assert getattr(load_config(TINY_PRESETS / preset), algorithm).norm_guard is None
        cfg = load_config(TINY_PRESETS / preset, _on(algorithm, GUARD))
        assert getattr(cfg, algorithm).norm_guard.weight == 0.5
    for bad in (["awm.norm_guard.weight=0"], ["awm.norm_guard.weight=0.1", "awm.norm_guard.margin=-0.01"]):
        with pytest.raises(ConfigError, match="awm.norm_guard: weight"):
            load_config(TINY_PRESETS / "awm_lora.yaml", bad)


def test_the_anchor_is_unchanged_by_the_guard():
    """awm with its anchor: the anchor term still uses the lagging velocity, the guard adds its own term."""
    s = _step("awm_lora.yaml", _on("awm", GUARD), lagging_seed=11)
    x_t = s.chunk.noised[2][0]
    with torch.no_grad():
        anchor = velocity_mse(s.policy.conv(x_t), s.lagging.conv(x_t)).mean()
    assert s.lagging.calls == 1 and float(s.stats["anchor"]) == pytest.approx(float(anchor), rel=1e-6)


# --------------------------------------------------------------------------------------------------------- grpo
def _grpo(kl_coef: float):
    """grpo's fixed targets and loss at transition 1 of 3 stored trajectories, through the real SDE transition, with a
    linear 'transformer' on the latent's channels; the policy is the rollout's (first pass)."""
    from grpo.rollout import SDEParams, transition

    cfg = load_config(TINY_PRESETS / "grpo_lora.yaml", [f"grpo.kl_coef={kl_coef}"])
    objective = objective_of(cfg)
    policy, initial = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    with torch.no_grad():
        initial.weight.mul_(0.5)  # a smaller velocity than the policy's
    sigmas, sde = torch.linspace(1.0, 0.0, 5), SDEParams(0.7, "dance")
    sampler = SimpleNamespace(sigmas=sigmas, tree=None, transition=lambda model, cond, latents, j: transition(
        lambda x, t, c: model(x), cond, latents, sigmas, j, sde))

    @contextlib.contextmanager
    def inference(reference: bool = False):
        assert reference
        yield initial

    models = SimpleNamespace(engine=policy, sampler=sampler, inference=inference)
    latents = torch.randn(3, 5, 6, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        log_probs = torch.stack([sampler.transition(policy, None, latents, j).log_prob for j in range(4)], 1)
    chunk = SimpleNamespace(ids=[0, 1, 2], trained=[1], traj=SimpleNamespace(latents=latents, log_probs=log_probs),
                            reference={}, reference_vnorm={}, cond=None, weight=1.0)
    objective.fixed_targets(models, [chunk], step=0)
    _, stats = objective.loss(models, chunk, 1, torch.tensor([1.0, -1.0, 0.5]))
    with torch.no_grad():
        v, v_ref = policy(latents[:, 1]), initial(latents[:, 1])
    return stats, v, v_ref


def test_grpo_logs_the_norm_and_with_a_reference_its_ratio():
    stats, v, v_ref = _grpo(0.01)
    norms = v.flatten(1).norm(dim=1)
    assert float(stats["drift/vnorm"]) == pytest.approx(float(norms.mean() / v[0].numel() ** 0.5), rel=1e-6)
    ratio = (norms / v_ref.flatten(1).norm(dim=1)).mean()
    assert float(stats["drift/vnorm_ratio"]) == pytest.approx(float(ratio), rel=1e-6) and float(ratio) > 1
    assert float(stats["ratio"].max()) == 1.0  # the first-pass ratio is untouched


def test_grpo_without_a_reference_logs_the_norm_alone():
    stats, _, _ = _grpo(0.0)
    assert "drift/vnorm" in stats and "drift/vnorm_ratio" not in stats


def test_a_checkpoint_from_before_the_guard_resumes_only_with_it_off():
    """norm_guard is a section, null = off: a run saved before it existed resumes with it off; turning it on (or
    changing it) on resume is refused, as any setting that changes the training."""
    from grpo.compat import config_differences
    from grpo.config import to_dict

    preset = TINY_PRESETS / "nft_lora.yaml"
    before = to_dict(load_config(preset))
    del before["nft"]["norm_guard"]
    assert config_differences(before, to_dict(load_config(preset))) == []
    on = to_dict(load_config(preset, _on("nft", GUARD)))
    assert config_differences(before, on) and config_differences(to_dict(load_config(preset)), on)
    assert config_differences(on, to_dict(load_config(preset, ["nft.norm_guard.weight=0.1"])))
