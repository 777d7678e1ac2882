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

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from grpo.rewards.hub import FileRef
from grpo.rewards.openclip_loader import OpenClipPlan, OpenClipReward, check_arch, register_model_config
from grpo.rewards.options import OpenClipArch
from grpo.rewards.preprocess import normalize, resize_longest_pad
from grpo.schema import setting

__all__ = ["HPSReward", "HPSOptions", "HPS_FILES", "OPENAI_MEAN", "OPENAI_STD"]

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(kw_only=True)
class HPSOptions(OpenClipArch):
    model: str = setting("ViT-H-14", help="open_clip architecture the checkpoint belongs to")
    version: str = setting("v2.1", choices=tuple(HPS_FILES), help="HPS version; picks the checkpoint file")
    repo: str = setting(HPS_REPO, help="hub id or local folder holding the HPS checkpoint")
    filename: str | None = setting(None, help="checkpoint file name (default: by version)")


class HPSReward(OpenClipReward):
    """HPS v2 / v2.1 score of each image against its prompt (cosine similarity)."""

    DESCRIPTION = "HPS v2/v2.1: open_clip ViT-H-14 + HPS state dict (xswu/HPSv2); cosine similarity ~0.2-0.38"
    OPTIONS = HPSOptions

    @classmethod
    def _plan(cls, options: dict[str, Any], setting: str) -> OpenClipPlan:
        register_model_config(options["model_config"], options["model"], setting)
        filename = options["filename"] or HPS_FILES[options["version"]]
        ref = FileRef(f"{setting}.repo", options["repo"], (filename,), hub_hint=HPS_REPO)
        # A checkpoint file for a named architecture; HPS ships no open_clip_config.json.
        check_arch(options["model"], setting)
        return OpenClipPlan(options["model"], ref)

    def _load_extra(self, options: dict[str, Any], setting: str) -> None:
        size = self.model.visual.image_size
        self.size = int(size if isinstance(size, int) else max(size))

    def preprocess(self, images: Tensor) -> Tensor:
        """HPS eval transform on [B, 3, H, W] in [0, 1] -> [B, 3, S, S] normalised (S = model image size)."""
        x = resize_longest_pad(images.float(), self.size, "bicubic", fill=0.0, clamp=False)
        return normalize(x, OPENAI_MEAN, OPENAI_STD)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.cosine(self.preprocess(images).to(self.dtype), prompts, images.device)
