"""PickScore (yuvalkirstain/PickScore_v1): a transformers CLIPModel (ViT-H/14) fine-tuned on Pick-a-Pic preferences.

Loading follows the PickScore README: `CLIPModel.from_pretrained("yuvalkirstain/PickScore_v1")` and the processor of
"laion/CLIP-ViT-H-14-laion2B-s32B-b79K"; prompts tokenised with padding, truncation, max_length 77; image and text
embeddings L2-normalised. Nothing runs remote code (trust_remote_code is never passed); checkpoints are
safetensors or torch.load(weights_only=True) (transformers' default).

Score: the cosine by default, `logit_scale: true` multiplies by exp(logit_scale) (~100) as the README's
`model.logit_scale.exp() * text_embs @ image_embs.T`. Bare cosine is the default because DanceGRPO trains FLUX with it
(DanceGRPO fastvideo/train_grpo_flux.py --use_pickscore: cosine, no logit scale) and because it keeps PickScore (~0.2-0.25) on the same scale as HPS and CLIP score, so
weights in a mix mean what they say; within one reward the group-normalised advantages do not depend on the scale.

Preprocessing is the processor's CLIPImageProcessor on tensors: shortest side to size["shortest_edge"] (bicubic,
antialiased), centre crop (transformers' floor split), rescale to [0, 1], normalise with its mean/std.
transformers >= 5 returns a BaseModelOutputWithPooling from get_*_features; `_embeddings` unwraps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo.rewards.base import ModelReward, unique_prompts
from grpo.rewards.hub import FileRef, hub_offline, is_local
from grpo.rewards.options import ModelOptions
from grpo.rewards.preprocess import normalize, resize_shortest_center_crop
from grpo.schema import setting

__all__ = ["PickScoreReward", "PickScoreOptions"]

MODEL_REPO = "yuvalkirstain/PickScore_v1"
PROCESSOR_REPO = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL codes


def _embeddings(out: Any) -> Tensor:
    """get_image_features/get_text_features output -> [n, d] (a tensor before transformers 5, a ModelOutput after)."""
    if isinstance(out, Tensor):
        return out
    return out.pooler_output


def _get(cfg: Any, key: str) -> Any:
    return cfg[key] if isinstance(cfg, dict) else getattr(cfg, key, None)


@dataclass(kw_only=True)
class PickScoreOptions(ModelOptions):
    model: str = setting(MODEL_REPO, help="hub id or local folder of the PickScore CLIPModel")
    processor: str = setting(PROCESSOR_REPO, help="hub id or local folder of the CLIP processor (tokenizer + image)")
    logit_scale: bool = setting(False, help="multiply the cosine by exp(logit_scale) (~100); DanceGRPO: false")
    max_length: int = setting(77, help="prompt token limit (longer prompts are truncated)")


class PickScoreReward(ModelReward):
    """PickScore of each image against its prompt."""

    DESCRIPTION = "PickScore_v1: transformers CLIPModel cosine(image, prompt) (x exp(logit_scale) if logit_scale)"
    OPTIONS = PickScoreOptions

    @classmethod
    def files(cls, options: dict[str, Any], setting: str) -> list[FileRef]:
        model, proc = options["model"], options["processor"]
        return [
            FileRef(f"{setting}.model", model, ("config.json",), hub_hint=MODEL_REPO),
            FileRef(f"{setting}.model", model, WEIGHTS, hub_hint=MODEL_REPO),
            FileRef(f"{setting}.processor", proc, ("preprocessor_config.json", "processor_config.json"),
                    hub_hint=PROCESSOR_REPO),
            FileRef(f"{setting}.processor", proc, ("tokenizer.json", "vocab.json"), hub_hint=PROCESSOR_REPO),
        ]

    def __init__(self, name: str, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(name, device, options)
        from transformers import CLIPModel, CLIPProcessor

        def source(value: str) -> dict[str, Any]:
            local = is_local(value)
            return {"pretrained_model_name_or_path": value, "cache_dir": self.cache_dir,
                    "local_files_only": local or hub_offline()}

        processor = CLIPProcessor.from_pretrained(**source(options["processor"]))
        self.tokenizer = processor.tokenizer
        ip = processor.image_processor
        self.short = int(_get(ip.size, "shortest_edge") or min(_get(ip.size, "height"), _get(ip.size, "width")))
        self.crop = (int(_get(ip.crop_size, "height")), int(_get(ip.crop_size, "width")))
        self.mean, self.std = tuple(ip.image_mean), tuple(ip.image_std)
        resample = getattr(ip.resample, "value", ip.resample)
        self.interpolation = _RESAMPLE.get(int(resample) if resample is not None else 3, "bicubic")
        self.model = CLIPModel.from_pretrained(**source(options["model"]), dtype=torch.float32)
        self.logit_scale = options["logit_scale"]
        self.max_length = options["max_length"]
        self.place()

    def modules(self) -> list[nn.Module]:
        return [self.model]

    def preprocess(self, images: Tensor) -> Tensor:
        """CLIPImageProcessor on [B, 3, H, W] in [0, 1] -> [B, 3, crop_h, crop_w] normalised."""
        x = resize_shortest_center_crop(images.float(), self.short, self.crop, self.interpolation,
                                        crop_rounding="floor")
        return normalize(x, self.mean, self.std)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        pixels = self.preprocess(images).to(self.dtype)
        texts, inverse = unique_prompts(prompts)
        tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        tokens = {k: v.to(images.device) for k, v in tokens.items()}
        image_embeds = F.normalize(_embeddings(self.model.get_image_features(pixel_values=pixels)).float(), dim=-1)
        text_embeds = F.normalize(_embeddings(self.model.get_text_features(**tokens)).float(), dim=-1)
        scores = (image_embeds * text_embeds[inverse.to(images.device)]).sum(-1)
        if self.logit_scale:
            scores = scores * self.model.logit_scale.float().exp()
        return scores
