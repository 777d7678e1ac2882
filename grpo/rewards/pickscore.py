"""PickScore (yuvalkirstain/PickScore_v1): a transformers CLIPModel (ViT-H/14) fine-tuned on Pick-a-Pic preferences.

Loading follows the PickScore README: `CLIPModel.from_pretrained("yuvalkirstain/PickScore_v1")` and the processor of
"laion/CLIP-ViT-H-14-laion2B-s32B-b79K"; prompts tokenised with padding, truncation, max_length 77; image and text
embeddings L2-normalised. Nothing runs remote code (trust_remote_code is never passed); checkpoints are
safetensors or torch.load(weights_only=True) (transformers' default).

Score: the cosine by default, `logit_scale: true` multiplies by exp(logit_scale) (~100) as the README's
`model.logit_scale.exp() * text_embs @ image_embs.T`. Bare cosine is the default because DanceGRPO trains FLUX with it
(DanceGRPO fastvideo/train_grpo_flux.py --use_pickscore: cosine, no logit scale) and because it keeps PickScore (~0.2-0.25) on the same scale as HPS and CLIP score, so
weights in a mix mean what they say; within one reward the group-normalised advantages do not depend on the scale.

Preprocessing is transformers' own CLIPImageProcessor (torchvision backend) built from the processor's
preprocessor_config.json, run on the image tensors on the scoring device, so every field (resample, do_resize,
do_center_crop, do_rescale, do_normalize, size, crop_size, mean/std) counts as upstream. With `quantize` (default)
it gets uint8 tensors: exactly what it computes from the PIL images of the PickScore README. The model is loaded
strictly: missing, unexpected or mis-shaped weights are a ConfigError (transformers would only warn).
transformers >= 5 returns a BaseModelOutputWithPooling from get_*_features; `_embeddings` unwraps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo.errors import ConfigError
from grpo.rewards.base import ModelReward, to_uint8, unique_prompts
from grpo.rewards.hub import FileRef, hub_offline, is_local
from grpo.rewards.openclip_loader import first_line
from grpo.rewards.options import ModelOptions
from grpo.schema import setting

__all__ = ["PickScoreReward", "PickScoreOptions"]

MODEL_REPO = "yuvalkirstain/PickScore_v1"
PROCESSOR_REPO = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _embeddings(out: Any) -> Tensor:
    """get_image_features/get_text_features output -> [n, d] (a tensor before transformers 5, a ModelOutput after)."""
    if isinstance(out, Tensor):
        return out
    return out.pooler_output


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
        from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor

        setting_name = f"rewards.{name}"

        def source(value: str) -> dict[str, Any]:
            local = is_local(value)
            return {"pretrained_model_name_or_path": value, "cache_dir": self.cache_dir,
                    "local_files_only": local or hub_offline()}

        def load(option: str, fn: Any, **kwargs: Any) -> Any:
            try:
                return fn(**source(options[option]), **kwargs)
            except Exception as err:  # OSError, unpickling/safetensors errors, bad JSON, ...
                raise ConfigError(f"{setting_name}.{option}: cannot load {options[option]} "
                                  f"({first_line(err)})") from err

        self.tokenizer = load("processor", CLIPProcessor.from_pretrained).tokenizer
        # torchvision backend, whatever class the processor files name: it takes tensors on the scoring device.
        self.image_processor = load("processor", CLIPImageProcessor.from_pretrained)
        self.model, info = load("model", CLIPModel.from_pretrained, dtype=torch.float32, output_loading_info=True)
        wrong = {k: list(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if any(wrong.values()):
            found = "; ".join(f"{k.replace('_', ' ')} ({len(v)}): {', '.join(map(str, v[:3]))}"
                              for k, v in wrong.items() if v)
            raise ConfigError(f"{setting_name}.model: {options['model']} is not a complete CLIPModel checkpoint "
                              f"({found}); give the PickScore_v1 repo or folder")
        self.logit_scale = options["logit_scale"]
        self.max_length = options["max_length"]
        self.place()

    def modules(self) -> list[nn.Module]:
        return [self.model]

    def preprocess(self, images: Tensor) -> Tensor:
        """CLIPImageProcessor on [B, 3, H, W] in [0, 1] -> pixel_values; uint8 levels (quantize) or 0-255 floats."""
        x = to_uint8(images) if self.quantize else images.float() * 255
        out = self.image_processor(images=x, return_tensors="pt")["pixel_values"]
        return out.to(device=images.device, dtype=torch.float32)

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
