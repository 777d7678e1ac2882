"""The sampler: batched SDE (or ODE) rollouts that record what the GRPO update needs, and the update's log-prob
recomputation. The recipe's rollouts and the held-out eval both sample through :class:`FluxSampler`.

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

from grpo.config import SamplingConfig
from grpo.data import INIT_NOISE, initial_noise
from grpo.flux import Conditioning, FluxParts, decode, make_conditioning, pack, velocity
from grpo.prompts import PromptCache
from grpo.sde import StepOut, dynamic_sigmas, predicted_x0, sde_step, shifted_sigmas


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


def schedule(s: SamplingConfig, latent_size: int, scheduler_config: dict) -> torch.Tensor:
    """The sigma schedule [num_steps + 1] of a preset: a static time shift, or diffusers' dynamic one (the only one
    with which sampling reproduces FluxPipeline, whose default is the dynamic shift)."""
    if s.shift == "dynamic":
        return dynamic_sigmas(s.num_steps, (latent_size // 2) ** 2, scheduler_config)
    return shifted_sigmas(s.num_steps, float(s.shift))


@dataclass
class FluxSampler:
    """Everything that turns prompt embeddings and seeds into trajectories and images, except the transformer."""

    vae: torch.nn.Module
    vae_scale_factor: int
    latent_size: int
    latent_channels: int
    guidance_embeds: bool
    sigmas: torch.Tensor  # [num_steps + 1]
    sde: SDEParams
    resolution: int
    guidance: float
    seed: int
    device: torch.device
    dtype: torch.dtype  # the transformer's

    @classmethod
    def from_parts(cls, parts: FluxParts, vae: torch.nn.Module, s: SamplingConfig, seed: int, device: torch.device,
                   dtype: torch.dtype) -> "FluxSampler":
        """`vae`: parts.vae where it should live (on the device, or on the host when offloaded)."""
        config = parts.transformer.config
        latent_size = parts.latent_size(s.resolution)
        return cls(vae, parts.vae_scale_factor, latent_size, config.in_channels // 4, config.guidance_embeds,
                   schedule(s, latent_size, parts.scheduler_config), SDEParams(s.eta, s.sde), s.resolution,
                   s.guidance, seed, device, dtype)

    def conditioning(self, cache: PromptCache, prompt_idx: list[int]) -> Conditioning:
        return make_conditioning(cache.prompt_embeds[prompt_idx], cache.pooled[prompt_idx], self.latent_size,
                                 self.guidance, self.guidance_embeds, self.device, self.dtype)

    def initial_latents(self, step: int, keys: list[int], stream: int = INIT_NOISE) -> torch.Tensor:
        """Packed float32 starting noise [B, S, C], one pure function of (seed, step, key, stream) per row."""
        shape = (self.latent_channels, self.latent_size, self.latent_size)
        noise = torch.stack([initial_noise(shape, self.seed, step, k, stream) for k in keys])
        return pack(noise).to(self.device)

    def sample(self, model: torch.nn.Module, cond: Conditioning, init_latents: torch.Tensor,
               noise_generators: list[torch.Generator] | None = None, eta: float | None = None) -> Trajectories:
        """:func:`sample` along this sampler's schedule; `eta` overrides the preset's (0 = ODE, as in eval)."""
        sde = self.sde if eta is None else SDEParams(eta, self.sde.kind)
        return sample(model, cond, init_latents, self.sigmas, sde, noise_generators)

    def transition(self, model: torch.nn.Module, cond: Conditioning, latents: torch.Tensor, i: int) -> StepOut:
        """:func:`transition` i of stored trajectory `latents` along this sampler's schedule."""
        return transition(model, cond, latents, self.sigmas, i, self.sde)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        return decode(self.vae, x0, self.resolution, self.vae_scale_factor)
