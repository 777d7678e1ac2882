"""Shared fixtures of the reward tests: tiny reward files laid out like the hub repos, built once per session.

Import the fixtures into a test module (`from reward_fixtures import tiny_reward_spec, offline  # noqa: F401`).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

# No test touches a hub: set before huggingface_hub is imported by anything.
os.environ["HF_HUB_OFFLINE"] = "1"

# Tiny-world prompts (the tiny_world reward accepts only those), with repeats as in GRPO groups.
PROMPTS = [
    "a red circle on a blue background",
    "a green square on a yellow background",
    "a red circle on a blue background",
    "a cyan triangle on a magenta background",
    "a green square on a yellow background",
    "a red circle on a blue background",
]


@pytest.fixture(scope="session")
def tiny_reward_spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """{reward name: options} pointing at tiny random-weight files (see grpo.rewards.tiny_models)."""
    from grpo.rewards.tiny_models import write_tiny_reward_files

    return write_tiny_reward_files(tmp_path_factory.mktemp("tiny_rewards"))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1 for one test (restored afterwards)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


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
