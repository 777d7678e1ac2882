"""Every reward loaded through its real loading code from tiny hub-like folders, scored against a reference."""

from __future__ import annotations

import io
import sys
import types
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from grpo.rewards import ModelReward, build_rewards
from grpo.rewards.hps import OPENAI_MEAN, OPENAI_STD

from tests.unit.reward_inputs import PROMPTS, images


@pytest.fixture(scope="module")
def built(tiny_reward_spec):
    """All rewards of the tiny spec, built once (float32, CPU)."""
    return build_rewards(tiny_reward_spec, "cpu")


@pytest.fixture(scope="module")
def batch():
    return images(len(PROMPTS), 64, 96, seed=1), list(PROMPTS)


def _pil(x: torch.Tensor) -> list[Image.Image]:
    u8 = (x * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a) for a in u8]


def test_interface(built, batch) -> None:
    x, prompts = batch
    comps = built(x, prompts)
    assert built.names == ["hpsv2", "pickscore", "clip_score", "aesthetic", "tiny_world", "jpeg_compressibility",
                           "jpeg_incompressibility"]
    assert comps.shape == (len(prompts), len(built.names)) and comps.dtype == torch.float32
    assert torch.isfinite(comps).all()
    for name in built.names:
        reward = built[name]
        for module in reward.modules():
            assert not module.training and not any(p.requires_grad for p in module.parameters())
        # Splitting a batch changes nothing but float rounding.
        reward.batch_size, saved = 4, reward.batch_size
        torch.testing.assert_close(reward(x, prompts), comps[:, built.names.index(name)], atol=2e-6, rtol=1e-5)
        reward.batch_size = saved
    # Images of another dtype are accepted; scores come back float32.
    assert built(x.to(torch.bfloat16), prompts).dtype == torch.float32


def test_hpsv2_matches_reference(built, batch, tiny_reward_spec) -> None:
    """HPS as hpsv2/img_score.py computes it: PIL image -> ToTensor, its transform, the model's output_dict
    features, diag(img @ txt.T); with quantize: false, the same on the float images."""
    import open_clip
    import torchvision.transforms.functional as TF

    x, prompts = batch
    spec = tiny_reward_spec["hpsv2"]
    model = open_clip.create_model(spec["model"], pretrained=None, output_dict=True).eval()
    ckpt = torch.load(Path(spec["repo"]) / "HPS_v2.1_compressed.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["state_dict"])
    tokenizer = open_clip.get_tokenizer(spec["model"])
    expected = []
    for img, prompt in zip([TF.to_tensor(p) for p in _pil(x)] + list(x), prompts + prompts):
        # hpsv2 eval transform (ToTensor first, then a tensor resize): longest side to 224, zero pad, normalise.
        h, w = img.shape[1:]
        nh, nw = round(h * 224 / max(h, w)), round(w * 224 / max(h, w))
        t = F.interpolate(img[None], size=(nh, nw), mode="bicubic", antialias=True)
        ph, pw = 224 - nh, 224 - nw
        t = F.pad(t, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        m = torch.tensor(OPENAI_MEAN).view(1, 3, 1, 1)
        s = torch.tensor(OPENAI_STD).view(1, 3, 1, 1)
        with torch.no_grad():
            out = model((t - m) / s, tokenizer([prompt]))
        expected.append(torch.diagonal(out["image_features"] @ out["text_features"].T))
    expected = torch.cat(expected)
    torch.testing.assert_close(built["hpsv2"](x, prompts), expected[: len(x)], atol=1e-6, rtol=0)
    unquantized = build_rewards({"hpsv2": {**spec, "quantize": False}}, "cpu")
    torch.testing.assert_close(unquantized(x, prompts)[:, 0], expected[len(x) :], atol=1e-5, rtol=1e-5)


def test_clip_score_matches_open_clip(built, batch, tiny_reward_spec) -> None:
    """open_clip's own loader + PIL preprocess (the reference) vs ours on tensors: uint8 rounding apart."""
    import open_clip

    x, prompts = batch
    name = "local-dir:" + tiny_reward_spec["clip_score"]["pretrained"]
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    model.eval()
    tokenizer = open_clip.get_tokenizer(name)
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(p) for p in _pil(x)]), normalize=True)
        txt = model.encode_text(tokenizer(prompts), normalize=True)
    expected = (img * txt).sum(-1)
    ours = built["clip_score"](x, prompts)
    # The tiny random CLIP is far more sensitive to pixel noise than a trained one; 1e-3 of a cosine is still
    # well below a tenth of the spread of scores between images.
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)
    assert (expected.max() - expected.min()) > 10 * (ours - expected).abs().max()
    scaled = build_rewards({"clip_score": {**tiny_reward_spec["clip_score"], "scale": 100.0}}, "cpu")
    torch.testing.assert_close(scaled(x, prompts)[:, 0], 100 * ours, atol=1e-4, rtol=1e-5)


