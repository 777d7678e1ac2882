"""What DiffusionNFT and AWM share: they train on the forward process. The rollout's clean samples x0 are noised at
points of its schedule, x_t = (1 - t)·x0 + t·eps, and the policy's velocity there is compared with fixed targets
(the lagging policy's velocity, the reference's for the KL term). No log-probs: rollouts may be ODE (eta 0)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from grpo.data import drawable_points, matching_noise
from grpo.errors import ConfigError
from grpo.matching import decay, drift_stats, forward_noise, norm_guard, velocity_mse, velocity_norm
from grpo.objectives.base import Models, Objective, PlanTerms
from grpo.schema import setting

if TYPE_CHECKING:
    # RecipeConfig (grpo/config.py) is these settings plus the objectives' sections; it sits above the registry
    from grpo.settings import RecipeSettings as RecipeConfig
    from grpo.step import Chunk


@dataclass(kw_only=True)
class NormGuardSettings:
    weight: float = setting(help="weight of the mean hinge max(0, ||v|| / ||v_ref|| - 1 - margin) added to the loss "
                                 "(arXiv 2606.27771's NormGuard, docs/strategies.md)")
    margin: float = setting(0.0, help="share by which ||v|| may exceed ||v_ref|| before the hinge acts (0: at once)")


@dataclass(kw_only=True)
class ForwardProcessSettings:
    timesteps: int = setting(help="noise levels trained per image, drawn from the rollout's schedule (DiffusionNFT: "
                                  "0.99 of its 10; Flow-Factory's FLUX examples: 2 to 4)")
    lag_rate: float = setting(help="the lagging policy: theta_lag <- d*theta_lag + (1 - d)*theta after each step, "
                                   "d = min(lag_rate * (k - lag_start), lag_max), k = optimizer steps (DiffusionNFT "
                                   "type 1: 0.001, 0.5, 0; AWM: 0.001, 0.3, 0)")
    lag_max: float = setting(help="largest decay of the lagging policy (see lag_rate)")
    lag_start: int = setting(0, help="optimizer steps before the lagging policy starts to lag (DiffusionNFT type 2: "
                                     "75)")
    kl_coef: float = setting(0.0, help="weight of mean (v - v_ref)^2 to the initial model (DiffusionNFT: 1e-4); 0 = "
                                       "off, no reference model")
    group_noise: bool = setting(False, help="true: a group's images share their forward-process noise at a point "
                                            "(common random numbers: the same expected update, less noise in it); "
                                            "false: one noise per image (DiffusionNFT, AWM)")
    norm_guard: NormGuardSettings | None = setting(None, help="NormGuard: a hinge on the policy's velocity norm "
                                                             "above the reference's (kl_coef > 0), else the lagging "
                                                             "policy's, per image and noise level, e.g. {weight: "
                                                             "0.1, margin: 0.0}; null = off")


class ForwardProcess(Objective):
    """The common part of nft and awm; subclasses give `loss` and say whether they need the lagging velocity."""

    trains_transitions = False
    uses_lagging = True
    needs_lagging_velocity: ClassVar[bool] = True

    @classmethod
    def check(cls, cfg: RecipeConfig) -> None:
        m, s, key = getattr(cfg, cls.name), cfg.sampling, cls.name
        if s.eta == 0 and s.init_same_noise:
            raise ConfigError("sampling.init_same_noise: true with eta 0 makes each group one image repeated (no "
                              "advantage); set false, so each image has its own starting noise")
        points = drawable_points(s.num_steps, cls.point_draw_of(m))
        if not 1 <= m.timesteps <= len(points):
            raise ConfigError(f"{key}.timesteps: {m.timesteps}; use 1 .. {len(points)}, the schedule points "
                              f"{points.start}..{points.stop - 1} of {s.num_steps} it draws from")
        if not 0 <= m.lag_max < 1 or m.lag_rate < 0 or m.lag_start < 0:
            raise ConfigError(f"{key}.lag_*: rate {m.lag_rate} >= 0, max {m.lag_max} in [0, 1), start {m.lag_start} "
                              ">= 0 (DiffusionNFT: 0.001, 0.5, 0)")
        if m.kl_coef < 0:
            raise ConfigError(f"{key}.kl_coef: {m.kl_coef} is negative; use 0 (no reference) or e.g. 1e-4")
        g = m.norm_guard
        if g is not None and not (g.weight > 0 and g.margin >= 0):
            raise ConfigError(f"{key}.norm_guard: weight {g.weight} must be > 0 and margin {g.margin} >= 0 (a "
                              "negative margin would act on the first, unmoved pass); null turns it off")

    @classmethod
    def point_draw_of(cls, settings) -> str:
        return "uniform"

    def points(self, num_steps: int) -> int:
        return num_steps

    def trained_per_trajectory(self, num_steps: int) -> int:
        return self.settings.timesteps

    def forwards_per_point(self) -> int:
        return super().forwards_per_point() + self.needs_lagging_velocity

    def lagging_decay(self, optimizer_steps: int) -> float:
        m = self.settings
        return decay(optimizer_steps, m.lag_rate, m.lag_max, m.lag_start)

    def plan_terms(self) -> PlanTerms:
        # per noise level: x_t, eps, the lagging velocity, and the reference's (KL); no-grad forwards for the last two
        targets = self.needs_lagging_velocity + (self.kl_coef > 0)
        return PlanTerms(lagging_average=True, latents_per_point=2 + targets, reference_phase=targets > 0)

    @torch.no_grad()
    def fixed_targets(self, models: Models, chunks: list[Chunk], step: int) -> None:
        """The clean samples noised at the trained points; the lagging policy's and the reference's velocities."""
        self._noise_clean_samples(models, chunks, step)
        if self.needs_lagging_velocity:
            with models.lagging.applied(), models.inference() as model:
                for c in chunks:
                    c.lagging = {j: self.velocity(models, model, c, j) for j in c.trained}
        if self.kl_coef > 0:
            with models.inference(reference=True) as model:
                for c in chunks:
                    c.reference = {j: self.velocity(models, model, c, j) for j in c.trained}

    def _noise_clean_samples(self, models: Models, chunks: list[Chunk], step: int) -> None:
        """x_t = (1 - t)·x0 + t·eps at each trained schedule point t = sigma_j, eps keyed on the sample, or with
        group_noise on its group: the group's advantages sum to zero, so with one eps (and one t: a micro-batch
        draws its points once) the part of each image's gradient that comes from the noise, not from its x0,
        cancels across the group instead of adding variance; each image's eps is still N(0, I), so the expected
        update is unchanged."""
        cfg, sigmas = self.cfg, models.sampler.sigmas
        points = cfg.sampling.num_steps
        per = cfg.sampling.group_size if self.settings.group_noise else 1
        for c in chunks:
            for j in c.trained:
                eps = torch.stack([matching_noise(c.traj.x0.shape[1:], cfg.seed, step, i // per, j, points)
                                   for i in c.ids]).to(c.traj.x0.device)
                t = sigmas[j].expand(len(c.ids)).to(c.traj.x0.device)
                c.noised[j] = (forward_noise(c.traj.x0, eps, t), eps)

    @staticmethod
    def velocity(models: Models, model: torch.nn.Module, c: Chunk, j: int) -> torch.Tensor:
        """`model`'s velocity at chunk c's sample noised at schedule point j."""
        return models.sampler.velocity_at(model, c.noised[j][0], j, c.cond)

    def sigma(self, models: Models, c: Chunk, j: int) -> torch.Tensor:
        """[B] the schedule's sigma_j, the forward process's t at point j."""
        x_t = c.noised[j][0]
        return models.sampler.sigmas[j].expand(len(c.ids)).to(x_t.device)

    def plus_regularizers(self, loss: torch.Tensor, st: dict, v: torch.Tensor, c: Chunk,
                          j: int) -> tuple[torch.Tensor, dict]:
        """`loss` + kl_coef · mean (v - v_ref)^2 + NormGuard's weight · mean hinge at point j, and the drift stats
        (c.reference, c.lagging were filled by fixed_targets)."""
        if self.kl_coef > 0:
            kl = velocity_mse(v, c.reference[j]).mean()
            loss, st = loss + self.kl_coef * kl, {**st, "kl": kl.detach()}
        target = self.norm_target(c, j)
        st = {**st, **drift_stats(v, None if target is None else velocity_norm(target))}
        g = self.settings.norm_guard
        if g is not None:
            hinge = norm_guard(v, target, g.margin).mean()
            loss, st = loss + g.weight * hinge, {**st, "norm_guard": hinge.detach()}
        return loss, st

    def norm_target(self, c: Chunk, j: int) -> torch.Tensor | None:
        """The velocity the norm is compared with at point j, one already computed (no forward of its own): the
        reference's where it is loaded (kl_coef > 0; what NormGuard compares with), else the lagging policy's (nft's
        old policy, awm's anchor; it lags the policy, so it bounds the inflation per stretch of steps, not in all);
        None where neither was computed (awm without anchor, KL or guard)."""
        if self.kl_coef > 0:
            return c.reference[j]
        return c.lagging.get(j)
