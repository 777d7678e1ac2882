"""MixGRPO-Flash's faster deterministic solver after the SDE window: multistep DPM-Solver++ (order 2, midpoint) for
flow matching in data (x̂0) prediction, on a compressed tail schedule.

Source: Tencent-Hunyuan/MixGRPO@e5cdd6a fastvideo/utils/sampling_utils.py:12-155 (run_sample_step, "post"
strategy: tail schedule), :273-644 (dpm_step, dpm_solver_first_order_update,
multistep_dpm_solver_second_order_update, _sigma_to_alpha_sigma_t); paper arXiv 2507.21802 §3 (MixGRPO-Flash);
DPM-Solver++ arXiv 2211.01095. For flow matching alpha = 1 - sigma, lambda = log(alpha / sigma), and the data
prediction is x̂0 = x - sigma·v. All arithmetic is float32. Rollout-only (no_grad): nothing here is trained.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from grpo.errors import ConfigError
from grpo.sde import _as_f32, time_shift

__all__ = ["dpm_solver_pp_sample", "dpm_solver_pp_step", "flash_sigmas", "tail_points"]


def tail_points(num_steps: int, last_sde: int, compress_ratio: float) -> int:
    """n, the points of MixGRPO-Flash's tail schedule (n - 1 solver steps), from sigma_{L+1} down to 0.

    Source: sampling_utils.py run_sample_step: ``num_post_steps = int(max((T - 1 - L + 1)·r, 1))`` with
    sigma_schedule.size(0) = T + 1, i.e. n = floor(max((T - L)·r, 1)).
    Difference (pitfall "Flash ending above sigma 0"): the source allows n = 1, whose tail linspace(t, 0, 1) = [t]
    ends the rollout at sigma_{L+1} > 0 and decodes a noisy latent; here n >= 2, so the tail always ends at 0.
    """
    if not 0 < compress_ratio <= 1:
        raise ConfigError(f"compress_ratio: must be in (0, 1], got {compress_ratio}; MixGRPO-Flash uses 0.4")
    if not 0 <= last_sde < num_steps - 1:
        raise ValueError(f"last_sde: {last_sde} must be in [0, num_steps - 1) = [0, {num_steps - 1})")
    return max(int(max((num_steps - last_sde) * compress_ratio, 1)), 2)


def flash_sigmas(sigmas: Tensor, last_sde: int, compress_ratio: float, shift: float) -> Tensor:
    """The rollout schedule of MixGRPO-Flash: sigmas[0..L+1] of the original grid, then the compressed tail to 0.

    Source: sampling_utils.py run_sample_step ("post" strategy): ``post = sd3_time_shift(shift,
    linspace(t_{L+1}, 0, n))`` with t_{L+1} = linspace(1, 0, T + 1)[L + 1] (the unshifted grid value), and
    ``sigma_schedule = cat(sigma_schedule[:L + 1], post)``. Here the tail's first point is taken from `sigmas`
    itself (sigmas[L + 1], equal to the source's recomputed value up to rounding) so that the window's last stored
    transition sigma_L -> sigma_{L+1} stays exactly on the original grid that training uses.

    Args:
        sigmas: [T + 1] float32 original schedule, 1 -> 0, built with a static shift (grpo.sde.shifted_sigmas);
            for diffusers' dynamic shift pass shift = exp(mu) (the same static shift, see tests/unit/test_sde.py).
        last_sde: L, the window's last SDE step (window[-1]); every step after it is a tail step.
        compress_ratio: r (MixGRPO-Flash 0.4, Flash* 0.2).
        shift: the schedule's static shift s (MixGRPO: 3).

    Returns:
        float32 [L + 1 + n], strictly decreasing, ending exactly at 0. Steps 0..L use the original grid; steps
        L + 1 .. L + n - 1 are the tail's DPM-Solver++ steps.
    """
    num_steps = len(sigmas) - 1
    n = tail_points(num_steps, last_sde, compress_ratio)
    u_start = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)[last_sde + 1]
    tail = time_shift(torch.linspace(float(u_start), 0.0, n, dtype=torch.float32), shift)
    tail[0] = sigmas[last_sde + 1]
    tail[-1] = 0.0
    return torch.cat([sigmas[: last_sde + 1].float(), tail])


def dpm_solver_pp_step(x: Tensor, x0: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, *,
                       x0_prev: Tensor | None = None, sigma_prev: float | Tensor | None = None) -> Tensor:
    """One deterministic multistep DPM-Solver++ step in data prediction, from sigma to sigma_next < sigma.

    Source: sampling_utils.py dpm_solver_first_order_update / multistep_dpm_solver_second_order_update
    (dpm_algorithm_type "dpmsolver++", dpm_solver_type "midpoint", sde_solver False), same float32 expressions.
    With alpha = 1 - sigma, lambda = log(alpha) - log(sigma), h = lambda_next - lambda:
        1st order: x' = (sigma'/sigma)·x - alpha'·(e^{-h} - 1)·D0,  D0 = x0 (= Euler / DDIM in exact arithmetic)
        2nd order: r0 = h_prev / h, D1 = (D0 - x0_prev) / r0, h_prev = lambda - lambda_prev;
                   x' = (sigma'/sigma)·x - alpha'·(e^{-h} - 1)·D0 - ½·alpha'·(e^{-h} - 1)·D1
    Order 2 needs the previous step's x̂0 (x0_prev at sigma_prev, from any earlier step, Euler and SDE ones
    included, as the source's DPMState). The step into sigma' = 0 is always first order (the source's
    lower_order_final) and returns x0 exactly. sigma < 1 is required (lambda = -inf at sigma = 1).

    Args:
        x: [B, ...] latent at sigma. x0: [B, ...] x̂0 predicted at (x, sigma).
        sigma, sigma_next: python floats or 0-d tensors, 1 > sigma > sigma_next >= 0.
        x0_prev, sigma_prev: the previous step's x̂0 and sigma (sigma_prev > sigma); None for 1st order.

    Returns:
        [B, ...] float32 latent at sigma_next.
    """
    x, x0 = x.float(), x0.float()
    s, s_next = _as_f32(sigma, x.device), _as_f32(sigma_next, x.device)
    if not bool(s < 1) or not bool(s_next < s) or not bool(s_next >= 0):
        raise ValueError(f"dpm_solver_pp_step needs 1 > sigma > sigma_next >= 0, got {float(s)}, {float(s_next)}")
    lam, lam_next = _lambda(s), _lambda(s_next)
    h = lam_next - lam
    alpha_next = 1 - s_next
    out = (s_next / s) * x - (alpha_next * (torch.exp(-h) - 1.0)) * x0
    if x0_prev is None or float(s_next) == 0.0:
        return out
    if sigma_prev is None:
        raise ValueError("dpm_solver_pp_step: x0_prev needs sigma_prev")
    h_0 = lam - _lambda(_as_f32(sigma_prev, x.device))
    r0 = h_0 / h
    d1 = (1.0 / r0) * (x0 - x0_prev.float())
    return out - 0.5 * (alpha_next * (torch.exp(-h) - 1.0)) * d1


def dpm_solver_pp_sample(x: Tensor, x0_fn: Callable[[Tensor, int], Tensor], sigmas: Tensor, *,
                         x0_prev: Tensor | None = None, sigma_prev: float | Tensor | None = None) -> Tensor:
    """Run the DPM-Solver++(2M) tail: x at sigmas[0] through every sigmas[k] down to sigmas[-1] = 0.

    Source: sampling_utils.py run_sample_step (steps after the window, dpm_step with dpm_solver_order 2). The first
    tail step is already 2nd order when the x̂0 of the step before the tail is given (MixGRPO keeps it in DPMState
    from the window's last SDE step); the last step (into 0) is 1st order, so the result is that step's x̂0.

    Args:
        x: [B, ...] latent at sigmas[0] (x_{L+1} of the rollout).
        x0_fn: (x, k) -> x̂0 predicted at (x, sigmas[k]), e.g. grpo.sde.predicted_x0(x, velocity, sigmas[k]).
        sigmas: [n] float32 tail schedule, sigmas[0] < 1, ending at 0 (flash_sigmas(...)[L + 1:]).
        x0_prev, sigma_prev: x̂0 and sigma of the step before the tail (the window's last step), or None.

    Returns:
        [B, ...] float32 latent at sigma 0 (the clean latent to decode).
    """
    if float(sigmas[-1]) != 0.0:
        raise ValueError(f"dpm_solver_pp_sample: the tail must end at sigma 0, got {float(sigmas[-1])}")
    x = x.float()
    for k in range(len(sigmas) - 1):
        x0 = x0_fn(x, k).float()
        x = dpm_solver_pp_step(x, x0, sigmas[k], sigmas[k + 1], x0_prev=x0_prev, sigma_prev=sigma_prev)
        x0_prev, sigma_prev = x0, sigmas[k]
    return x


def _lambda(sigma: Tensor) -> Tensor:
    """lambda = log(alpha) - log(sigma), alpha = 1 - sigma (the source's _sigma_to_alpha_sigma_t); +inf at 0."""
    return torch.log(1 - sigma) - torch.log(sigma)