def test_pickscore_matches_readme(built, batch, tiny_reward_spec) -> None:
    """PickScore README: processor(images), processor(text, padding, truncation, max_length=77), normalised
    embeddings; bare cosine by default, times exp(logit_scale) with logit_scale: true."""
    from transformers import CLIPModel, CLIPProcessor

    x, prompts = batch
    spec = tiny_reward_spec["pickscore"]
    processor = CLIPProcessor.from_pretrained(spec["processor"])
    model = CLIPModel.from_pretrained(spec["model"]).eval()
    image_inputs = processor(images=_pil(x), return_tensors="pt")
    text_inputs = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        out = model(**text_inputs, **image_inputs)
    cos = (out.image_embeds * out.text_embeds).sum(-1)  # CLIPModel.forward normalises both
    ours = built["pickscore"](x, prompts)
    torch.testing.assert_close(ours, cos, atol=1e-3, rtol=0)
    assert (cos.max() - cos.min()) > 10 * (ours - cos).abs().max()
    scaled = build_rewards({"pickscore": {**spec, "logit_scale": True}}, "cpu")(x, prompts)[:, 0]
    torch.testing.assert_close(scaled, ours * model.logit_scale.exp(), atol=1e-4, rtol=1e-5)


def test_aesthetic_matches_simple_inference(built, batch, tiny_reward_spec) -> None:
    """improved-aesthetic-predictor simple_inference.py: CLIP preprocess, encode_image, numpy L2 normalise, MLP."""
    import open_clip

    from grpo.rewards.aesthetic import AestheticMLP

    x, prompts = batch
    spec = tiny_reward_spec["aesthetic"]
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + spec["pretrained"])
    mlp = AestheticMLP.from_state_dict(
        torch.load(Path(spec["mlp_repo"]) / "sac+logos+ava1-l14-linearMSE.pth", weights_only=True), "test").eval()
    with torch.no_grad():
        emb = model.eval().encode_image(torch.stack([preprocess(p) for p in _pil(x)])).numpy()
        l2 = np.atleast_1d(np.linalg.norm(emb, 2, -1))
        l2[l2 == 0] = 1
        expected = mlp(torch.from_numpy(emb / l2[:, None]).float()).squeeze(-1)
    ours = built["aesthetic"](x, prompts)
    torch.testing.assert_close(ours, expected, atol=2e-3, rtol=0)
    # Prompt-free: other prompts, same scores.
    torch.testing.assert_close(built["aesthetic"](x, ["x"] * len(prompts)), ours)


