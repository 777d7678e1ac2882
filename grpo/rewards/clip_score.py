"""CLIP score: cosine similarity between an open_clip model's image and prompt embeddings.

`model` + `pretrained` choose the CLIP: ViT-H-14 + laion2b_s32b_b79k (default), ViT-H-14-378 + dfn5b or
"hf-hub:apple/DFN5B-CLIP-ViT-H-14-378" (DanceGRPO's multi-reward CLIP, 378 px, QuickGELU, squash resize), any other
open_clip tag, hub repo or local folder (see grpo/rewards/openclip_loader.py). Preprocessing is the model's own
open_clip eval transform, on tensors.

`scale` multiplies the cosine. The default 1.0 gives the bare cosine, the number DanceGRPO and its follow-ups report as
"CLIP score" (about 0.3-0.43 on FLUX) and on the same scale as HPS, so mix weights compare directly. 100 gives
torchmetrics' CLIPScore convention (without its clamp at 0); 2.5 with a clamp is Hessel et al.'s CLIP-S.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo.rewards.base import ModelReward, unique_prompts
from grpo.rewards.hub import FileRef
from grpo.rewards.openclip_loader import (
    OpenClipPlan,
    clip_preprocess,
    load_open_clip,
    plan_open_clip,
    register_model_config,
)
from grpo.rewards.options import MODEL_OPTIONS, Option

__all__ = ["ClipScoreReward", "OPEN_CLIP_OPTIONS"]

# Shared with the aesthetic predictor's CLIP backbone.
OPEN_CLIP_OPTIONS = {
    "model": Option(str, "ViT-H-14", "open_clip architecture (ignored when pretrained is hf-hub:/a folder)"),
    "pretrained": Option(str, "laion2b_s32b_b79k",
                         "open_clip tag of `model`, hf-hub:ORG/NAME, local open_clip folder or checkpoint file"),
    "model_config": Option(str, None, "open_clip model-config JSON registering `model` (custom/tiny)", nullable=True),
}


class ClipScoreReward(ModelReward):
    """Cosine similarity (times `scale`) of open_clip image and text embeddings."""

    DESCRIPTION = "CLIP score: open_clip cosine(image, prompt) x scale; model/pretrained configurable (ViT-H-14, DFN5B)"
    OPTIONS = {
        **MODEL_OPTIONS,
        **OPEN_CLIP_OPTIONS,
        "scale": Option(float, 1.0, "multiplies the cosine (1 = bare cosine as DanceGRPO; 100 = torchmetrics)"),
    }

    @classmethod
    def _plan(cls, options: dict[str, Any], setting: str) -> OpenClipPlan:
        register_model_config(options["model_config"], options["model"], setting)
        return plan_open_clip(options["model"], options["pretrained"], setting)

    @classmethod
    def validate(cls, options: dict[str, Any], setting: str) -> None:
        cls._plan(options, setting)

    @classmethod
    def files(cls, options: dict[str, Any], setting: str) -> list[FileRef]:
        return cls._plan(options, setting).files()

    def __init__(self, name: str, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(name, device, options)
        setting = f"rewards.{name}"
        self.model, self.tokenizer = load_open_clip(self._plan(options, setting), self.cache_dir, setting)
        self.preprocess_cfg = dict(self.model.visual.preprocess_cfg)
        self.scale = options["scale"]
        self.place()

    def modules(self) -> list[nn.Module]:
        return [self.model]

    def preprocess(self, images: Tensor) -> Tensor:
        """open_clip eval transform of this model on [B, 3, H, W] in [0, 1]."""
        return clip_preprocess(images.float(), self.preprocess_cfg)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        pixels = self.preprocess(images).to(self.dtype)
        texts, inverse = unique_prompts(prompts)
        tokens = self.tokenizer(texts).to(images.device)
        image_features = F.normalize(self.model.encode_image(pixels).float(), dim=-1)
        text_features = F.normalize(self.model.encode_text(tokens).float(), dim=-1)
        return self.scale * (image_features * text_features[inverse.to(images.device)]).sum(-1)
