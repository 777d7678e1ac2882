"""Sigma schedules and the SDE/ODE step against closed forms, torch.distributions and diffusers."""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo.errors import ConfigError
from grpo.models.flux1 import FLUX1
from grpo.sde import (
    StepOut,
    gaussian_log_prob,
    kl_same_std,
    predicted_x0,
    sde_step,
    shifted_sigmas,
)

# FLUX.1-dev scheduler/scheduler_config.json
FLUX_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _xv(shape=(3, 16, 8), seed=0, dtype=torch.float32):
    g = _gen(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _dims(t):
    return tuple(range(1, t.ndim))


class _DtypeRecorder(TorchDispatchMode):
    """Records the dtype of every tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.dtypes.add(o.dtype)
        return out


# --- schedules -------------------------------------------------------------------------------------------------


def test_shifted_sigmas_matches_dancegrpo_table():
    table = [1.0, .978, .955, .929, .900, .868, .833, .794, .750, .700, .643, .577, .500, .409, .300, .167, 0.0]
    s = shifted_sigmas(16, 3.0)
    assert s.dtype == torch.float32 and s.shape == (17,)
    torch.testing.assert_close(s, torch.tensor(table), atol=5e-4, rtol=0)
    assert s[0].item() == 1.0 and s[-1].item() == 0.0


@pytest.mark.parametrize("n,shift", [(1, 1.0), (6, 3.0), (16, 3.0), (28, 0.5), (50, 7.0)])
def test_shifted_sigmas_monotone_and_formula(n, shift):
    s = shifted_sigmas(n, shift)
    assert s[0].item() == 1.0 and s[-1].item() == 0.0
    assert bool((s[1:] < s[:-1]).all())
    u = [1 - i / n for i in range(n + 1)]
    ref = torch.tensor([shift * x / (1 + (shift - 1) * x) for x in u], dtype=torch.float32)
    torch.testing.assert_close(s, ref, atol=1e-6, rtol=0)
    if shift == 1.0:
        torch.testing.assert_close(s, torch.linspace(1, 0, n + 1), atol=1e-6, rtol=0)


def test_shifted_sigmas_bad_settings():
    with pytest.raises(ConfigError, match="num_steps"):
        shifted_sigmas(0, 3.0)
    with pytest.raises(ConfigError, match="shift"):
        shifted_sigmas(4, 0.0)


@pytest.mark.parametrize("n,seq_len", [(6, 16), (16, 2025), (28, 4096), (10, 1024)])
def test_dynamic_sigmas_is_static_shift_with_exp_mu(n, seq_len):
    s = FLUX1.dynamic_sigmas(n, seq_len, FLUX_SCHEDULER)
    assert s.dtype == torch.float32 and s.shape == (n + 1,) and s[-1].item() == 0.0
    assert bool((s[1:] < s[:-1]).all())
    m = (1.15 - 0.5) / (4096 - 256)
    mu = seq_len * m + (0.5 - m * 256)
    torch.testing.assert_close(s, shifted_sigmas(n, math.exp(mu)), atol=2e-6, rtol=0)


def test_dynamic_sigmas_known_values():
    # 1024² image: L = 4096 -> mu = 1.15, s = e^1.15 ≈ 3.158 (diffusers pipeline_flux.py calculate_shift).
    s = FLUX1.dynamic_sigmas(4, 4096, FLUX_SCHEDULER)
    e = math.exp(1.15)
    ref = [e * u / (1 + (e - 1) * u) for u in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    torch.testing.assert_close(s, torch.tensor(ref), atol=1e-6, rtol=0)


# --- ODE step ----------------------------------------------------------------------------------------------------


def test_ode_step_equals_diffusers_euler_step():
    from diffusers import FlowMatchEulerDiscreteScheduler

    n, seq = 6, 32
    sigmas = FLUX1.dynamic_sigmas(n, seq, FLUX_SCHEDULER)
    sched = FlowMatchEulerDiscreteScheduler.from_config(FLUX_SCHEDULER)
    mu = 0.5 + (seq - 256) * 0.65 / 3840
    sched.set_timesteps(sigmas=[1.0 - i * (1.0 - 1 / n) / (n - 1) for i in range(n)], mu=mu)
    torch.testing.assert_close(sched.sigmas, sigmas, atol=1e-6, rtol=0)
    x_ref, _ = _xv((2, seq, 64), seed=1)
    x_ours = x_ref.clone()
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(x_ref.shape, generator=_gen(10 + i))
        x_ref = sched.step(v, t, x_ref).prev_sample
        out = sde_step(x_ours, v, sched.sigmas[i].item(), sched.sigmas[i + 1].item(), eta=0.0)
        assert out.log_prob is None and float(out.std) == 0.0
        assert torch.equal(out.prev_sample, x_ref), i
        x_ours = out.prev_sample
    # Tensor sigmas (0-d and [B]) give the same arithmetic.
    x, v = _xv((2, 4, 8))
    a = sde_step(x, v, 0.7, 0.5, eta=0.0).prev_sample
    b = sde_step(x, v, torch.tensor(0.7), torch.tensor(0.5), eta=0.0).prev_sample
    c = sde_step(x, v, torch.full((2,), 0.7), torch.full((2,), 0.5), eta=0.0).prev_sample
    assert torch.equal(a, b) and torch.equal(a, c)


def test_sde_mean_tends_to_ode_step():
    x, v = _xv()
    ode = sde_step(x, v, 0.8, 0.7, eta=0.0).prev_sample
    for kind in ("dance", "flow"):
        far = (sde_step(x, v, 0.8, 0.7, eta=1e-1, kind=kind, prev_sample=ode).mean - ode).abs().max()
        near = (sde_step(x, v, 0.8, 0.7, eta=1e-3, kind=kind, prev_sample=ode).mean - ode).abs().max()
        assert near < far / 1000 * 1.01 + 1e-6
        assert near < 1e-5


# --- SDE means against the peers' written forms ----------------------------------------------------------------


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.978), (0.7, 0.643), (0.167, 0.0)])
def test_dance_mean_and_std_match_dancegrpo(sigma, sigma_next):
    x, v = _xv(seed=2)
    eta = 0.3
    out = sde_step(x, v, sigma, sigma_next, eta=eta, kind="dance", noise=torch.zeros_like(x))
    dsigma = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    ref = x + dsigma * v - 0.5 * eta**2 * score * dsigma
    torch.testing.assert_close(out.mean, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.std, torch.tensor(eta * math.sqrt(sigma - sigma_next)))
    torch.testing.assert_close(predicted_x0(x, v, sigma), x0)


def test_dance_std_range_from_algorithm_doc():
    # eta 0.3, N 16, shift 3: std grows from 0.044 (first step) to ~0.12 (last step; exactly 0.3·sqrt(1/6)).
    s = shifted_sigmas(16, 3.0)
    x, v = _xv((1, 4))
    stds = [float(sde_step(x, v, s[i], s[i + 1], eta=0.3, noise=torch.zeros_like(x)).std) for i in range(16)]
    assert abs(stds[0] - 0.044) < 5e-4 and abs(stds[-1] - 0.3 * math.sqrt(1 / 6)) < 1e-6
    assert all(a < b for a, b in zip(stds, stds[1:]))


@pytest.mark.parametrize("sigma,sigma_next", [(0.9, 0.8), (0.4, 0.25), (0.1, 0.0)])
def test_flow_mean_and_std_match_flow_grpo(sigma, sigma_next):
    x, v = _xv(seed=3)
    a = 0.7
    out = sde_step(x, v, sigma, sigma_next, eta=a, kind="flow", noise=torch.zeros_like(x))
    std_dev_t = a * math.sqrt(sigma / (1 - sigma))
    dt = sigma_next - sigma
    ref = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    torch.testing.assert_close(out.mean, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.std, torch.tensor(std_dev_t * math.sqrt(-dt)))


def test_flow_at_sigma_one_uses_sigma_max():
    x, v = _xv(seed=4)
    s = shifted_sigmas(10, 3.0)
    sigma_max = s[1].item()  # what Flow-GRPO passes
    out = sde_step(x, v, s[0], s[1], eta=0.9, kind="flow", noise=torch.zeros_like(x), sigma_max=sigma_max)
    std_dev_t = 0.9 * math.sqrt(1.0 / (1 - sigma_max))
    torch.testing.assert_close(out.std, torch.tensor(std_dev_t * math.sqrt(1.0 - sigma_max)))
    assert torch.isfinite(out.mean).all()
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step(x, v, 1.0, 0.9, eta=0.9, kind="flow", noise=torch.zeros_like(x))


def test_bad_kind_and_missing_noise():
    x, v = _xv()
    with pytest.raises(ConfigError, match="kind"):
        sde_step(x, v, 0.5, 0.4, eta=0.3, kind="bogus")
    with pytest.raises(ValueError, match="noise"):
        sde_step(x, v, 0.5, 0.4, eta=0.3)


# --- log-probs and KL -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dance", "flow"])
def test_log_prob_equals_torch_normal(kind):
    x, v = _xv(seed=5)
    noise = torch.randn(x.shape, generator=_gen(6))
    out = sde_step(x, v, 0.6, 0.5, eta=0.5, kind=kind, noise=noise)
    torch.testing.assert_close(out.prev_sample, out.mean + out.std * noise)
    ref = torch.distributions.Normal(out.mean, out.std).log_prob(out.prev_sample).mean(_dims(x))
    assert out.log_prob.shape == (3,)
    torch.testing.assert_close(out.log_prob, ref, atol=1e-5, rtol=1e-5)
    # Re-evaluating the stored transition (training) gives the rollout log-prob back.
    again = sde_step(x, v, 0.6, 0.5, eta=0.5, kind=kind, prev_sample=out.prev_sample)
    torch.testing.assert_close(again.log_prob, out.log_prob, atol=1e-6, rtol=0)


def test_per_sample_sigmas_match_scalar_calls():
    x, v = _xv(seed=7)
    noise = torch.randn(x.shape, generator=_gen(8))
    sig, nxt = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.45, 0.0])
    batched = sde_step(x, v, sig, nxt, eta=0.3, noise=noise)
    assert batched.std.shape == (3,)
    for b in range(3):
        one = sde_step(x[b : b + 1], v[b : b + 1], sig[b].item(), nxt[b].item(), eta=0.3, noise=noise[b : b + 1])
        torch.testing.assert_close(batched.prev_sample[b : b + 1], one.prev_sample)
        torch.testing.assert_close(batched.log_prob[b : b + 1], one.log_prob)
    ref = torch.distributions.Normal(batched.mean, batched.std.view(3, 1, 1)).log_prob(batched.prev_sample)
    torch.testing.assert_close(batched.log_prob, ref.mean(_dims(x)))


def test_gaussian_log_prob_direct():
    g = _gen(9)
    sample, mean = torch.randn(4, 5, 6, generator=g), torch.randn(4, 5, 6, generator=g)
    std = torch.tensor([0.1, 0.5, 1.0, 2.0])
    ref = torch.distributions.Normal(mean, std.view(4, 1, 1)).log_prob(sample).mean((1, 2))
    torch.testing.assert_close(gaussian_log_prob(sample, mean, std), ref)
    ref = torch.distributions.Normal(mean, 0.3).log_prob(sample).mean((1, 2))
    torch.testing.assert_close(gaussian_log_prob(sample, mean, 0.3), ref)


def test_kl_same_std_equals_torch_kl():
    g = _gen(10)
    mp, mq = torch.randn(4, 7, 3, generator=g), torch.randn(4, 7, 3, generator=g)
    for std in (0.05, torch.tensor([0.1, 0.2, 0.3, 0.4])):
        sb = std if isinstance(std, float) else std.view(4, 1, 1)
        ref = torch.distributions.kl_divergence(
            torch.distributions.Normal(mp, sb), torch.distributions.Normal(mq, sb)
        ).mean((1, 2))
        torch.testing.assert_close(kl_same_std(mp, mq, std), ref, atol=1e-4, rtol=1e-5)
    assert torch.equal(kl_same_std(mp, mp, 0.1), torch.zeros(4))


def test_sample_is_detached_but_mean_keeps_graph():
    x, _ = _xv(seed=11)
    v = torch.randn(x.shape, generator=_gen(12)).requires_grad_(True)
    noise = torch.randn(x.shape, generator=_gen(13))
    out = sde_step(x, v, 0.6, 0.5, eta=0.3, noise=noise)
    out.log_prob.sum().backward()
    # d logp / d mean = (sample - mean) / (std² · D); d mean / d v = -delta·(1 + g²(1-σ)/(2σ)).
    d = x[0].numel()
    delta, g2 = 0.1, 0.09
    dmean_dv = -delta * (1 + g2 * (1 - 0.6) / (2 * 0.6))
    expected = (out.std * noise / out.std**2 / d * dmean_dv).detach()
    torch.testing.assert_close(v.grad, expected, atol=1e-6, rtol=1e-4)
    assert v.grad.abs().sum() > 0


# --- dtypes ------------------------------------------------------------------------------------------------------


def test_float32_outputs_for_bf16_inputs():
    x, v = _xv(dtype=torch.bfloat16)
    noise = torch.randn(x.shape, generator=_gen(14)).to(torch.bfloat16)
    for kind in ("dance", "flow"):
        out = sde_step(x, v, 0.5, 0.4, eta=0.3, kind=kind, noise=noise)
        for t in (out.prev_sample, out.mean, out.std, out.log_prob):
            assert t.dtype == torch.float32
        out = sde_step(x, v, 0.5, 0.4, eta=0.3, kind=kind, prev_sample=out.prev_sample.bfloat16())
        assert out.log_prob.dtype == torch.float32
    assert sde_step(x, v, 0.5, 0.4, eta=0.0).prev_sample.dtype == torch.float32
    assert predicted_x0(x, v, 0.5).dtype == torch.float32
    assert gaussian_log_prob(x, v, 0.5).dtype == torch.float32
    assert kl_same_std(x, v, torch.tensor(0.5, dtype=torch.bfloat16)).dtype == torch.float32


def test_no_float64_tensors_produced():
    x, v = _xv(dtype=torch.bfloat16)
    noise = torch.randn(x.shape, generator=_gen(15))
    rec = _DtypeRecorder()
    with rec:
        s = shifted_sigmas(8, 3.0)
        FLUX1.dynamic_sigmas(8, 64, FLUX_SCHEDULER)
        for kind in ("dance", "flow"):
            out = sde_step(x, v, s[0].item(), s[1].item(), eta=0.7, kind=kind, noise=noise, sigma_max=s[1].item())
            sde_step(x, v, s[2], s[3], eta=0.7, kind=kind, prev_sample=out.prev_sample)
        sde_step(x, v, 0.5, 0.25, eta=0.0)
        kl_same_std(x, v, 0.1)
        predicted_x0(x, v, 0.3)
    assert not rec.dtypes & {torch.float64, torch.complex64, torch.complex128}, rec.dtypes
    assert torch.float32 in rec.dtypes


def test_stepout_is_a_dataclass():
    x, v = _xv()
    out = sde_step(x, v, 0.5, 0.4, eta=0.3, noise=torch.zeros_like(x))
    assert isinstance(out, StepOut)
    assert torch.equal(out.prev_sample, out.mean)
