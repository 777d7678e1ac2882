"""DiffusionNFT (NVlabs/DiffusionNFT@24af555, arXiv 2509.16117): the implicit positive and negative policies around
the lagging (old) policy, on the forward process. Rollouts sample with the lagging policy (Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager

import torch

from grpo.errors import ConfigError
from grpo.matching import nft_loss, optimality_weight
from grpo.objectives.base import Models
from grpo.objectives.forward import ForwardProcess, ForwardProcessSettings
from grpo.schema import setting

if TYPE_CHECKING:
    # RecipeConfig (grpo/config.py) is these settings plus the objectives' sections; it sits above the registry
    from grpo.settings import RecipeSettings as RecipeConfig
    from grpo.step import Chunk


@dataclass(kw_only=True)
class NFTSettings(ForwardProcessSettings):
    beta: float = setting(help="mixing strength of the implicit policies (DiffusionNFT: 1.0; 0.1 for OCR); not a KL "
                               "weight")


class NFT(ForwardProcess):
    name = "nft"
    Settings = NFTSettings
    help = "algorithm nft: DiffusionNFT's implicit positive/negative policies on the forward process"

    @classmethod
    def check(cls, cfg: RecipeConfig) -> None:
        super().check(cfg)
        if not cfg.nft.beta > 0:
            raise ConfigError(f"nft.beta: {cfg.nft.beta}; use a positive number (DiffusionNFT: 1.0)")

    def rollout_weights(self, models: Models) -> ContextManager:
        return models.lagging.applied()

    def loss(self, models: Models, c: Chunk, j: int, adv: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """DiffusionNFT at schedule point j: the implicit positive/negative policies around the lagging one."""
        x_t, clip = c.noised[j][0], self.cfg.advantage.clip
        v = self.velocity(models, models.engine, c, j)
        loss, st = nft_loss(v, c.lagging[j], x_t, c.traj.x0, self.sigma(models, c, j), optimality_weight(adv, clip),
                            self.settings.beta, clip)
        return self.plus_regularizers(loss, st, v, c, j)
