"""Sigma schedules and one stochastic (or deterministic) flow-matching sampler step with its log-probability.

Conventions (DanceGRPO fastvideo/train_grpo_flux.py, Flow-GRPO flow_grpo/diffusers_patch/sd3_sde_with_logprob.py):
sigma runs from 1 (noise) to 0 (data), x_sigma = (1 - sigma)·x0 + sigma·noise,
the model predicts the velocity v = noise - x0. All arithmetic here is float32 whatever the input dtype, and no
float64 or complex tensor is ever created (Ascend NPUs lack them). Log-probs and KLs are averaged over all
non-batch elements, the DanceGRPO / Flow-GRPO convention that keeps probability ratios near 1 (deviations of
1e-3..1e-4 after an update, DanceGRPO issue #47).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.errors import ConfigError

__all__ = [
    "StepOut",
    "dynamic_sigmas",
    "gaussian_log_prob",
    "kl_same_std",
    "log_prob_gain",
    "predicted_x0",
    "sde_mean_std",
    "sde_sample",
    "sde_step",
    "shifted_sigmas",
    "time_shift",
]

SDE_KINDS = ("dance", "flow", "cps")
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def shifted_sigmas(num_steps: int, shift: float) -> Tensor:
    """SD3 static time shift of a linear schedule, as DanceGRPO samples FLUX (fastvideo/train_grpo_flux.py).

    sigma_i = s·u_i / (1 + (s - 1)·u_i) with u_i = 1 - i/N, written as u / (u + (1 - u)/s) so that both ends are
    exactly 1 and 0 in float32.

    Args:
        num_steps: N, the number of sampler steps (>= 1).
        shift: s > 0; 1 means no shift, larger values spend more steps at high noise.

    Returns:
        float32 Tensor [N + 1], strictly decreasing from 1.0 to 0.0.
    """
    if num_steps < 1:
        raise ConfigError(f"num_steps: must be >= 1, got {num_steps}; use a positive number of sampler steps")
    if not shift > 0:
        raise ConfigError(f"shift: must be > 0, got {shift}; use e.g. 3.0 (DanceGRPO) or 1.0 for no shift")
    return time_shift(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32), shift)


def time_shift(u: Tensor, shift: float) -> Tensor:
    """The SD3 static time shift s·u / (1 + (s - 1)·u) of float32 times u in [0, 1], as u / (u + (1 - u)/s)."""
    return u / (u + (1.0 - u) / float(shift))


def dynamic_sigmas(num_steps: int, mu: float, scheduler_config: dict) -> Tensor:
    """The schedule a FLUX pipeline builds with FlowMatchEulerDiscreteScheduler for the dynamic shift `mu`.

    Reuses diffusers rather than re-deriving it, so inference with the stock pipeline and our rollout agree. The
    family's pipeline computes mu from the token count (grpo.models: FLUX.1's calculate_shift, FLUX.2's empirical
    rule).

    Args:
        num_steps: N, the number of sampler steps (>= 1).
        mu: the time shift's log-scale (the sampler shifts by exp(mu)).
        scheduler_config: the model's scheduler/scheduler_config.json as a dict.

    Returns:
        float32 Tensor [N + 1] ending with 0 (scheduler.sigmas).
    """
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    if num_steps < 1:
        raise ConfigError(f"num_steps: must be >= 1, got {num_steps}; use a positive number of sampler steps")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    # Same lines as FluxPipeline.__call__ and Flux2KleinPipeline.__call__ (diffusers 0.3x-0.4x).
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    if getattr(scheduler.config, "use_flow_sigmas", False):
        sigmas = None
    if sigmas is None:
        scheduler.set_timesteps(num_inference_steps=num_steps, mu=mu)
    else:
        scheduler.set_timesteps(sigmas=sigmas, mu=mu)
    return scheduler.sigmas.to(torch.float32)


def predicted_x0(x: Tensor, v: Tensor, sigma: float | Tensor) -> Tensor:
    """Clean-latent estimate x̂0 = x - sigma·v (float32).

    Args:
        x: [B, ...] noisy latent at sigma.
        v: [B, ...] predicted velocity.
        sigma: python float, 0-d or [B] tensor.
    """
    x, v = x.float(), v.float()
    return x - _bcast(_as_f32(sigma, x.device), x.ndim) * v


@dataclass
class StepOut:
    """Result of one sampler step.

    Attributes:
        prev_sample: [B, ...] float32 latent at sigma_next (the given one when evaluating a stored transition).
        mean: [B, ...] float32 Gaussian mean of the transition; carries the graph of v.
        std: float32 std, 0-d or [B] (the shape of sigma); 0 for an ODE step.
        log_prob: [B] float32 element-mean log-density of prev_sample, or None for an ODE step; for kind "cps" the
            unnormalised -mean_D (prev_sample - mean)² that Flow-GRPO uses instead.
        velocity: the velocity the step was taken with, where the caller keeps it (grpo.rollout.transition: one row
            per sample, or per node with a tree), else None.
    """

    prev_sample: Tensor
    mean: Tensor
    std: Tensor
    log_prob: Tensor | None
    velocity: Tensor | None = None


def sde_step(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    eta: float,
    kind: str = "dance",
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
    sigma_max: float | None = None,
) -> StepOut:
    """One Euler–Maruyama step of the reverse SDE (or the Euler ODE step when eta == 0), with its log-prob.

    Common form of DanceGRPO's flux_step and Flow-GRPO's sde_step_with_logprob, delta = sigma - sigma_next > 0:
        mean = x - delta·[v + g²/(2·sigma)·(x + (1 - sigma)·v)],  std = g·sqrt(delta)
    "dance" (DanceGRPO): g = eta. "flow" (Flow-GRPO): g = eta·sqrt(sigma / (1 - sigma')), sigma' = sigma_max where
    sigma == 1 (Flow-GRPO passes scheduler.sigmas[1] there to avoid dividing by zero), else sigma.

    "cps" (coefficients-preserving sampling, Flow-GRPO sde_type='cps'; paper arXiv 2509.05952 §3) is a DDIM-style
    step instead, see :func:`_cps_mean_std`. Its log_prob is NOT a Gaussian log-density: it is Flow-GRPO's unnormalised
    -mean_D (prev_sample - mean)² (no 1/(2·std²), no log std, no constant), so CPS log-ratios are 2·std² times the
    Gaussian ones and the clip range must be chosen for that scale (Flow-GRPO uses 1e-5 with CPS).

    Args:
        x: [B, ...] latent at sigma (any float dtype; upcast to float32).
        v: [B, ...] velocity predicted at (x, sigma).
        sigma, sigma_next: python floats, 0-d or [B] tensors, sigma > sigma_next >= 0.
        eta: noise level (DanceGRPO eta, Flow-GRPO noise_level); 0 gives the deterministic ODE step.
        kind: "dance", "flow" or "cps" (for "cps" eta is Flow-GRPO's noise_level, 0 <= eta <= 1).
        noise: [B, ...] standard normal noise, required when sampling with eta > 0. The caller draws it (on CPU, from
            its own generator) so rollouts are reproducible across devices.
        prev_sample: [B, ...] a stored next latent; when given, its log-prob under this step's Gaussian is returned
            (training) and no noise is needed.
        sigma_max: the sigma' used by "flow" where sigma == 1.

    Returns:
        StepOut. For eta == 0: prev_sample = mean = x + (sigma_next - sigma)·v, exactly diffusers'
        FlowMatchEulerDiscreteScheduler.step arithmetic in float32, std 0, log_prob None.
    """
    if kind not in SDE_KINDS:
        raise ConfigError(f"kind: unknown SDE kind {kind!r}; use one of {SDE_KINDS}")
    if eta < 0:
        raise ConfigError(f"eta: must be >= 0, got {eta}; use e.g. 0.3 (dance) or 0.7-0.9 (flow)")
    if kind == "cps" and eta > 1:
        raise ConfigError(f"eta: cps noise level must be <= 1, got {eta}; use e.g. 0.8 (Flow-GRPO's default)")
    x, v = x.float(), v.float()
    if eta == 0:
        # Kept separate so the ODE path is bit-identical to the diffusers Euler step.
        s, s_next = _as_f32(sigma, x.device), _as_f32(sigma_next, x.device)
        out = x + (_bcast(s_next, x.ndim) - _bcast(s, x.ndim)) * v
        return StepOut(prev_sample=out, mean=out, std=torch.zeros_like(s_next - s), log_prob=None)
    mean, std = sde_mean_std(x, v, sigma, sigma_next, eta=eta, kind=kind, sigma_max=sigma_max)
    return sde_sample(mean, std, kind, noise=noise, prev_sample=prev_sample)


def sde_mean_std(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, *, eta: float,
                 kind: str = "dance", sigma_max: float | None = None) -> tuple[Tensor, Tensor]:
    """The mean [B, ...] and std (0-d or [B]) of one stochastic step (eta > 0), in float32; see :func:`sde_step`."""
    x, v = x.float(), v.float()
    s = _as_f32(sigma, x.device)
    s_next = _as_f32(sigma_next, x.device)
    sb, sb_next = _bcast(s, x.ndim), _bcast(s_next, x.ndim)
    if kind == "cps":
        return _cps_mean_std(x, v, sb, sb_next, s_next, eta)
    delta = s - s_next
    if kind == "dance":
        g = torch.full_like(s, eta)
    else:
        if sigma_max is None and bool((s == 1).any()):
            raise ValueError("sde_step(kind='flow') at sigma == 1 needs sigma_max (Flow-GRPO uses sigmas[1])")
        denom_sigma = s if sigma_max is None else torch.where(s == 1, _as_f32(sigma_max, x.device), s)
        g = eta * torch.sqrt(s / (1.0 - denom_sigma))
    std = g * torch.sqrt(delta)
    gb, db = _bcast(g, x.ndim), _bcast(delta, x.ndim)
    mean = x - db * (v + gb**2 / (2.0 * sb) * (x + (1.0 - sb) * v))
    return mean, std


def log_prob_gain(sigma: float, sigma_next: float, *, eta: float, kind: str, sigma_max: float | None = None) -> float:
    """How strongly one step's log-prob answers the velocity: |d log_prob / d v| per unit of the step's noise.

    Every kind's mean is linear in v, mean = ... + a·v, and the stored sample is mean + std·eps, so the log-prob's
    gradient in v is eps·a/std for the Gaussian kinds (dance, flow) and 2·eps·a·std for cps (its unnormalised
    -(x' - mean)²). For flow that is sqrt(delta)/g + g·sqrt(delta)·(1 - sigma)/(2·sigma): Flash-GRPO's
    `value` (Shredded-Pork/Flash-GRPO@4211013 scripts/train_wanx2_1_flash.py:983, its comment). a and std are read off
    sde_mean_std itself (at x = 0, v = 0 and 1), so the gain is the sampler's own, for every kind.
    """
    zero = torch.zeros(1)
    m0, std = sde_mean_std(zero, zero, sigma, sigma_next, eta=eta, kind=kind, sigma_max=sigma_max)
    m1, _ = sde_mean_std(zero, torch.ones(1), sigma, sigma_next, eta=eta, kind=kind, sigma_max=sigma_max)
    a, std = float((m1 - m0).abs()), float(std)
    return 2.0 * a * std if kind == "cps" else a / std


def sde_sample(mean: Tensor, std: Tensor, kind: str, *, noise: Tensor | None = None,
               prev_sample: Tensor | None = None) -> StepOut:
    """A step's sample mean + std·noise (or the stored `prev_sample`) and its log-prob; see :func:`sde_step`."""
    stdb = _bcast(std, mean.ndim)
    if prev_sample is None:
        if noise is None:
            raise ValueError("sde_step with eta > 0 needs `noise` (standard normal, shape of x) or `prev_sample`")
        prev_sample = mean + stdb * noise.to(device=mean.device, dtype=torch.float32)
    else:
        prev_sample = prev_sample.to(device=mean.device, dtype=torch.float32)
    if kind == "cps":
        log_prob = _element_mean(-((prev_sample.detach() - mean) ** 2))
    else:
        log_prob = gaussian_log_prob(prev_sample.detach(), mean, std)
    return StepOut(prev_sample=prev_sample, mean=mean, std=std, log_prob=log_prob)


def _cps_mean_std(x: Tensor, v: Tensor, sb: Tensor, sb_next: Tensor, s_next: Tensor,
                  eta: float) -> tuple[Tensor, Tensor]:
    """Coefficients-preserving sampling step: its mean and std (sde_step adds its log-prob), as Flow-GRPO computes.

    Source: yifan123/flow_grpo@54809b5 flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, sde_type == 'cps' (same
    lines at 879042c and IamCreateAI/FlowCPS@814c359); paper arXiv 2509.05952 §3. With sigma' = sigma_next:
        std = sigma'·sin(eta·pi/2)                       (no sqrt(delta), no dependence on sigma)
        mean = x̂0·(1 - sigma') + x̂1·sqrt(sigma'² - std²), x̂0 = x - sigma·v, x̂1 = x + v·(1 - sigma)
        prev_sample = mean + std·noise
        log_prob = -mean_D (prev_sample - mean)²          (Flow-GRPO: "remove all constants")
    Same float32 expressions in the same order as the source. The noise coefficient of prev_sample stays sigma'
    (sqrt(cos² + sin²)), hence the name. At sigma' = 0 the std is 0 and the step is deterministic (never trained).
    Difference to the other kinds: the log_prob is unnormalised (a Gaussian log-density would add
    -(..)²/(2·std²) scaling, -log std and -½·log 2π), which is what Flow-GRPO trains on; see :func:`sde_step`.
    """
    std = s_next * math.sin(eta * math.pi / 2)
    stdb = _bcast(std, x.ndim)
    pred_original_sample = x - sb * v
    noise_estimate = x + v * (1 - sb)
    mean = pred_original_sample * (1 - sb_next) + noise_estimate * torch.sqrt(sb_next**2 - stdb**2)
    return mean, std


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: float | Tensor) -> Tensor:
    """log N(sample; mean, std²) with all constants, averaged over the non-batch elements.

    Args:
        sample, mean: [B, ...].
        std: python float, 0-d or [B] tensor, > 0.

    Returns:
        float32 Tensor [B].
    """
    sample, mean = sample.float(), mean.float()
    std_b = _bcast(_as_f32(std, mean.device), mean.ndim)
    lp = -((sample - mean) ** 2) / (2.0 * std_b**2) - torch.log(std_b) - _HALF_LOG_2PI
    return _element_mean(lp)


def kl_same_std(mean_p: Tensor, mean_q: Tensor, std: float | Tensor) -> Tensor:
    """KL(N(mean_p, std²) || N(mean_q, std²)) = (mean_p - mean_q)² / (2·std²), averaged over non-batch elements.

    Args:
        mean_p, mean_q: [B, ...] (e.g. policy and reference means of the same step).
        std: python float, 0-d or [B] tensor, > 0.

    Returns:
        float32 Tensor [B].
    """
    mean_p, mean_q = mean_p.float(), mean_q.float()
    std_b = _bcast(_as_f32(std, mean_p.device), mean_p.ndim)
    return _element_mean((mean_p - mean_q) ** 2 / (2.0 * std_b**2))


def _as_f32(value: float | Tensor, device: torch.device) -> Tensor:
    """A python number or tensor as a float32 tensor on `device` (never via float64)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32)
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def _bcast(t: Tensor, ndim: int) -> Tensor:
    """Reshape a 0-d or [B] tensor to broadcast against a [B, ...] tensor with `ndim` dims."""
    if t.ndim == 0:
        return t
    if t.ndim != 1:
        raise ValueError(f"expected a scalar or a [B] tensor, got shape {tuple(t.shape)}")
    return t.reshape(-1, *([1] * (ndim - 1)))


def _element_mean(t: Tensor) -> Tensor:
    return t.mean(dim=tuple(range(1, t.ndim))) if t.ndim > 1 else t
