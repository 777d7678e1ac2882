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

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from grpo.data import INIT_NOISE, initial_noise
from grpo.models import Conditioning, ModelFamily, Parts
from grpo.prompts import PromptCache
from grpo.sde import StepOut, predicted_x0, sde_mean_std, sde_sample, sde_step, shifted_sigmas
from grpo.settings import SamplingConfig
from grpo.solvers import dpm_solver_pp_sample, flash_sigmas
from grpo.step import Trajectories  # defined with the other step data, which the objectives build too
from grpo.tree import Tree


# x [B, S, C], timestep [B], conditioning -> float32 velocity [B, S, C]: a transformer called the way its family's
# pipeline calls it (ModelFamily.velocity bound to one model: the policy, the reference or the lagging policy).
Velocity = Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]


@dataclass
class SDEParams:
    eta: float
    kind: str  # dance | flow | cps

    def step(self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, *,
             noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None) -> StepOut:
        return sde_step(x, v, float(sigmas[i]), float(sigmas[i + 1]), eta=self.eta, kind=self.kind, noise=noise,
                        prev_sample=prev_sample, sigma_max=float(sigmas[1]))


def guided(velocity: Velocity, scale: float) -> Velocity:
    """True classifier-free guidance (sampling.true_cfg, its scale w): neg + w * (cond - neg), combined in float32,
    from two calls of the transformer on the same rows, as Flux2KleinPipeline makes them. Not one batched call on
    [x; x] (diffusers' other pipelines concatenate): on the tiny FLUX.2 in fp32 the batch of 2B rows changed the
    kernels' rounding enough to part from the pipeline's images by 9.1e-6 at w = 4, at the edge of the 1e-5 parity,
    against 0.0 with two calls; whether one batched call is faster on an accelerator is still to be measured. The
    rollout, the update's recomputation, the reference and the evals all call this, so grpo's log-probs are those of
    the guided transition and the first-pass ratio stays exactly 1."""

    def v(x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        pos = velocity(x, t, dataclasses.replace(cond, negative=None))
        neg = velocity(x, t, cond.negative)
        return neg + scale * (pos - neg)

    return v


def timestep(sigmas: torch.Tensor, i: int, batch: int) -> torch.Tensor:
    """The transformer's timestep input for step i, built like FluxPipeline builds it (t*1000, then /1000): sigma_i.

    As Flow-GRPO (flow_grpo@9745241 flow_grpo/diffusers_patch/flux_pipeline_with_logprob.py:150-153: t/1000, t the
    scheduler's float sigma*1000). DanceGRPO, MixGRPO and BranchGRPO feed int(sigma*1000)/1000 instead, sigma
    truncated to 1e-3 (up to 1e-3 lower; their SDE step still uses the exact sigma): DanceGRPO@15cc71d
    fastvideo/train_grpo_flux.py:230-238, 279, 506-508; MixGRPO@e5cdd6a fastvideo/utils/sampling_utils.py:63-71,
    fastvideo/train_grpo_flux.py:132, 387-390; BranchGRPO@19fbb9f fastvideo/train_branchgrpo_flux.py:427-443, 733.
    """
    return (sigmas[i] * 1000).expand(batch) / 1000


@torch.no_grad()
def sample(velocity: Velocity, cond: Conditioning, init_latents: torch.Tensor, sigmas: torch.Tensor,
           sde: SDEParams, noise_generators: list[torch.Generator] | None = None, window: range | None = None,
           tail: torch.Tensor | None = None, keep_means: bool = False, tree: Tree | None = None) -> Trajectories:
    """Roll out one micro-batch from `init_latents` [B, S, C] along `sigmas` [T+1].

    With eta > 0 each step's noise is drawn on the CPU from that trajectory's own generator, so a trajectory does
    not depend on which other trajectories share its micro-batch, nor on the device type.

    window: the steps sampled with the SDE, their log-probs recorded (None = every step). The other steps are
        deterministic Euler steps; their noise is still drawn (and dropped, as MixGRPO does), so where the window
        lies does not change any trajectory's noise (grpo/windows.py).
    tail: MixGRPO-Flash's schedule after the window (grpo.solvers.flash_sigmas(...)[L + 1:]): the steps after
        window[-1] are replaced by DPM-Solver++(2M) steps on it, and x0 is its end at sigma 0.
    keep_means: also record each step's SDE mean (GRPO-Guard's RatioNorm and Flow-DPPO's KL need the rollout's); in a
        tree each row's is the mean of its own edge's Gaussian.
    tree: BranchGRPO's tree rollout (grpo/tree.py): the batch is whole trees whose rows share their initial
        latents; the model runs once per node and step, only a node's first row draws noise, every row records the
        log-prob of its own edge.
    """
    b, steps = init_latents.shape[0], len(sigmas) - 1
    device = init_latents.device
    # Contiguous, like the stacked latents the update reads back: a permuted layout (Flux2's packing is a permute)
    # would change the order of the log-prob's reduction and break the first-pass ratio's exact 1.
    x = init_latents.float().contiguous()
    latents, log_probs, means = [x], [], []
    ode = SDEParams(0.0, sde.kind)
    grid_steps = steps if tail is None else window[-1] + 1
    if tree is not None:
        for i in range(steps):
            heads = tree.heads(b, i).to(device)
            nodes = x[heads]
            v = velocity(nodes, timestep(sigmas, i, len(heads)).to(device), cond.select(heads))
            if i == steps - 1:
                x0 = predicted_x0(nodes, v, float(sigmas[i]))[tree.owner(b, i).to(device)]
            children = tree.heads(b, i + 1)
            noise = torch.stack([torch.randn(x.shape[1:], generator=noise_generators[k]) for k in children.tolist()])
            out = tree_step(nodes, v, sigmas, i, sde, tree, b, noise=noise.to(device))
            x = out.prev_sample
            latents.append(x)
            log_probs.append(out.log_prob)
            if keep_means:
                means.append(out.mean)
        return Trajectories(torch.stack(latents, dim=1), torch.stack(log_probs, dim=1), x0,
                            torch.stack(means, dim=1) if keep_means else None, nfe=steps)
    for i in range(grid_steps):
        v = velocity(x, timestep(sigmas, i, b).to(device), cond)
        if i == steps - 1 or (tail is not None and i == grid_steps - 1):
            x0 = predicted_x0(x, v, float(sigmas[i]))
        noise = None
        if sde.eta > 0:
            noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in noise_generators]).to(device)
        stochastic = window is None or i in window
        out = sde.step(x, v, sigmas, i, noise=noise) if stochastic else ode.step(x, v, sigmas, i)
        x = out.prev_sample
        latents.append(x)
        if sde.eta > 0:
            log_probs.append(out.log_prob if stochastic else torch.zeros(b, device=device))
        if keep_means:
            means.append(out.mean)
    if tail is not None:
        def x0_of(xt: torch.Tensor, k: int) -> torch.Tensor:
            return predicted_x0(xt, velocity(xt, timestep(tail, k, b).to(device), cond), float(tail[k]))

        x0 = dpm_solver_pp_sample(x, x0_of, tail, x0_prev=x0, sigma_prev=float(sigmas[grid_steps - 1]))
    return Trajectories(
        latents=torch.stack(latents, dim=1),
        log_probs=torch.stack(log_probs, dim=1) if log_probs else None,
        x0=x0,
        means=torch.stack(means, dim=1) if keep_means else None,
        nfe=grid_steps + (0 if tail is None else len(tail) - 1),
    )


