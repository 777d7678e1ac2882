"""Tensor preprocessing of the rewards against each project's reference preprocessing.

References: HPS v2's eval transform (the hpsv2 1.2.0 package's own, requirements-test.txt), open_clip's
`image_transform_v2`, transformers' CLIPImageProcessor (torchvision backend) and CLIPImageProcessorPil (PickScore's processor).
On tensors the references and ours run the same antialiased resize, so they agree to float rounding. On PIL images
the references round to uint8 after each resize pass; that is the whole difference (see the two-pass test).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from grpo.rewards.hps import OPENAI_MEAN, OPENAI_STD
from grpo.rewards.openclip_loader import clip_preprocess
from grpo.rewards.preprocess import normalize, resize_longest_pad, resize_shortest_center_crop
from tests.unit.reward_inputs import images

SIZES = [(64, 64), (64, 96), (97, 64), (300, 224), (720, 1280)]


def _uint8_image(h: int, w: int, seed: int) -> tuple[Image.Image, torch.Tensor]:
    u8 = (images(1, h, w, seed)[0] * 255).round().to(torch.uint8)
    return Image.fromarray(u8.permute(1, 2, 0).numpy()), (u8.float() / 255)[None]


@pytest.mark.parametrize("mode", ["shortest", "squash"])
def test_open_clip_on_tensors_exact(mode: str) -> None:
    from open_clip.transform import PreprocessCfg, image_transform_v2

    # Identity normalisation, so that the clamp PIL applies (and we apply) can be added to the reference.
    cfg = PreprocessCfg(size=224, resize_mode=mode, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    ref_t = image_transform_v2(cfg, is_train=False)  # open_clip's transforms also take [3, H, W] float tensors
    for h, w in SIZES[:4]:
        _, x = _uint8_image(h, w, seed=h * w)
        ours = clip_preprocess(x, {"size": 224, "mean": cfg.mean, "std": cfg.std, "interpolation": "bicubic",
                                   "resize_mode": mode, "fill_color": 0})
        torch.testing.assert_close(ours[0], ref_t(x[0].clone()).clamp(0, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["shortest", "longest", "squash"])
def test_open_clip_on_pil_within_uint8_rounding(mode: str) -> None:
    from open_clip.transform import PreprocessCfg, image_transform_v2

    cfg = PreprocessCfg(size=224, resize_mode=mode)
    ref_t = image_transform_v2(cfg, is_train=False)
    for h, w in SIZES:
        pil, x = _uint8_image(h, w, seed=h - w)
        ours = clip_preprocess(x, {"size": 224, "mean": cfg.mean, "std": cfg.std, "interpolation": "bicubic",
                                   "resize_mode": mode, "fill_color": 0})
        diff = (ours[0] - ref_t(pil)).abs()
        # Normalised units (1 grey level = 1/255/0.27 = 0.0145). Measured: mean <= 0.005, max <= 0.057.
        assert diff.mean() < 0.008 and diff.max() < 0.08, (h, w, diff.mean(), diff.max())


def test_clip_image_processors_within_uint8_rounding() -> None:
    from transformers import CLIPImageProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    kwargs = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}, "resample": 3}
    for cls in (CLIPImageProcessorPil, CLIPImageProcessor):
        ip = cls(**kwargs)
        for h, w in SIZES + [(64, 97)]:  # 64x97 -> 224x339: an odd crop margin, split floor-wise by transformers
            pil, x = _uint8_image(h, w, seed=3 * h + w)
            ref = ip(images=[pil], return_tensors="pt")["pixel_values"]
            ours = normalize(resize_shortest_center_crop(x, 224, (224, 224), "bicubic", crop_rounding="floor"),
                             ip.image_mean, ip.image_std)
            diff = (ours - ref).abs()
            assert diff.mean() < 0.008 and diff.max() < 0.08, (cls.__name__, h, w, diff.mean(), diff.max())


def test_difference_to_pil_is_uint8_rounding() -> None:
    """Rounding our resize to uint8 after each of PIL's two passes (width, then height) reproduces PIL.

    What is left is PIL's fixed-point filter arithmetic: at most 2 grey levels on < 2% of the pixels.
    """
    for h, w in [(64, 96), (720, 1280)]:
        pil, x = _uint8_image(h, w, seed=7)
        nh, nw = 224, int(224 * w / h)
        ref = torch.from_numpy(np.array(pil.resize((nw, nh), Image.BICUBIC))).permute(2, 0, 1).float() / 255
        plain = F.interpolate(x, size=(nh, nw), mode="bicubic", antialias=True).clamp(0, 1)[0]
        y = F.interpolate(x, size=(h, nw), mode="bicubic", antialias=True)
        y = (y * 255).round().clamp(0, 255) / 255
        y = (F.interpolate(y, size=(nh, nw), mode="bicubic", antialias=True) * 255).round().clamp(0, 255)[0] / 255
        diff = (y - ref).abs()
        assert diff.max() <= 2 / 255 + 1e-6 and (diff > 0).float().mean() < 0.02
        assert diff.mean() * 10 < (plain - ref).abs().mean()


def test_hps_matches_hpsv2_package(hpsv2_open_clip) -> None:
    """The hpsv2 package's own eval transform (image_transform as its create_model_and_transforms builds it)."""
    transform = hpsv2_open_clip.image_transform(224, is_train=False, resize_longest_max=True)
    for h, w in SIZES:
        pil, x = _uint8_image(h, w, seed=h + 2 * w)
        ours = normalize(resize_longest_pad(x, 224, "bicubic", 0.0, clamp=False), OPENAI_MEAN, OPENAI_STD)
        torch.testing.assert_close(ours[0], transform(pil), atol=1e-6, rtol=0)
