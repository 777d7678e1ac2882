"""CLIP score: cosine similarity between an open_clip model's image and prompt embeddings.

`model` + `pretrained` choose the CLIP: ViT-H-14 + laion2b_s32b_b79k (default), ViT-H-14-378 + dfn5b or
"hf-hub:apple/DFN5B-CLIP-ViT-H-14-378" (DanceGRPO's multi-reward CLIP, 378 px, QuickGELU, squash resize), any other
open_clip tag, hub repo or local folder (see grpo/rewards/openclip_loader.py). Preprocessing is the model's own
open_clip eval transform: on the uint8 PIL images (`quantize`, default), or our tensor version of it.

`scale` multiplies the cosine. The default 1.0 gives the bare cosine, the number DanceGRPO and its follow-ups report as
"CLIP score" (about 0.3-0.43 on FLUX) and on the same scale as HPS, so mix weights compare directly. 100 gives
torchmetrics' CLIPScore convention (without its clamp at 0); 2.5 with a clamp is Hessel et al.'s CLIP-S.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from grpo.rewards.openclip_loader import OpenClipReward
from grpo.rewards.options import OpenClipOptions
from grpo.schema import setting

__all__ = ["ClipScoreReward", "ClipScoreOptions"]


@dataclass(kw_only=True)
class ClipScoreOptions(OpenClipOptions):
    scale: float = setting(1.0, help="multiplies the cosine (1 = bare cosine as DanceGRPO; 100 = torchmetrics)")


class ClipScoreReward(OpenClipReward):
    """Cosine similarity (times `scale`) of open_clip image and text embeddings."""

    DESCRIPTION = "CLIP score: open_clip cosine(image, prompt) x scale; model/pretrained configurable (ViT-H-14, DFN5B)"
    OPTIONS = ClipScoreOptions

    def _load_extra(self, options: dict[str, Any], setting: str) -> None:
        self.scale = options["scale"]

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.scale * self.cosine(self.preprocess(images).to(self.dtype), prompts, images.device)
