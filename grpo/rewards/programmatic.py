"""Rewards computed by code, without a model: the tiny world's score (from the prompt text, or from each sample's
metadata), its editing score (from each edit's metadata and source image) and DDPO's JPEG rewards."""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo.errors import ConfigError
from grpo.rewards.base import Reward
from grpo.rewards.options import CommonOptions
from grpo.schema import setting

__all__ = ["TinyWorldReward", "TinyWorldMetaReward", "TinyEditReward", "JpegIncompressibility", "JpegCompressibility", "jpeg_kilobytes"]


class TinyWorldReward(Reward):
    """grpo.tiny.world.score: how well an image shows "a {color} {shape} on a {background} background", in [0, 1]."""

    DESCRIPTION = "tiny world's programmatic reward (grpo.tiny.world.score), in [0, 1]"
    OPTIONS = CommonOptions

    @classmethod
    def validate(cls, options: dict[str, Any], setting: str) -> None:
        import importlib.util

        if importlib.util.find_spec("grpo.tiny.world") is None:
            raise ConfigError(f"{setting}: module grpo.tiny.world is missing; the tiny_world reward needs it")

    def __init__(self, name: str, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(name, options["batch_size"])
        self._device = torch.device(device)
        # Imported here so that the reward package does not import the tiny world unless it is used.
        from grpo.tiny import world

        self.world = world

    @property
    def device(self) -> torch.device:
        return self._device

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.world.score(images, prompts)


class TinyWorldMetaReward(TinyWorldReward):
    """tiny_world's score of the scene each sample's metadata names (color, shape, background: the fields of
    assets/prompts/tiny_*.jsonl), its prompt text unread; on the world's own rows it equals tiny_world."""

    DESCRIPTION = "tiny_world scored from each sample's metadata (color, shape, background), not the prompt text"

    @classmethod
    def check_metadata(cls, metadata: dict, options: dict[str, Any]) -> None:
        from grpo.tiny import world

        world.scene(metadata)

    def score_samples(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return self.world.score_scenes(images, [self.world.scene(m) for m in metadata])


class TinyEditReward(TinyWorldReward):
    """grpo.tiny.world.edit_score of each edit: the edited scene its metadata names (color, shape, background) and
    the placement of its source image's shape (the row's image, of the scene its "source" prompt names), the rows
    of assets/prompts/tiny_edit_*.jsonl."""

    DESCRIPTION = ("tiny world's editing reward (grpo.tiny.world.edit_score): the edited scene of each row's "
                   "metadata, kept where the source image's shape is; in [0, 1]")

    @classmethod
    def check_metadata(cls, metadata: dict, options: dict[str, Any]) -> None:
        from grpo.prompt_sets import row_images
        from grpo.tiny import world

        world.scene(metadata)
        if len(row_images(metadata)) != 1 or not isinstance(metadata.get("source"), str):
            raise ValueError("needs one source image (\"image\") and its scene's prompt (\"source\"), as the rows "
                             "of assets/prompts/tiny_edit_train.jsonl have")
        world.parse(metadata["source"])

    def score_samples(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        from grpo.prompt_sets import row_images

        sources = torch.stack([_source_image(row_images(m)[0]) for m in metadata]).to(images.device)
        return self.world.edit_score(images, [self.world.scene(m) for m in metadata], sources,
                                     [self.world.parse(m["source"]) for m in metadata])


@functools.lru_cache(maxsize=256)
def _source_image(path: str) -> Tensor:
    """A source image, read once per path: a group's samples share it."""
    from grpo.prompt_sets import read_image

    return read_image(path)


def jpeg_kilobytes(images: Tensor, quality: int = 95) -> Tensor:
    """JPEG size of each image in kB (1000 bytes), as DDPO's `jpeg_incompressibility`.

    Images are quantised like DDPO ((x * 255).round().clamp(0, 255) to uint8) and saved by PIL at `quality`. The
    encoder runs on the CPU whatever the images' device: JPEG size is a property of the encoded file.

    Args:
        images: [B, 3, H, W] in [0, 1].
        quality: JPEG quality (DDPO: 95).

    Returns:
        float32 [B] on the CPU.
    """
    from PIL import Image

    pixels = (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8).cpu()
    pixels = pixels.permute(0, 2, 3, 1).contiguous().numpy()
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


@dataclass(kw_only=True)
class JpegOptions(CommonOptions):
    quality: int = setting(95, help="JPEG quality, 1-95 (DDPO: 95)")


class JpegIncompressibility(Reward):
    """DDPO's jpeg_incompressibility: JPEG size in kB (bigger = more detail)."""

    DESCRIPTION = "DDPO jpeg_incompressibility: JPEG size in kB (quality 95)"
    OPTIONS = JpegOptions
    SIGN = 1.0

    @classmethod
    def validate(cls, options: dict[str, Any], setting: str) -> None:
        if not 1 <= options["quality"] <= 95:
            raise ConfigError(f"{setting}.quality: {options['quality']} outside 1-95 (PIL's useful range); "
                              f"DDPO uses 95")

    def __init__(self, name: str, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(name, options["batch_size"])
        self.quality = options["quality"]
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.SIGN * jpeg_kilobytes(images, self.quality)


class JpegCompressibility(JpegIncompressibility):
    """DDPO's jpeg_compressibility: minus the JPEG size in kB (smaller files score higher)."""

    DESCRIPTION = "DDPO jpeg_compressibility: minus the JPEG size in kB (quality 95)"
    SIGN = -1.0
