"""GRPO (DanceGRPO, Flow-GRPO and their fast variants): the PPO-clipped ratio of the rollout's SDE transitions,
plus the exact Gaussian KL to the initial policy.

Rollout: SDE steps (eta > 0) recording every latent and log-prob (and each step's mean for GRPO-Guard and
Flow-DPPO). Fixed targets: the reference policy's SDE means at the trained transitions (kl_coef > 0). Loss at
transition j: the log-prob recomputed by the policy on the same micro-batch (so the first pass's ratio is exactly 1),
clipped, or with grpo.trust_region masked by Flow-DPPO's KL to the rollout policy instead (grpo/loss.py). Which
transitions are trained is the rollout plan's (grpo/rollout_plan.py): a seeded share of them, an SDE window, or every
edge of a tree. With grpo.replay (OP-GRPO, grpo/replay.py) it owns a replay buffer: one
extra update block of past trajectories a step, what each step leaves in the buffer, its checkpoint state and cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grpo import health, replay
from grpo.errors import ConfigError
from grpo.gardo import SHARE_MAX, SHARE_MIN, Gardo
from grpo.loss import RatioNorm, TrustRegion, grpo_loss
from grpo.matching import drift_stats, velocity_norm
from grpo.objectives.base import ExtraBlocks, Models, Objective, PlanTerms
from grpo.replay import Replay, ReplaySettings
from grpo.schema import setting
from grpo.sde import kl_same_std, log_prob_gain
from grpo.windows import trainable_range

if TYPE_CHECKING:
    # RecipeConfig (grpo/config.py) is these settings plus the objectives' sections; it sits above the registry
    from grpo.settings import RecipeSettings as RecipeConfig
    from grpo.step import Chunk


@dataclass(kw_only=True)
class TrustRegionSettings:
    kl_threshold: float = setting(help="a transition's KL to the rollout policy (the SDE Gaussians' exact KL, "
                                       "averaged over the latent's elements) at or above which its policy term is "
                                       "masked when the advantage would push it further; UniRL and verl-omni use "
                                       "1e-5, Flow-Factory 1e-6")


@dataclass(kw_only=True)
class GardoSettings:
    aux_rewards: list[str] = setting(help="the auxiliary rewards (names under rewards:, usually weight 0: scored and "
                                          "logged, not trained) whose mean rank against the trained reward's rank "
                                          "gates the KL (GARDO's hps_flux: aesthetic and imagereward)")
    share: float = setting(0.1, help="base share of the samples with a non-negative uncertainty that are gated; "
                                     "adapted each step within [0.02, 0.2] (GARDO's RiskCompensator: 0.1)")
    kl_coef: float = setting(0.01, help="weight of the gated KL, on the source's scale: the exact Gaussian KL of a "
                                        "transition times its dt (GARDO's train.beta, hps_flux: 0.01)")
    kl_threshold: float = setting(3.0e-4, help="a step whose mean gated KL (times dt) exceeds it refreshes the "
                                               "reference before the next update (GARDO's kl_thres: 3e-4, 'set "
                                               "according to specific tasks')")
    refresh_every: int = setting(16, help="steps after which the reference is refreshed anyway (GARDO's "
                                          "`epoch - prev_epoch > 15`: every 16)")


@dataclass(kw_only=True)
class GRPOSettings:
    clip_range: float = setting(help="PPO ratio clip epsilon (DanceGRPO: 1e-4)")
    timestep_fraction: float = setting(help="share of the N-1 trainable transitions drawn per micro-batch, in (0, 1]")
    kl_coef: float = setting(0.0, help="weight of the exact per-step Gaussian KL to the initial policy; 0 = off (no "
                                       "reference model at all). Flow-GRPO's beta weights KL*dt: kl_coef = beta*dt")
    ratio_norm: bool = setting(False, help="GRPO-Guard's RatioNorm and 1/dt gradient reweighting against the ratio "
                                           "bias of low-noise steps (sampling.sde: flow only)")
    timestep_rescale: bool = setting(False, help="Flash-GRPO's temporal gradient rectification: transition j's policy "
                                                 "loss times c_j / mean c over the trainable transitions, c_j = 1 / the "
                                                 "log-prob's gain in v at j, so every timestep pulls alike")
    replay: ReplaySettings | None = setting(None, help="OP-GRPO's trajectory replay (grpo/replay.py): each step's best "
                                                       "positive-advantage trajectories kept in a buffer and trained "
                                                       "again in one extra update block, weighted by their sequence-"
                                                       "level importance ratio, early transitions only; null = off")
    trust_region: TrustRegionSettings | None = setting(None, help="Flow-DPPO's KL trust region in place of the "
                                                                  "ratio clip: -A·ratio unclipped, masked at a "
                                                                  "transition whose KL to the rollout policy reached "
                                                                  "kl_threshold and that the advantage pushes "
                                                                  "further; null = off (the clip)")
    gardo: GardoSettings | None = setting(None, help="GARDO's gated KL (grpo/gardo.py): a KL only on the samples "
                                                     "whose reward the auxiliary rewards rank differently, against "
                                                     "a copy of the policy refreshed when that KL grows or every "
                                                     "refresh_every steps; null = off")


def trained_transitions(num_steps: int, timestep_fraction: float) -> int:
    """K: transitions trained per trajectory, out of the N-1 that can change the decoded image.

    The last transition x_{N-1} -> x_N is never trained: the image is decoded from x0 predicted at x_{N-1}.
    """
    return max(1, math.floor((num_steps - 1) * timestep_fraction))


class GRPO(Objective):
    name = "grpo"
    Settings = GRPOSettings
    help = "algorithm grpo: the clipped ratio of SDE transitions and its KL (DanceGRPO, Flow-GRPO, MixGRPO, ...)"
    trains_transitions = True

    def __init__(self, cfg: RecipeConfig) -> None:
        super().__init__(cfg)
        r = self.settings.replay
        self.replay = Replay(r, cfg) if r is not None else None  # OP-GRPO's, the same on every rank; None: off
        gd = self.settings.gardo  # GARDO's gate and refresh state (grpo/gardo.py); None: off
        self.gardo = Gardo(gd, list(cfg.rewards)) if gd is not None else None

    @classmethod
    def check(cls, cfg: RecipeConfig) -> None:
        g, s = cfg.grpo, cfg.sampling
        if s.eta == 0:
            raise ConfigError("sampling.eta: 0 makes rollouts deterministic and log-probs undefined; GRPO trains "
                              "with eta > 0")
        if not 0 < g.timestep_fraction <= 1:
            raise ConfigError(f"grpo.timestep_fraction: {g.timestep_fraction} must be in (0, 1]")
        if not 0 < g.clip_range < 1:  # the ratio is clipped to [1 - clip_range, 1 + clip_range]: its lower end > 0
            raise ConfigError(f"grpo.clip_range: {g.clip_range} must be in (0, 1); DanceGRPO uses 1e-4")
        if g.kl_coef < 0:
            raise ConfigError(f"grpo.kl_coef: {g.kl_coef} is negative; use 0 (no reference) or a positive weight")
        if s.window is not None and g.timestep_fraction != 1.0:
            raise ConfigError(f"grpo.timestep_fraction: {g.timestep_fraction} with sampling.window: every window step "
                              "is trained; set 1.0")
        if s.branch is not None and g.timestep_fraction != 1.0:
            raise ConfigError(f"grpo.timestep_fraction: {g.timestep_fraction} with sampling.branch: every edge of a "
                              "tree is trained; set 1.0")
        if g.ratio_norm and s.sde != "flow":
            raise ConfigError(f"grpo.ratio_norm: true needs sampling.sde: flow (GRPO-Guard normalises Flow-SDE "
                              f"log-ratios), got {s.sde}")
        if g.timestep_rescale and (g.ratio_norm or s.branch is not None):
            raise ConfigError("grpo.timestep_rescale: true reweights the timesteps as grpo.ratio_norm and a tree's "
                              "edges do in their own way; use one of them")
        if g.trust_region is not None and g.ratio_norm:
            raise ConfigError("grpo.trust_region: Flow-DPPO's KL mask replaces the ratio clip that grpo.ratio_norm "
                              "normalises; use one of them")
        if g.trust_region is not None and not g.trust_region.kl_threshold > 0:
            raise ConfigError(f"grpo.trust_region.kl_threshold: {g.trust_region.kl_threshold} must be > 0 (at 0 "
                              "every step that moves further is masked); the sources use 1e-5 or 1e-6")
        if g.ratio_norm and s.branch is not None:
            raise ConfigError("sampling.branch: needs Gaussian SDE steps without grpo.ratio_norm; set ratio_norm: "
                              "false or branch: null")
        if g.gardo is not None:
            cls._check_gardo(cfg)
        replay.check(cfg, trained_transitions(s.num_steps, g.timestep_fraction))

    @staticmethod
    def _check_gardo(cfg: RecipeConfig) -> None:
        g, gd = cfg.grpo, cfg.grpo.gardo
        if g.kl_coef > 0:
            raise ConfigError(f"grpo.kl_coef: {g.kl_coef} with grpo.gardo: GARDO's gated KL to its refreshed reference "
                              "replaces the KL to the initial model; set grpo.kl_coef: 0")
        if not gd.aux_rewards or any(n not in cfg.rewards for n in gd.aux_rewards):
            raise ConfigError(f"grpo.gardo.aux_rewards: {gd.aux_rewards} must name one or more rewards of rewards: "
                              f"({', '.join(cfg.rewards)}); add them there with weight 0 to score them untrained")
        if not SHARE_MIN <= gd.share <= SHARE_MAX:
            raise ConfigError(f"grpo.gardo.share: {gd.share} must be in [{SHARE_MIN}, {SHARE_MAX}], the range GARDO "
                              "adapts it in; GARDO starts at 0.1")
        if not gd.kl_coef > 0:
            raise ConfigError(f"grpo.gardo.kl_coef: {gd.kl_coef} must be > 0 (GARDO: 0.01); for no KL set "
                              "grpo.gardo: null")
        if not gd.kl_threshold > 0:
            raise ConfigError(f"grpo.gardo.kl_threshold: {gd.kl_threshold} must be > 0 (GARDO: 3e-4)")
        if gd.refresh_every < 1:
            raise ConfigError(f"grpo.gardo.refresh_every: {gd.refresh_every} must be >= 1 step (GARDO: 16)")
        if cfg.sampling.branch is not None or g.replay is not None:
            raise ConfigError("grpo.gardo: not with sampling.branch or grpo.replay (a tree's edges and replayed "
                              "trajectories have no gate); set one of them to null")

    def points(self, num_steps: int) -> int:
        return num_steps - 1

    def trained_per_trajectory(self, num_steps: int) -> int:
        return trained_transitions(num_steps, self.settings.timestep_fraction)

    @property
    def uses_lagging(self) -> bool:
        return self.gardo is not None  # GARDO's reference: a copy of the policy, refreshed (grpo/gardo.py)

    def lagging_decay(self, optimizer_steps: int) -> float:
        # GARDO's reference moves only when it is refreshed (Gardo.scored); the recipe's update after each step is
        # then a no-op (lerp by 0), kept rather than special-cased: a pass over the trained weights' shards
        return 1.0

    def forwards_per_point(self) -> int:
        return super().forwards_per_point() + (self.gardo is not None)  # the reference's no-grad forward

    def rollout_records(self) -> dict[str, bool]:
        # GRPO-Guard's RatioNorm and Flow-DPPO's KL compare the rollout's SDE means with the policy's
        return {"keep_means": self.settings.ratio_norm or self.settings.trust_region is not None}

    def stats_per_point(self) -> tuple[str, ...]:
        return ("dppo/masked_frac",) if self.settings.trust_region is not None else ()

    def health_line(self, step: int, stats: dict[str, float]) -> str:
        return health.health_line(step, stats, self.settings.clip_range)  # warns when the first-pass ratio drifts

    def plan_terms(self) -> PlanTerms:
        r = self.settings.replay
        return PlanTerms(lagging_average=self.gardo is not None, latents_per_point=0,
                         reference_phase=self.kl_coef > 0 or self.gardo is not None,
                         kept_trajectories=r.size if r else 0, kept_transitions=r.truncate if r else 0)

    def extra_forwards_per_image(self, step: int, blocks: int | None = None) -> float:
        if self.replay is None:
            return 0.0
        blocks = self.replay.expected_blocks(step) if blocks is None else blocks
        k = self.trained_per_trajectory(self.cfg.sampling.num_steps)  # replay needs no window nor tree
        return blocks * self.replay.forwards_per_image(k, self.forwards_per_point()) if blocks else 0.0

    # ----------------------------------------------------------------------------------------- replay
    def extra_blocks(self, models: Models, step: int) -> ExtraBlocks:
        """With replay, the replay block once the buffer holds one (grpo.replay.Replay.block); its ratio is to the
        no-grad pass just before it, so its first pass is exactly 1 too. Its stats are "replay/*"."""
        if self.replay is None:
            return ExtraBlocks()
        chunks, stats = self.replay.block(models, step, lambda c: self.fixed_targets(models, c, step),
                                          **self.rollout_records())
        return ExtraBlocks("replay", chunks, stats)

    def remember(self, models: Models, step: int, chunks: list[Chunk], advantages: torch.Tensor) -> None:
        """Collective with replay: the step's best positive-advantage trajectories enter the buffer; with GARDO,
        whether the step's gated KL calls for a refresh."""
        if self.replay is not None:
            self.replay.remember(models, step, chunks, advantages)
        if self.gardo is not None:
            self.gardo.remember()

    def scored(self, models: Models, step: int, components: torch.Tensor, weights: torch.Tensor) -> dict[str, float]:
        """With GARDO: the step's gate, the reference refreshed first if due (grpo/gardo.py)."""
        return self.gardo.scored(models, step, components, weights) if self.gardo is not None else {}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors = self.replay.buffer.state() if self.replay is not None else {}
        return {**tensors, **(self.gardo.state() if self.gardo is not None else {})}, {}

    def load_state_dict(self, saved) -> None:
        if self.replay is not None:  # a checkpoint without "replay/*" tensors (or written before): an empty buffer
            self.replay.buffer.load(saved.rank0())
        if self.gardo is not None:
            self.gardo.load(saved.rank0())

    @torch.no_grad()
    def fixed_targets(self, models: Models, chunks: list[Chunk], step: int) -> None:
        """The reference policy's SDE means of the trained transitions (kl_coef > 0), and its velocity's norms; with
        GARDO its refreshed reference's means (the lagging copy's weights swapped in, as nft's lagging forwards)."""
        if self.gardo is not None:
            with models.lagging.applied(), models.inference() as model:
                for c in chunks:
                    c.reference = {j: models.sampler.transition(model, c.cond, c.traj.latents, j).mean
                                   for j in c.trained}
            return
        if self.kl_coef == 0:
            return
        with models.inference(reference=True) as model:
            for c in chunks:
                c.reference, c.reference_vnorm = {}, {}
                for j in c.trained:  # one transition's velocity alive at a time: only its [B] norms are kept
                    out = models.sampler.transition(model, c.cond, c.traj.latents, j)
                    c.reference[j], c.reference_vnorm[j] = out.mean, velocity_norm(out.velocity)

    def loss(self, models: Models, c: Chunk, j: int, adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The clipped ratio of transition j's log-prob under the policy and at rollout, + the Gaussian KL; and the
        velocity's drift (drift/vnorm, with a reference drift/vnorm_ratio), from the forwards the loss makes."""
        out = models.sampler.transition(models.engine, c.cond, c.traj.latents, j)
        loss, st = self._loss(models, out, c, j, adv)
        return loss, {**st, **drift_stats(out.velocity, c.reference_vnorm[j] if self.kl_coef > 0 else None)}

    def _loss(self, models: Models, out, c: Chunk, j: int, adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        g, sampler = self.settings, models.sampler
        kl = kl_same_std(out.mean, c.reference[j], out.std) if g.kl_coef > 0 else None
        kl_coef, extra = g.kl_coef, {}
        if self.gardo is not None:  # GARDO's gated KL, on its source's scale (times dt), in place of kl_coef's
            dt = float(sampler.sigmas[j] - sampler.sigmas[j + 1])
            kl, extra["gardo/kl"] = self.gardo.kl(out.mean, c.reference[j], out.std, dt, c.ids)
            kl_coef = g.gardo.kl_coef
        tree = sampler.tree
        if tree is None:
            # c.weight: a replayed trajectory's sequence-level importance weight (grpo/replay.py), else 1
            rescale = self._timestep_weights(sampler)[j] if g.timestep_rescale else 1.0
            loss, st = grpo_loss(out.log_prob, c.traj.log_probs[:, j], adv, clip_range=g.clip_range, kl=kl,
                                 kl_coef=kl_coef, ratio_norm=self._ratio_norm(sampler, out, c, j),
                                 trust_region=self._trust_region(out, c, slice(None), j), weight=c.weight * rescale)
            return loss, {**st, **extra}
        # One row per edge into depth j + 1, with that node's advantage; summed over the edges and divided by the
        # samples, so every edge of the tree weighs the same (the source's loss / (GA * edges per tree)).
        edges = tree.heads(len(c.ids), j + 1).to(adv.device)
        loss, st = grpo_loss(out.log_prob, c.traj.log_probs[edges, j], adv[edges, j + 1], clip_range=g.clip_range,
                             kl=kl, kl_coef=g.kl_coef, trust_region=self._trust_region(out, c, edges, j))
        return loss * (len(edges) / len(c.ids)), st

    def _timestep_weights(self, sampler) -> dict[int, float]:
        """Flash-GRPO's rescale of each trainable transition j: c_j / mean c, c_j = 1 / log_prob_gain at j.

        Source: Shredded-Pork/Flash-GRPO@4211013 scripts/train_wanx2_1_flash.py:982-995, loss = -w·c_t·A·ratio
        (clipped alike) with w = 1 / the micro-batch's mean c_t averaged over ranks; c_t is a table for Wan2.1's
        10 drawable timesteps. Its comment names the gain, but its numbers are 1 / gain (they match Wan2.1's
        UniPC flow schedule, shift 3, 20 steps, within 0.3%), so the product c_t times the gain is 1 at every t:
        each timestep's gradient has the same scale. Here c is computed from this run's own schedule and SDE, and
        normalised by its mean over every transition the run can train (a constant), not by the micro-batch's:
        the same expected scale, and a weight that does not depend on which samples share a batch or a rank.
        """
        if not hasattr(self, "_weights"):
            s = self.cfg.sampling
            c = {j: 1.0 / log_prob_gain(float(sampler.sigmas[j]), float(sampler.sigmas[j + 1]), eta=s.eta,
                                        kind=s.sde, sigma_max=float(sampler.sigmas[1]))
                 for j in trainable_range(s, self.points(s.num_steps))}
            mean = sum(c.values()) / len(c)
            self._weights = {j: v / mean for j, v in c.items()}
        return self._weights

    def _ratio_norm(self, sampler, out, c: Chunk, j: int) -> RatioNorm | None:
        """GRPO-Guard (grpo.ratio_norm): the rollout's and the policy's SDE means of transition j, and its scales."""
        if not self.settings.ratio_norm:
            return None
        sqrt_dt = float(sampler.sigmas[j] - sampler.sigmas[j + 1]) ** 0.5
        return RatioNorm(out.mean, c.traj.means[:, j], out.std / sqrt_dt, sqrt_dt)

    def _trust_region(self, out, c: Chunk, rows, j: int) -> TrustRegion | None:
        """Flow-DPPO (grpo.trust_region): transition j's SDE mean now and at rollout, of the trained `rows` (a tree's
        edges into depth j + 1, else every row), and its std, which both policies share."""
        tr = self.settings.trust_region
        if tr is None:
            return None
        return TrustRegion(out.mean, c.traj.means[rows, j], out.std, tr.kl_threshold)
