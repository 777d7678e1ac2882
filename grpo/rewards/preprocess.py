"""Image preprocessing of the reward models, on tensors on the scoring device (no PIL round trip).

Each function mirrors one project's reference pipeline on float images in [0, 1]:

- `resize_shortest_center_crop`: torchvision `Resize(int)` + `CenterCrop` (open_clip "shortest", OpenAI CLIP,
  the aesthetic predictor) and transformers `CLIPImageProcessor` (PickScore); they differ only in how an odd crop
  margin is split (`crop_rounding`).
- `resize_longest_pad`: HPS v2 `ResizeMaxSize` and open_clip "longest" (longest side to the size, zero padding
  centred, the extra pixel right/bottom).
- `squash`: open_clip "squash" (DFN5B).

Resizing uses `F.interpolate(..., antialias=True)`: its bicubic filter is Keys' a = -0.5 with the kernel widened by
the downscale factor, the filter PIL uses, so it matches PIL and torchvision's tensor resize. PIL-based references
also clamp to [0, 255] and round to uint8 after resizing; `clamp=True` reproduces the clamp (the rounding, at most
half a grey level, is not reproduced). Measured differences are in tests/unit/test_rewards_preprocess.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "check_images",
    "resize",
    "resize_shortest_center_crop",
    "resize_longest_pad",
    "squash",
    "normalize",
]

logger = logging.getLogger(__name__)
_warned_fallback: set[str] = set()


def check_images(images: Tensor, prompts: Sequence[str]) -> None:
    """Raises ValueError unless images is [B, 3, H, W] floating point with B == len(prompts)."""
    if images.ndim != 4 or images.shape[1] != 3 or not images.is_floating_point():
        raise ValueError(f"images must be a float tensor [B, 3, H, W] in [0, 1], got {tuple(images.shape)} "
                         f"{images.dtype}")
    if images.shape[0] != len(prompts):
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")


def resize(x: Tensor, size: tuple[int, int], interpolation: str = "bicubic") -> Tensor:
    """Antialiased resize of [B, C, H, W] float images to size (h, w), PIL-style filter.

    Devices without the antialiased kernels (some NPU builds) resize on the CPU instead, with a one-time warning.
    """
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    mode = "bilinear" if interpolation == "bilinear" else "bicubic"
    try:
        return F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=True)
    except (RuntimeError, NotImplementedError):
        if x.device.type == "cpu":
            raise
        if x.device.type not in _warned_fallback:
            _warned_fallback.add(x.device.type)
            logger.warning("antialiased %s resize is not available on %s; resizing reward inputs on the CPU",
                           mode, x.device.type)
        out = F.interpolate(x.float().cpu(), size=size, mode=mode, align_corners=False, antialias=True)
        return out.to(device=x.device, dtype=x.dtype)


def _shortest_edge_size(h: int, w: int, short: int) -> tuple[int, int]:
    # torchvision Resize(int) and transformers get_resize_output_image_size truncate the long side with int().
    if h <= w:
        return short, int(short * w / h)
    return int(short * h / w), short


def _crop_start(length: int, crop: int, rounding: str) -> int:
    if rounding == "torchvision":  # torchvision center_crop: int(round((h - ch) / 2.0)), round half to even
        return int(round((length - crop) / 2.0))
    return (length - crop) // 2  # transformers center_crop


def resize_shortest_center_crop(
    x: Tensor,
    short: int,
    crop: tuple[int, int],
    interpolation: str = "bicubic",
    crop_rounding: str = "torchvision",
    clamp: bool = True,
) -> Tensor:
    """Shortest side to `short`, then a centred crop of `crop` (h, w).

    Args:
        x: [B, 3, H, W] float images in [0, 1].
        short: target length of the shortest side.
        crop: (h, w) of the centre crop; must fit in the resized image.
        interpolation: "bicubic" or "bilinear".
        crop_rounding: "torchvision" (open_clip, OpenAI CLIP) or "floor" (transformers CLIPImageProcessor).
        clamp: clamp to [0, 1] after resizing, as PIL's uint8 output is.

    Returns:
        [B, 3, crop_h, crop_w] float images.
    """
    h, w = x.shape[-2:]
    nh, nw = _shortest_edge_size(h, w, short)
    ch, cw = crop
    if ch > nh or cw > nw:
        raise ValueError(f"crop {crop} does not fit in the image resized to {(nh, nw)}")
    y = resize(x, (nh, nw), interpolation)
    if clamp:
        y = y.clamp(0.0, 1.0)
    top, left = _crop_start(nh, ch, crop_rounding), _crop_start(nw, cw, crop_rounding)
    return y[..., top : top + ch, left : left + cw]


def resize_longest_pad(
    x: Tensor, size: int, interpolation: str = "bicubic", fill: float = 0.0, clamp: bool = False
) -> Tensor:
    """Longest side to `size` keeping the aspect ratio, then pad to size x size with `fill` (HPS `ResizeMaxSize`).

    The new sides are round(side * size / longest) (Python rounding, as HPS and open_clip do); the padding is
    split pad // 2 before and the rest after. Unlike HPS, an image whose longest side already equals `size` is
    still padded to a square (HPS would return it unpadded, which the ViT cannot take).

    Args:
        x: [B, 3, H, W] float images in [0, 1].
        size: output side.
        interpolation: "bicubic" or "bilinear".
        fill: padding value in [0, 1] image units (HPS: 0, black).
        clamp: clamp to [0, 1] after resizing (False for HPS, whose resize runs on tensors).

    Returns:
        [B, 3, size, size].
    """
    h, w = x.shape[-2:]
    scale = size / max(h, w)
    nh, nw = round(h * scale), round(w * scale)
    y = resize(x, (nh, nw), interpolation)
    if clamp:
        y = y.clamp(0.0, 1.0)
    ph, pw = size - nh, size - nw
    if ph or pw:
        y = F.pad(y, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=fill)
    return y


def squash(x: Tensor, size: tuple[int, int], interpolation: str = "bicubic", clamp: bool = True) -> Tensor:
    """Resize to exactly (h, w), ignoring the aspect ratio (open_clip resize_mode "squash")."""
    y = resize(x, size, interpolation)
    return y.clamp(0.0, 1.0) if clamp else y


def normalize(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """(x - mean) / std per channel of [B, 3, H, W]."""
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s