def tree_step(x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, sde: SDEParams, tree: Tree,
              batch: int, *, noise: torch.Tensor | None = None,
              prev_sample: torch.Tensor | None = None) -> StepOut:
    """Step i of `batch` rows of whole trees from its nodes' states `x` and velocities `v` (one row per node).

    Each child node (a row of tree.heads(batch, i + 1)) is its parent's mean + noise_scale·std·noise at a split
    step; the log-prob uses that same std (the sampling policy; the source samples with noise_scale·std but scores
    with std, a behaviour/target mismatch it leaves). Sampling (`noise`, one row per child) returns every row's
    next latent and log-prob; scoring (`prev_sample`, the children's stored latents) returns one row per child.
    """
    mean, std = sde_mean_std(x, v, float(sigmas[i]), float(sigmas[i + 1]), eta=sde.eta, kind=sde.kind,
                             sigma_max=float(sigmas[1]))
    parent = (tree.heads(batch, i + 1) // tree.span(i)).to(x.device)
    out = sde_sample(mean[parent], std * tree.std_scale(i), sde.kind, noise=noise, prev_sample=prev_sample)
    if prev_sample is not None:
        return out
    owner = tree.owner(batch, i + 1).to(x.device)
    return StepOut(out.prev_sample[owner], out.mean[owner], out.std, out.log_prob[owner])


def transition(velocity: Velocity, cond: Conditioning, traj_latents: torch.Tensor, sigmas: torch.Tensor,
               i: int, sde: SDEParams, tree: Tree | None = None) -> StepOut:
    """Log-prob (and SDE mean) of the stored transition x_i -> x_{i+1} under `velocity`'s model; differentiable.

    With a tree, one row per edge into depth i + 1 (the rows tree.heads(B, i + 1)), computed from one model call per
    node at depth i, as the rollout computed it."""
    if tree is not None:
        b = traj_latents.shape[0]
        heads = tree.heads(b, i).to(traj_latents.device)
        x = traj_latents[heads, i]
        v = velocity(x, timestep(sigmas, i, len(heads)).to(x.device), cond.select(heads))
        children = tree.heads(b, i + 1).to(x.device)
        out = tree_step(x, v, sigmas, i, sde, tree, b, prev_sample=traj_latents[children, i + 1])
    else:
        x, x_next = traj_latents[:, i], traj_latents[:, i + 1]
        v = velocity(x, timestep(sigmas, i, x.shape[0]).to(x.device), cond)
        out = sde.step(x, v, sigmas, i, prev_sample=x_next)
    out.velocity = v  # its norm is logged (drift/vnorm): no forward of its own
    return out


def schedule(s: SamplingConfig, family: ModelFamily, latent_size: int, scheduler_config: dict) -> torch.Tensor:
    """The sigma schedule [num_steps + 1] of a preset: a static time shift, or the family's dynamic one (the only one
    with which sampling reproduces the family's pipeline, whose default is the dynamic shift)."""
    if s.shift == "dynamic":
        return family.dynamic_sigmas(s.num_steps, (latent_size // 2) ** 2, scheduler_config)
    return shifted_sigmas(s.num_steps, float(s.shift))


@dataclass
class FluxSampler:
    """Everything that turns prompt embeddings and seeds into trajectories and images, except the transformer."""

    family: ModelFamily
    vae: torch.nn.Module
    vae_scale_factor: int
    latent_size: int
    latent_channels: int
    guidance_embeds: bool
    sigmas: torch.Tensor  # [num_steps + 1]
    sde: SDEParams
    sampling: SamplingConfig  # the preset's: resolution, guidance, SDE window and the solver after it
    seed: int
    device: torch.device
    dtype: torch.dtype  # the transformer's
    scheduler_config: dict | None = None  # the family's scheduler's, for a dynamic shift on another number of steps

    @property
    def tree(self) -> Tree | None:
        """BranchGRPO's tree of the training rollouts (sampling.branch), or None."""
        return Tree.of(self.sampling)

    @classmethod
    def from_parts(cls, parts: Parts, vae: torch.nn.Module, s: SamplingConfig, seed: int, device: torch.device,
                   dtype: torch.dtype) -> "FluxSampler":
        """`vae`: parts.vae where it should live (on the device, or on the host when offloaded)."""
        family, config = parts.family, parts.transformer.config
        latent_size = parts.latent_size(s.resolution)
        return cls(family, vae, parts.vae_scale_factor, latent_size, family.latent_channels(config),
                   bool(config.get("guidance_embeds", False)), schedule(s, family, latent_size, parts.scheduler_config),
                   SDEParams(s.eta, s.sde), s, seed, device, dtype, parts.scheduler_config)

    def with_steps(self, steps: int) -> "FluxSampler":
        """This sampler on a schedule of `steps` steps with the same shift, its own steps only (no window, tail or
        tree): candidate selection's preview, sampled with eta 0."""
        s = dataclasses.replace(self.sampling, num_steps=steps, window=None, tail="euler", compress_ratio=None,
                                branch=None, candidates=None)
        return dataclasses.replace(self, sampling=s, sigmas=schedule(s, self.family, self.latent_size,
                                                                     self.scheduler_config or {}))

    def for_eval(self) -> "FluxSampler":
        """The held-out evals' sampler: this one, or on sampling.eval_num_steps steps (Flow-GRPO's denoising
        reduction: rollouts on fewer steps than the evals that judge them), at sampling.eval_cfg_scale."""
        steps = self.sampling.eval_num_steps
        sampler = self if steps is None or steps == self.sampling.num_steps else self.with_steps(steps)
        if self.sampling.eval_cfg_scale is None:
            return sampler
        # the inference setting a user samples with (sampling.eval_cfg_scale), whatever guidance the rollouts use
        return dataclasses.replace(sampler, sampling=dataclasses.replace(sampler.sampling,
                                                                         true_cfg=self.sampling.eval_true_cfg))

    def conditioning(self, cache: PromptCache, prompt_idx: list[int]) -> Conditioning:
        rows = cache.rows(prompt_idx)
        cond = self.family.conditioning(rows, self.latent_size, self.sampling.guidance, self.guidance_embeds,
                                        self.device, self.dtype)
        if self.sampling.true_cfg is None:
            return cond
        if cache.negative is None:
            raise RuntimeError("sampling.true_cfg without the negative prompt's embeddings: load the prompt cache "
                               "with them (grpo.prompts.load_cache(..., negative=ensure_negative(...)))")
        # Every row's negative is the one negative prompt, with the row's own reference images (the pipelines pass
        # the image to both branches).
        neg = {k: v.expand(len(prompt_idx), *v.shape[1:]) for k, v in cache.negative.items()}
        neg.update({k: v for k, v in rows.items() if k == "ref_latents"})
        return dataclasses.replace(cond, negative=self.family.conditioning(
            neg, self.latent_size, self.sampling.guidance, self.guidance_embeds, self.device, self.dtype))

    def velocity(self, model: torch.nn.Module) -> Velocity:
        """`model` called as the family's pipeline calls its transformer; with sampling.true_cfg, the guided
        velocity (:func:`guided`). Without it the conditional call alone, not one operation more."""
        v = self.family.velocity_of(model)
        return v if self.sampling.true_cfg is None else guided(v, self.sampling.true_cfg.scale)

    def initial_latents(self, step: int, keys: list[int], stream: int = INIT_NOISE) -> torch.Tensor:
        """Packed float32 starting noise [B, S, C], one pure function of (seed, step, key, stream) per row."""
        shape = self.family.noise_shape(self.latent_channels, self.latent_size)
        noise = torch.stack([initial_noise(shape, self.seed, step, k, stream) for k in keys])
        return self.family.pack(noise).to(self.device)

    def sample(self, model: torch.nn.Module, cond: Conditioning, init_latents: torch.Tensor,
               noise_generators: list[torch.Generator] | None = None, window: range | None = None,
               eta: float | None = None, keep_means: bool = False) -> Trajectories:
        """:func:`sample` along this sampler's schedule, with the preset's solver after `window` (nft/awm: after the
        first step) or its tree; `eta` overrides the preset's (0 = ODE, as in eval: the schedule's own steps, never a
        tail or a tree)."""
        if eta is None and self.tree is not None:
            return sample(self.velocity(model), cond, init_latents, self.sigmas, self.sde, noise_generators,
                          keep_means=keep_means, tree=self.tree)
        sde = self.sde if eta is None else SDEParams(eta, self.sde.kind)
        if window is None and eta is None and self.sampling.tail == "dpm2":
            # nft/awm's ODE rollouts (eta 0): one Euler step from sigma 1, where DPM-Solver++'s lambda is -inf, then
            # the 2nd-order tail; DiffusionNFT samples with DPM-Solver++(2M), first and last steps first order.
            window = range(1)
        tail = None
        if window is not None and self.sampling.tail == "dpm2":
            last = window[-1]
            tail = flash_sigmas(self.sigmas, last, self.sampling.compress_ratio, float(self.sampling.shift))[last + 1:]
        return sample(self.velocity(model), cond, init_latents, self.sigmas, sde, noise_generators, window, tail,
                      keep_means)

    def velocity_at(self, model: torch.nn.Module, x: torch.Tensor, i: int, cond: Conditioning) -> torch.Tensor:
        """`model`'s velocity at latents `x` [B, S, C] at schedule point i (nft/awm's noised clean samples): the
        velocity the update trains, guided, or with sampling.true_cfg.train conditional the conditional branch alone
        (the rollouts still guide)."""
        cfg = self.sampling.true_cfg
        v = self.velocity(model) if cfg is None or cfg.trains_guided else self.family.velocity_of(model)
        return v(x, timestep(self.sigmas, i, len(x)).to(x.device), cond)

    def transition(self, model: torch.nn.Module, cond: Conditioning, latents: torch.Tensor, i: int) -> StepOut:
        """:func:`transition` i of stored trajectory `latents` along this sampler's schedule."""
        return transition(self.velocity(model), cond, latents, self.sigmas, i, self.sde, self.tree)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        return self.family.decode(self.vae, x0, self.sampling.resolution, self.vae_scale_factor)
