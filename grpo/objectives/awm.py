"""AWM, advantage-weighted matching (scxue/advantage_weighted_matching@be51372): flow matching on the rollout's
clean samples weighted by the advantage, plus an anchor to the lagging (EMA) policy. Rollouts use the policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grpo.data import POINT_DRAWS
from grpo.errors import ConfigError
from grpo.matching import awm_loss, velocity_mse
from grpo.objectives.base import Models
from grpo.objectives.forward import ForwardProcess, ForwardProcessSettings
from grpo.schema import setting

if TYPE_CHECKING:
    # RecipeConfig (grpo/config.py) is these settings plus the objectives' sections; it sits above the registry
    from grpo.settings import RecipeSettings as RecipeConfig
    from grpo.step import Chunk


@dataclass(kw_only=True)
class AWMSettings(ForwardProcessSettings):
    huber_p: float = setting(help="exponent of the generalised-Huber weighting (AWM: 0.25)")
    anchor_coef: float = setting(help="weight of mean (v - v_lagging)^2 (AWM's beta_EMA: 1.0); 0 = off, no lagging "
                                      "forward (as the source: train_sd3_awm.py:1276)")
    timestep_draw: str = setting(
        choices=POINT_DRAWS,
        help="how the noise levels are drawn per micro-batch: discrete_wo_init = AWM's (one from each of k equal "
             "strata of points 1 .. int(0.9 N) - 1: never sigma 1 nor the last 10%); discrete = the same from point "
             "0 (AWM's PickScore configs); uniform = k of all N points, sigma 1 included (DiffusionNFT's)")


class AWM(ForwardProcess):
    name = "awm"
    Settings = AWMSettings
    help = "algorithm awm: advantage-weighted flow matching with an anchor to the lagging policy"

    @classmethod
    def check(cls, cfg: RecipeConfig) -> None:
        super().check(cfg)
        if not cfg.awm.huber_p > 0:
            raise ConfigError(f"awm.huber_p: {cfg.awm.huber_p}; use a positive number (AWM: 0.25)")
        if not cfg.awm.anchor_coef >= 0:
            raise ConfigError(f"awm.anchor_coef: {cfg.awm.anchor_coef}; use 0 (no anchor) or a positive number "
                              "(AWM's beta_EMA: 1.0)")

    def __init__(self, cfg: RecipeConfig) -> None:
        super().__init__(cfg)
        self.point_draw = self.settings.timestep_draw

    @classmethod
    def point_draw_of(cls, settings) -> str:
        return settings.timestep_draw

    @property
    def needs_lagging_velocity(self) -> bool:
        # as the source (`if config.train.ema_beta > 0`), no anchor means no forward of the lagging policy; its
        # copy is still kept up to date, as the source updates its EMA adapter whatever beta_EMA. NormGuard without a
        # reference compares with the lagging policy's velocity, so it needs that forward too.
        m = self.settings
        return m.anchor_coef > 0 or (m.norm_guard is not None and self.kl_coef == 0)

    def loss(self, models: Models, c: Chunk, j: int, adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """AWM at schedule point j: flow matching weighted by the advantage (scaled to +-1), + the anchor term."""
        eps, m = c.noised[j][1], self.settings
        v = self.velocity(models, models.engine, c, j)
        loss, st = awm_loss(v, c.traj.x0, eps, self.sigma(models, c, j), adv / self.cfg.advantage.clip, m.huber_p)
        if m.anchor_coef > 0:
            anchor = velocity_mse(v, c.lagging[j]).mean()
            loss, st = loss + m.anchor_coef * anchor, {**st, "anchor": anchor.detach()}
        return self.plus_regularizers(loss, st, v, c, j)