def test_jpeg_matches_ddpo(built, batch) -> None:
    x, prompts = batch
    sizes = []
    for img in (x * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy().transpose(0, 2, 3, 1):
        buffer = io.BytesIO()
        Image.fromarray(img).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    sizes = torch.tensor(sizes)
    torch.testing.assert_close(built["jpeg_incompressibility"](x, prompts), sizes)
    torch.testing.assert_close(built["jpeg_compressibility"](x, prompts), -sizes)


def test_tiny_world_is_the_world_score(built) -> None:
    from grpo.tiny import world

    prompts = world.all_prompts()[:4]
    x = images(4, 64, 64, seed=3)
    torch.testing.assert_close(built["tiny_world"](x, prompts), world.score(x, prompts))


def test_dtype_option(tiny_reward_spec, batch) -> None:
    x, prompts = batch
    spec = {"hpsv2": {**tiny_reward_spec["hpsv2"], "dtype": "bfloat16"}}
    low = build_rewards(spec, "cpu")
    for module in low["hpsv2"].model.modules():
        want = torch.float32 if isinstance(module, torch.nn.LayerNorm) else torch.bfloat16
        assert all(p.dtype == want for p in module.parameters(recurse=False)), module
    full = build_rewards({"hpsv2": tiny_reward_spec["hpsv2"]}, "cpu")
    out = low(x, prompts)
    assert out.dtype == torch.float32
    # Measured on the tiny models (LayerNorms in float32): bf16 4.2e-3 (4.9e-3 with bf16 norms), fp16 1.1e-3.
    torch.testing.assert_close(out, full(x, prompts), atol=8.5e-3, rtol=0)
    half = build_rewards({"hpsv2": {**tiny_reward_spec["hpsv2"], "dtype": "float16"}}, "cpu")
    torch.testing.assert_close(half(x, prompts), full(x, prompts), atol=2.2e-3, rtol=0)


def test_offload_moves_only_offloadable_models(tiny_reward_spec, monkeypatch) -> None:
    """on_device() loads models built with offload: true and offloads them afterwards; others stay put.

    A CPU-only machine has no second device, so the moves are recorded instead of made.
    """
    moves: list[tuple[str, str]] = []
    monkeypatch.setattr(ModelReward, "_move", lambda self, device: (moves.append((self.name, str(device))),
                                                                     setattr(self, "_where", device)))
    spec = {
        "hpsv2": {**tiny_reward_spec["hpsv2"], "offload": True},
        "clip_score": tiny_reward_spec["clip_score"],
        "clip_score@cpu": {**tiny_reward_spec["clip_score"], "device": "cpu", "offload": True},
    }
    rewards = build_rewards(spec, "meta")  # "meta" stands in for the accelerator; nothing is moved there
    assert rewards["hpsv2"].device.type == "cpu"  # offloadable: starts on the CPU
    assert rewards["clip_score"].device.type == "meta" and rewards["clip_score@cpu"].device.type == "cpu"
    with rewards.on_device():
        assert rewards["hpsv2"].device.type == "meta"
    assert rewards["hpsv2"].device.type == "cpu"
    assert moves == [("hpsv2", "meta"), ("hpsv2", "cpu")]


def test_refuses_zero_init_and_hides_hf_zero3(tiny_reward_spec, monkeypatch) -> None:
    fake = types.ModuleType("deepspeed.runtime.zero.partition_parameters")
    fake.zero_init_context = 1
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero.partition_parameters", fake)
    with pytest.raises(RuntimeError, match="inside deepspeed.zero.Init"):
        build_rewards({"jpeg_compressibility": 1.0}, "cpu")
    fake.zero_init_context = 0

    from transformers.integrations import deepspeed as hf_ds

    class Zero3:
        def is_zero3(self) -> bool:
            return True

    cfg = Zero3()
    monkeypatch.setattr(hf_ds, "_hf_deepspeed_config_weak_ref", weakref.ref(cfg))
    rewards = build_rewards({"pickscore": tiny_reward_spec["pickscore"]}, "cpu")
    assert not any(hasattr(p, "ds_id") for p in rewards["pickscore"].model.parameters())
    assert hf_ds.is_deepspeed_zero3_enabled()  # restored after loading
