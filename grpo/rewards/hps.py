"""HPS v2 / v2.1 (Human Preference Score, tgxs002/HPSv2): an open_clip ViT-H-14 fine-tuned on human preferences.

Loading follows hpsv2/img_score.py with upstream open_clip: the architecture is built without weights and the HPS
checkpoint's complete `state_dict` is loaded strictly (the LAION ViT-H-14 weights DanceGRPO also downloads are
overwritten by it, so they are not needed). Score = cosine similarity of the L2-normalised image and text features,
no logit scale (HPS's `image_features @ text_features.T` diagonal): about 0.2-0.35, 0.30-0.38 on FLUX images.
Scores of v2.0 and v2.1 are not comparable, and HPS compares images of the same prompt only (its README).

Preprocessing is HPS's eval transform (hpsv2 `image_transform(..., resize_longest_max=True)`): ToTensor, longest side
to the model's image size (bicubic, antialiased tensor resize, no clamp), zero padding to a square, OpenAI mean/std;
not open_clip's default shortest-side crop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo.rewards.base import ModelReward, unique_prompts
from grpo.rewards.hub import FileRef
from grpo.rewards.openclip_loader import OpenClipPlan, check_arch, load_open_clip, register_model_config
from grpo.rewards.options import MODEL_OPTIONS, Option
from grpo.rewards.preprocess import normalize, resize_longest_pad

__all__ = ["HPSReward", "HPS_FILES", "OPENAI_MEAN", "OPENAI_STD"]

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


class HPSReward(ModelReward):
    """HPS v2 / v2.1 score of each image against its prompt (cosine similarity)."""

    DESCRIPTION = "HPS v2/v2.1: open_clip ViT-H-14 + HPS state dict (xswu/HPSv2); cosine similarity ~0.2-0.38"
    OPTIONS = {
        **MODEL_OPTIONS,
        "version": Option(str, "v2.1", "HPS version; picks the checkpoint file", choices=tuple(HPS_FILES)),
        "repo": Option(str, HPS_REPO, "hub id or local folder holding the HPS checkpoint"),
        "filename": Option(str, None, "checkpoint file name (default: by version)", nullable=True),
        "model": Option(str, "ViT-H-14", "open_clip architecture the checkpoint belongs to"),
        "model_config": Option(str, None, "open_clip model-config JSON registering `model` (custom/tiny)",
                               nullable=True),
    }

    @classmethod
    def _plan(cls, options: dict[str, Any], setting: str) -> OpenClipPlan:
        register_model_config(options["model_config"], options["model"], setting)
        filename = options["filename"] or HPS_FILES[options["version"]]
        ref = FileRef(f"{setting}.repo", options["repo"], (filename,), hub_hint=HPS_REPO)
        # A checkpoint file for a named architecture; HPS ships no open_clip_config.json.
        check_arch(options["model"], setting)
        return OpenClipPlan(options["model"], ref)

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
        size = self.model.visual.image_size
        self.size = int(size if isinstance(size, int) else max(size))
        self.place()

    def modules(self) -> list[nn.Module]:
        return [self.model]

    def preprocess(self, images: Tensor) -> Tensor:
        """HPS eval transform on [B, 3, H, W] in [0, 1] -> [B, 3, S, S] normalised (S = model image size)."""
        x = resize_longest_pad(images.float(), self.size, "bicubic", fill=0.0, clamp=False)
        return normalize(x, OPENAI_MEAN, OPENAI_STD)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        pixels = self.preprocess(images).to(self.dtype)
        texts, inverse = unique_prompts(prompts)
        tokens = self.tokenizer(texts).to(images.device)
        image_features = F.normalize(self.model.encode_image(pixels).float(), dim=-1)
        text_features = F.normalize(self.model.encode_text(tokens).float(), dim=-1)
        return (image_features * text_features[inverse.to(images.device)]).sum(-1)
