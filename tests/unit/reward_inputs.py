"""Inputs of the reward tests: tiny-world prompts, smooth random images and a custom reward factory (their fixtures,
tiny_reward_spec and offline, are in tests/conftest.py)."""

from __future__ import annotations

import torch

# Tiny-world prompts (the tiny_world reward accepts only those), with repeats as in GRPO groups.
PROMPTS = [
    "a red circle on a blue background",
    "a green square on a yellow background",
    "a red circle on a blue background",
    "a cyan triangle on a magenta background",
    "a green square on a yellow background",
    "a red circle on a blue background",
]


def images(n: int = 6, h: int = 64, w: int = 64, seed: int = 0) -> torch.Tensor:
    """Smooth random images [n, 3, h, w] in [0, 1] (natural-image-like: low frequencies plus a little noise)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, h // 8 + 1, w // 8 + 1, generator=g)
    x = torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
    return (x + 0.1 * torch.rand(n, 3, h, w, generator=g)).clamp(0, 1)


def make_brightness(scale: float = 1.0):
    """A custom reward factory for the "pkg.module:factory" escape hatch: scale x mean pixel value."""

    def brightness(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return scale * images.mean(dim=(1, 2, 3))

    return brightness
