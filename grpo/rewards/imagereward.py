"""ImageReward (THUDM/ImageReward, Apache-2.0): BLIP (ViT-L/16 image encoder + a BERT text encoder that
cross-attends to the image) and an MLP on the text encoder's [CLS] state, trained on 137k expert comparisons.

Scoring follows the `image-reward` package (1.5, ImageReward/ImageReward.py `ImageReward.score`): prompt tokenised by
BLIP's BERT tokenizer (bert-base-uncased plus the [DEC] bos and [ENC] tokens BLIP adds, blip.py `init_tokenizer`),
padding "max_length", truncation, max 35 tokens; image through its `_transform(224)` (Resize(224) bicubic on the
shortest side, CenterCrop(224), ToTensor, OpenAI CLIP mean/std); BLIP's visual encoder on the image, the text encoder
with the image tokens as encoder states, `last_hidden_state[:, 0]` through the MLP, then (r - 0.16717362830052426)
/ 1.0333394966054072 (the package's mean/std). Scores are about -2..2 (0 = the mean of its training images).

The networks are transformers' BLIP classes (BlipVisionModel, BlipTextModel: ports of BLIP's vit.py and med.py) and
the MLP is the LAION aesthetic head's class (the same five Linear layers, keys layers.{0,2,4,6,7}), loaded from the
package's checkpoint ImageReward.pt by renaming its keys (VISION_KEYS). The package itself is not imported: its
med.py imports helpers transformers 5 no longer has, its `__init__` imports OpenAI's `clip`, its vit.py fairscale.
The text encoder's sizes come from the repo's med_config.json (as the package builds it); the image encoder's from
the checkpoint's shapes (BLIP's ViTs have 64-wide heads, LayerNorm eps 1e-6), so the tiny test checkpoints load
through the same code.

Weights: the hub repo THUDM/ImageReward (also zai-org/ImageReward) holds ImageReward.pt (~1.8 GB, a pickled state
dict: `torch.load(weights_only=True)` reads it) and med_config.json; the tokenizer is google-bert/bert-base-uncased
(vocab.txt). Offline: `hf download THUDM/ImageReward ImageReward.pt med_config.json` and `hf download
google-bert/bert-base-uncased vocab.txt tokenizer_config.json`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from grpo.errors import ConfigError
from grpo.rewards.aesthetic import AestheticMLP
from grpo.rewards.base import ModelReward, unique_prompts
from grpo.rewards.hps import OPENAI_MEAN, OPENAI_STD
from grpo.rewards.hub import FileRef, hub_offline, is_local, locate
from grpo.rewards.openclip_loader import clip_preprocess, first_line, pil_transform
from grpo.rewards.options import ModelOptions
from grpo.schema import setting

__all__ = ["ImageRewardReward", "ImageRewardOptions", "IMAGEREWARD_MEAN", "IMAGEREWARD_STD", "VISION_KEYS",
           "to_package_keys"]

logger = logging.getLogger(__name__)

REPO = "THUDM/ImageReward"
CHECKPOINT = "ImageReward.pt"
MED_CONFIG = "med_config.json"
TOKENIZER_REPO = "google-bert/bert-base-uncased"
# ImageReward.py: `self.mean`, `self.std` (the raw MLP output's statistics on its training set).
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
IMAGE_SIZE = 224  # ImageReward.py: BLIP_Pretrain(image_size=224, ...) and _transform(224)
MAX_TOKENS = 35  # ImageReward.py score(): max_length=35
# BLIP vit.py (timm's VisionTransformer layout) -> transformers BlipVisionModel, applied in order to ".key"; the
# text encoder's names are equal (med.py's BertModel is what BlipTextModel ports).
VISION_KEYS = (
    (".cls_token", ".embeddings.class_embedding"),
    (".pos_embed", ".embeddings.position_embedding"),
    (".patch_embed.proj.", ".embeddings.patch_embedding."),
    (".blocks.", ".encoder.layers."),
    (".norm1.", ".layer_norm1."),
    (".norm2.", ".layer_norm2."),
    (".attn.qkv.", ".self_attn.qkv."),
    (".attn.proj.", ".self_attn.projection."),
    (".norm.", ".post_layernorm."),
)
# Parts of the checkpoint the score does not use: BLIP_Pretrain's contrastive projections, and med.py's position ids
# (a persistent buffer there, arange(max_position_embeddings); BlipTextModel makes its own).
UNUSED = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")


def _rename(key: str, pairs: tuple[tuple[str, str], ...]) -> str:
    key = "." + key
    for old, new in pairs:
        key = key.replace(old, new)
    return key[1:]


def to_package_keys(vision: dict[str, Tensor], text: dict[str, Tensor], mlp: dict[str, Tensor]) -> dict[str, Tensor]:
    """The package's ImageReward.pt layout of our modules' state dicts (the tiny test checkpoints are written so)."""
    inverse = tuple((new, old) for old, new in reversed(VISION_KEYS))
    return {**{f"blip.visual_encoder.{_rename(k, inverse)}": v for k, v in vision.items()},
            **{f"blip.text_encoder.{k}": v for k, v in text.items()},
            **{f"mlp.{k}": v for k, v in mlp.items()}}


def _split(state: dict[str, Tensor], where: str) -> tuple[dict[str, Tensor], ...]:
    """ImageReward.pt's state dict -> (BlipVisionModel, BlipTextModel, MLP, other) state dicts."""
    parts: tuple[dict[str, Tensor], ...] = ({}, {}, {}, {})
    for key, value in state.items():
        if key.startswith(UNUSED):
            continue
        if key.startswith("blip.visual_encoder."):
            parts[0][_rename(key.removeprefix("blip.visual_encoder."), VISION_KEYS)] = value
        elif key.startswith("blip.text_encoder."):
            parts[1][key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp."):
            parts[2][key.removeprefix("mlp.")] = value
        else:
            parts[3][key] = value
    if not all(parts[:3]):
        raise ConfigError(f"{where}: not an ImageReward checkpoint (expected blip.visual_encoder.*, "
                          f"blip.text_encoder.*, mlp.*; found {list(state)[:3]}); give ImageReward.pt of {REPO}")
    return parts


def _vision_config(state: dict[str, Tensor]) -> Any:
    """BLIP's ViT sizes from its weights: create_vit's 'base' and 'large' both have 64-wide heads and eps 1e-6."""
    from transformers import BlipVisionConfig

    width = state["embeddings.class_embedding"].shape[-1]
    patch = state["embeddings.patch_embedding.weight"].shape[-1]
    grid = round((state["embeddings.position_embedding"].shape[1] - 1) ** 0.5)
    depth = len({k.split(".")[2] for k in state if k.startswith("encoder.layers.")})
    return BlipVisionConfig(hidden_size=width, intermediate_size=state["encoder.layers.0.mlp.fc1.weight"].shape[0],
                            num_hidden_layers=depth, num_attention_heads=max(width // 64, 1), image_size=grid * patch,
                            patch_size=patch, hidden_act="gelu", layer_norm_eps=1e-6)


def _text_config(med: dict[str, Any], encoder_width: int) -> Any:
    """med_config.json (a BertConfig with add_cross_attention) as a BlipTextConfig; encoder_width = the ViT's
    (blip_pretrain.py: `encoder_config.encoder_width = vision_width`)."""
    from transformers import BlipTextConfig

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "hidden_act", "layer_norm_eps", "pad_token_id")
    return BlipTextConfig(**{k: med[k] for k in keys if k in med}, encoder_hidden_size=encoder_width)


@dataclass(kw_only=True)
class ImageRewardOptions(ModelOptions):
    repo: str = setting(REPO, help="hub id or local folder holding ImageReward.pt and med_config.json")
    tokenizer: str = setting(TOKENIZER_REPO, help="hub id or local folder of BLIP's BERT tokenizer (vocab.txt)")


class ImageRewardReward(ModelReward):
    """ImageReward score of each image against its prompt (the package's `score()`)."""

    DESCRIPTION = "ImageReward v1.0: BLIP + MLP (THUDM/ImageReward), (r - mean) / std as the package; about -2..2"
    OPTIONS = ImageRewardOptions

    @classmethod
    def files(cls, options: dict[str, Any], setting: str) -> list[FileRef]:
        return [FileRef(f"{setting}.repo", options["repo"], (CHECKPOINT,), hub_hint=REPO),
                FileRef(f"{setting}.repo", options["repo"], (MED_CONFIG,), hub_hint=REPO),
                FileRef(f"{setting}.tokenizer", options["tokenizer"], ("vocab.txt",), hub_hint=TOKENIZER_REPO)]

    def __init__(self, name: str, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(name, device, options)
        from transformers import BertTokenizer
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        where = f"rewards.{name}"
        checkpoint, med_file, _ = (locate(ref, self.cache_dir, download=True) for ref in self.files(options, where))
        try:
            state = torch.load(checkpoint, map_location="cpu", weights_only=True)
            med = json.loads(med_file.read_text())
        except Exception as err:  # pickle.UnpicklingError (weights_only), EOFError, bad JSON, OSError, ...
            raise ConfigError(f"{where}.repo: cannot read {checkpoint} or {med_file} ({first_line(err)})") from err
        vision, text, mlp, other = _split(state, f"{where}.repo")
        try:
            self.vision = BlipVisionModel(_vision_config(vision))
            self.text = BlipTextModel(_text_config(med, self.vision.config.hidden_size), add_pooling_layer=False)
            # Unexpected keys are ignored as the package's load (strict=False) ignores them; missing ones are not.
            ignored = list(other)
            for module, part in ((self.vision, vision), (self.text, text)):
                loaded = module.load_state_dict(part, strict=False)
                if loaded.missing_keys:
                    raise KeyError(f"missing {loaded.missing_keys[:3]}")
                ignored += loaded.unexpected_keys
        except (KeyError, RuntimeError, ValueError) as err:  # missing or mis-shaped weights
            raise ConfigError(f"{where}.repo: {checkpoint} does not fit {MED_CONFIG} and BLIP's ViT "
                              f"({first_line(err)})") from err
        if ignored:
            logger.warning("%s: %d checkpoint keys the score does not use were ignored (%s, ...)", where,
                           len(ignored), ignored[0])
        self.mlp = AestheticMLP.from_state_dict(mlp, f"{where}.repo")
        if self.vision.config.image_size != IMAGE_SIZE:
            raise ConfigError(f"{where}.repo: the checkpoint's ViT takes {self.vision.config.image_size} px images, "
                              f"ImageReward preprocesses to {IMAGE_SIZE}")
        source = options["tokenizer"]
        try:
            self.tokenizer = BertTokenizer.from_pretrained(source, cache_dir=self.cache_dir,
                                                           local_files_only=is_local(source) or hub_offline())
        except Exception as err:  # OSError, bad files
            raise ConfigError(f"{where}.tokenizer: cannot load {source} ({first_line(err)})") from err
        # blip.py init_tokenizer: the two tokens BLIP adds (ids 30522, 30523: med_config's vocab_size 30524).
        self.tokenizer.add_special_tokens({"bos_token": "[DEC]"})
        self.tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
        self.place()
        self.mlp.float()  # ImageReward.py: the [CLS] features are cast to float before the MLP

    def modules(self) -> list[nn.Module]:
        return [self.vision, self.text, self.mlp]

    def preprocess(self, images: Tensor) -> Tensor:
        """The package's _transform(224) on [B, 3, H, W] in [0, 1]: on the uint8 PIL images (quantize, default), as
        the package scores them, or our tensor version of it on the scoring device."""
        cfg = {"size": IMAGE_SIZE, "mean": OPENAI_MEAN, "std": OPENAI_STD, "interpolation": "bicubic"}
        if not self.quantize:
            return clip_preprocess(images.float(), cfg)
        if getattr(self, "_pil", None) is None:
            from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

            self._pil = Compose([Resize(IMAGE_SIZE, interpolation=InterpolationMode.BICUBIC), CenterCrop(IMAGE_SIZE),
                                 ToTensor(), Normalize(OPENAI_MEAN, OPENAI_STD)])
        return pil_transform(images, self._pil)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        device = images.device
        texts, inverse = unique_prompts(prompts)
        tokens = self.tokenizer(texts, padding="max_length", truncation=True, max_length=MAX_TOKENS,
                                return_tensors="pt").to(device)
        index = inverse.to(device)
        image_embeds = self.vision(pixel_values=self.preprocess(images).to(self.dtype)).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=device)
        out = self.text(input_ids=tokens.input_ids[index], attention_mask=tokens.attention_mask[index],
                        encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts, return_dict=True)
        rewards = self.mlp(out.last_hidden_state[:, 0, :].float()).squeeze(-1)
        return (rewards - IMAGEREWARD_MEAN) / IMAGEREWARD_STD
