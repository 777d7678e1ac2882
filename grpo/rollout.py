"""Batched SDE (or ODE) rollouts that record what the GRPO update needs, and the update's log-prob recomputation.

Why the first-pass ratio is exactly 1 at any batch size: the update recomputes the log-prob of a transition with
the same micro-batch (same samples, same order, same shapes), the same stored float32 latents, the same timestep
tensor and the same conditioning that produced it in the rollout (grpo/data.py draws the trained timesteps per
micro-batch for this reason). The transformer therefore runs the very same kernels on the very same inputs, and the
SDE mean and log-prob are computed by the same float32 code. Nothing is left to differ, in fp32 or bf16; DanceGRPO
gets this only at batch 1 because its rollout batch (1) differs from its training batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.flux import Conditioning, velocity
from grpo.sde import StepOut, predicted_x0, sde_step


@dataclass
class SDEParams:
    eta: float
    kind: str  # dance | flow

    def step(self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, *,
             noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None) -> StepOut:
        return sde_step(x, v, float(sigmas[i]), float(sigmas[i + 1]), eta=self.eta, kind=self.kind, noise=noise,
                        prev_sample=prev_sample, sigma_max=float(sigmas[1]))


@dataclass
class Trajectories:
    latents: torch.Tensor  # [B, T+1, S, C] float32: x_0 (noise) .. x_T
    log_probs: torch.Tensor | None  # [B, T] float32; None for ODE rollouts
    x0: torch.Tensor  # [B, S, C] float32: clean latent predicted at x_{T-1}, the one that is decoded

    def select(self, rows: slice) -> "Trajectories":
        lp = None if self.log_probs is None else self.log_probs[rows]
        return Trajectories(self.latents[rows], lp, self.x0[rows])


def timestep(sigmas: torch.Tensor, i: int, batch: int) -> torch.Tensor:
    """The transformer's timestep input for step i, built like FluxPipeline builds it (t*1000, then /1000)."""
    return (sigmas[i] * 1000).expand(batch) / 1000


@torch.no_grad()
def sample(model: torch.nn.Module, cond: Conditioning, init_latents: torch.Tensor, sigmas: torch.Tensor,
           sde: SDEParams, noise_generators: list[torch.Generator] | None = None) -> Trajectories:
    """Roll out one micro-batch from `init_latents` [B, S, C] along `sigmas` [T+1].

    With eta > 0 each step's noise is drawn on the CPU from that trajectory's own generator, so a trajectory does
    not depend on which other trajectories share its micro-batch, nor on the device type.
    """
    b, steps = init_latents.shape[0], len(sigmas) - 1
    device = init_latents.device
    x = init_latents.float()
    latents, log_probs = [x], []
    for i in range(steps):
        v = velocity(model, x, timestep(sigmas, i, b).to(device), cond)
        if i == steps - 1:
            x0 = predicted_x0(x, v, float(sigmas[i]))
        noise = None
        if sde.eta > 0:
            noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in noise_generators]).to(device)
        out = sde.step(x, v, sigmas, i, noise=noise)
        x = out.prev_sample
        latents.append(x)
        if out.log_prob is not None:
            log_probs.append(out.log_prob)
    return Trajectories(
        latents=torch.stack(latents, dim=1),
        log_probs=torch.stack(log_probs, dim=1) if log_probs else None,
        x0=x0,
    )


def transition(model: torch.nn.Module, cond: Conditioning, traj_latents: torch.Tensor, sigmas: torch.Tensor,
               i: int, sde: SDEParams) -> StepOut:
    """Log-prob (and SDE mean) of the stored transition x_i -> x_{i+1} under `model`; differentiable."""
    x, x_next = traj_latents[:, i], traj_latents[:, i + 1]
    v = velocity(model, x, timestep(sigmas, i, x.shape[0]).to(x.device), cond)
    return sde.step(x, v, sigmas, i, prev_sample=x_next)
