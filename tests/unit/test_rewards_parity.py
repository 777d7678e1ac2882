"""Parity with the upstream scorers' own code, with identical random weights at tiny sizes, at 1e-6 in float32: HPS
against the hpsv2 package (requirements-test.txt), PickScore against transformers' CLIPModel + CLIPProcessor on PIL
images, the aesthetic score against the LAION predictor's MLP and normalisation + open_clip's transform, CLIP score
against open_clip's loader and transform. Also: QuickGELU of local files, processor configs, one-line errors for
broken reward files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from grpo.errors import ConfigError
from grpo.rewards import build_rewards
from grpo.rewards.openclip_loader import plan_open_clip

from tests.unit.reward_inputs import PROMPTS, images


def _pil(x: torch.Tensor) -> list[Image.Image]:
    u8 = (x * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a) for a in u8]


# -- defect 1: a local checkpoint file gets its tag's QuickGELU and preprocessing ------------------------------------
def test_local_file_gets_the_settings_of_its_tag(tmp_path) -> None:
    openai = tmp_path / "ViT-L-14.pt"  # the file name of the openai tag's download
    openai.touch()
    plan = plan_open_clip("ViT-L-14", str(openai), "rewards.aesthetic")
    assert plan.quick_gelu and plan.preprocess["resize_mode"] == "shortest"
    dfn = tmp_path / "open_clip_pytorch_model.bin"  # ViT-H-14-378 has one tag (dfn5b): QuickGELU, squash
    dfn.touch()
    plan = plan_open_clip("ViT-H-14-378", str(dfn), "rewards.clip_score")
    assert plan.quick_gelu and plan.preprocess["resize_mode"] == "squash"
    # ViT-L-14 tags disagree (openai: QuickGELU; laion2b_s32b_b82k: GELU, mean 0.5): the file's tag must be named.
    other = tmp_path / "weights.pt"
    other.touch()
    with pytest.raises(ConfigError, match=r"rewards\.aesthetic\.pretrained_tag") as err:
        plan_open_clip("ViT-L-14", str(other), "rewards.aesthetic")
    assert "\n" not in str(err.value)
    plan = plan_open_clip("ViT-L-14", str(other), "rewards.aesthetic", pretrained_tag="laion2b_s32b_b82k")
    assert not plan.quick_gelu and plan.preprocess["mean"] == (0.5, 0.5, 0.5)
    assert plan_open_clip("ViT-H-14-378", str(dfn), "rewards.clip_score", quick_gelu=False).quick_gelu is False


def test_local_file_quick_gelu_reaches_the_model(tmp_path) -> None:
    import open_clip

    spec = {"model": "ViT-B-32", "pretrained": str(tmp_path / "ViT-B-32.pt")}
    torch.save(open_clip.create_model("ViT-B-32", pretrained=None, force_quick_gelu=True).state_dict(),
               spec["pretrained"])
    reward = build_rewards({"clip_score": spec}, "cpu")["clip_score"]  # ViT-B-32.pt: the openai tag's file
    acts = [type(m).__name__ for m in reward.model.modules()]
    assert "QuickGELU" in acts


# -- defect 2: uint8 quantisation reproduces the PIL pipelines --------------------------------------------------------
def test_pickscore_equals_clip_processor_on_pil(tiny_reward_spec) -> None:
    from transformers import CLIPModel, CLIPProcessor

    spec = tiny_reward_spec["pickscore"]
    x, prompts = images(len(PROMPTS), 64, 97, seed=5), list(PROMPTS)
    processor = CLIPProcessor.from_pretrained(spec["processor"])
    model = CLIPModel.from_pretrained(spec["model"]).eval()
    with torch.no_grad():
        out = model(**processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt"),
                    **processor(images=_pil(x), return_tensors="pt"))
    expected = (out.image_embeds * out.text_embeds).sum(-1)
    torch.testing.assert_close(build_rewards({"pickscore": spec}, "cpu")(x, prompts)[:, 0], expected,
                               atol=1e-6, rtol=0)
    off = build_rewards({"pickscore": {**spec, "quantize": False}}, "cpu")(x, prompts)[:, 0]
    assert (off - expected).abs().max() > 1e-6  # the float decode is a different input
    # The README's score: logit_scale.exp() * cosine.
    scaled = build_rewards({"pickscore": {**spec, "logit_scale": True}}, "cpu")(x, prompts)[:, 0]
    torch.testing.assert_close(scaled, model.logit_scale.exp() * expected, atol=1e-6 * model.logit_scale.exp().item(),
                               rtol=0)


def test_quantize_option_rounds_inputs_of_model_rewards_only(tiny_reward_spec) -> None:
    x = images(2, 32, 32, seed=2)
    rewards = build_rewards({"clip_score": tiny_reward_spec["clip_score"], "tiny_world": 1.0}, "cpu")
    u8 = (x * 255).round().clamp(0, 255).to(torch.uint8).float() / 255
    assert torch.equal(rewards["clip_score"].prepare(x), u8)
    assert torch.equal(rewards["tiny_world"].prepare(x), x)
    off = build_rewards({"clip_score": {**tiny_reward_spec["clip_score"], "quantize": False}}, "cpu")
    assert torch.equal(off["clip_score"].prepare(x), x)


# -- defect 6: every field of the processor config --------------------------------------------------------------------
def test_pickscore_honours_a_non_default_processor_config(tiny_reward_spec, tmp_path) -> None:
    from transformers import CLIPModel, CLIPProcessor

    spec = tiny_reward_spec["pickscore"]
    proc = tmp_path / "processor"
    shutil.copytree(spec["processor"], proc)
    cfg = json.loads((proc / "preprocessor_config.json").read_text())
    cfg.update({"resample": 2, "size": {"height": 240, "width": 256}, "crop_size": {"height": 224, "width": 224},
                "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3], "do_center_crop": True})
    (proc / "preprocessor_config.json").write_text(json.dumps(cfg))
    x, prompts = images(3, 70, 50, seed=9), list(PROMPTS[:3])
    processor = CLIPProcessor.from_pretrained(proc)
    model = CLIPModel.from_pretrained(spec["model"]).eval()
    with torch.no_grad():
        out = model(**processor(text=prompts, padding=True, return_tensors="pt"),
                    **processor(images=_pil(x), return_tensors="pt"))
    expected = (out.image_embeds * out.text_embeds).sum(-1)
    ours = build_rewards({"pickscore": {**spec, "processor": str(proc)}}, "cpu")(x, prompts)[:, 0]
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)


# -- defects 4 and 5: broken files are one-line ConfigErrors ----------------------------------------------------------
def _copy_spec(spec: dict, key: str, tmp_path: Path) -> tuple[dict, Path]:
    folder = tmp_path / key
    shutil.copytree(spec[key], folder)
    return {**spec, key: str(folder)}, folder


@pytest.mark.parametrize("payload", [b"not a checkpoint at all", b"\x80\x04\x95"])
def test_unreadable_checkpoints(tiny_reward_spec, tmp_path, payload) -> None:
    hps, folder = _copy_spec(tiny_reward_spec["hpsv2"], "repo", tmp_path)
    (folder / "HPS_v2.1_compressed.pt").write_bytes(payload)
    clip, cfolder = _copy_spec(tiny_reward_spec["clip_score"], "pretrained", tmp_path)
    (cfolder / "open_clip_model.safetensors").write_bytes(payload)
    aes, afolder = _copy_spec(tiny_reward_spec["aesthetic"], "mlp_repo", tmp_path)
    (afolder / "sac+logos+ava1-l14-linearMSE.pth").write_bytes(payload)
    for name, spec, option, file in [("hpsv2", hps, "repo", "HPS_v2.1_compressed.pt"),
                                     ("clip_score", clip, "pretrained", "open_clip_model.safetensors"),
                                     ("aesthetic", aes, "mlp_filename", "sac+logos+ava1-l14-linearMSE.pth")]:
        with pytest.raises(ConfigError) as err:
            build_rewards({name: spec}, "cpu")
        msg = str(err.value)
        assert msg.startswith(f"rewards.{name}.{option}: ") and file in msg and "\n" not in msg, msg


def test_unsafe_pickle_is_a_config_error(tiny_reward_spec, tmp_path) -> None:
    hps, folder = _copy_spec(tiny_reward_spec["hpsv2"], "repo", tmp_path)
    torch.save({"state_dict": {}, "evil": Path("x")}, folder / "HPS_v2.1_compressed.pt")  # weights_only refuses
    with pytest.raises(ConfigError, match=r"^rewards\.hpsv2\.repo: cannot read checkpoint .*UnpicklingError"):
        build_rewards({"hpsv2": hps}, "cpu")


@pytest.mark.parametrize("change", ["drop", "extra"])
def test_pickscore_loads_strictly(tiny_reward_spec, tmp_path, change) -> None:
    from safetensors.torch import load_file, save_file

    spec, folder = _copy_spec(tiny_reward_spec["pickscore"], "model", tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    if change == "drop":
        state.pop("visual_projection.weight")
    else:
        state["text_model.extra_head.weight"] = torch.zeros(2)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"^rewards\.pickscore\.model: .* is not a complete CLIPModel") as err:
        build_rewards({"pickscore": spec}, "cpu")
    assert "\n" not in str(err.value)


def test_clip_score_equals_open_clip_on_pil(tiny_reward_spec) -> None:
    """open_clip's own loader, transform (on PIL images) and tokenizer; CLIP score = cosine of the normalised
    embeddings (DanceGRPO), times `scale` (100: torchmetrics' CLIPScore before its clamp at 0)."""
    import open_clip

    x, prompts = images(len(PROMPTS), 64, 96, seed=1), list(PROMPTS)
    name = "local-dir:" + tiny_reward_spec["clip_score"]["pretrained"]
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    with torch.no_grad():
        img = model.eval().encode_image(torch.stack([preprocess(p) for p in _pil(x)]), normalize=True)
        txt = model.encode_text(open_clip.get_tokenizer(name)(prompts), normalize=True)
    cosine = (img * txt).sum(-1)
    ours = build_rewards({"clip_score": tiny_reward_spec["clip_score"]}, "cpu")(x, prompts)[:, 0]
    torch.testing.assert_close(ours, cosine, atol=1e-6, rtol=0)
    scaled = build_rewards({"clip_score": {**tiny_reward_spec["clip_score"], "scale": 100.0}}, "cpu")(x, prompts)
    torch.testing.assert_close(scaled[:, 0], 100 * cosine, atol=1e-4, rtol=0)


class LaionMLP(nn.Module):
    """The MLP of improved-aesthetic-predictor's simple_inference.py (a pl.LightningModule there), layers verbatim."""

    def __init__(self, input_size: int) -> None:
        super().__init__()
        self.input_size = input_size
        self.layers = nn.Sequential(
            nn.Linear(self.input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def laion_normalized(a: np.ndarray, axis: int = -1, order: int = 2) -> np.ndarray:
    """simple_inference.py's `normalized` (numpy L2 normalisation, zero vectors left alone)."""
    l2 = np.atleast_1d(np.linalg.norm(a, order, axis))
    l2[l2 == 0] = 1
    return a / np.expand_dims(l2, axis)


def test_aesthetic_equals_the_laion_predictor(tiny_reward_spec, tmp_path) -> None:
    """simple_inference.py: the CLIP transform on the PIL image, encode_image, numpy-normalise, MLP; its MLP with
    random weights on the tiny CLIP's 16-d embeddings, loaded by the reward from its .pth state dict."""
    import open_clip

    from grpo.rewards.aesthetic import MLP_FILE

    torch.manual_seed(7)
    head = LaionMLP(16).eval()
    (tmp_path / "mlp").mkdir()
    torch.save(head.state_dict(), tmp_path / "mlp" / MLP_FILE)
    spec = {**tiny_reward_spec["aesthetic"], "mlp_repo": str(tmp_path / "mlp")}
    x, prompts = images(len(PROMPTS), 64, 96, seed=1), list(PROMPTS)
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + spec["pretrained"])
    with torch.no_grad():
        features = model.eval().encode_image(torch.stack([preprocess(p) for p in _pil(x)]))
        expected = head(torch.from_numpy(laion_normalized(features.numpy())).float()).squeeze(-1)
    reward = build_rewards({"aesthetic": spec}, "cpu")["aesthetic"]
    torch.testing.assert_close(reward(x, prompts), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(reward(x, ["x"] * len(x)), expected, atol=1e-6, rtol=0)  # prompt-free


def test_hps_equals_the_hpsv2_package(tiny_reward_spec, hpsv2_open_clip) -> None:
    """hpsv2/img_score.py score(): create_model_and_transforms with its arguments, the checkpoint's state_dict, its
    preprocess_val on the PIL image, its tokenizer, diag(image_features @ text_features.T). Only the architecture
    differs: the tiny config for ViT-H-14, built without the LAION weights that the HPS state dict overwrites (its
    autocast is a no-op without CUDA). With quantize: false, its transform after ToTensor on the float images."""
    from torchvision.transforms import Compose, ToTensor

    oc, spec = hpsv2_open_clip, tiny_reward_spec["hpsv2"]
    oc.add_model_config(spec["model_config"])
    model, _, preprocess_val = oc.create_model_and_transforms(
        spec["model"], None, precision="amp", device="cpu", jit=False, force_quick_gelu=False,
        force_custom_text=False, force_patch_dropout=False, force_image_size=None, pretrained_image=False,
        image_mean=None, image_std=None, light_augmentation=True, aug_cfg={}, output_dict=True,
        with_score_predictor=False, with_region_predictor=False)
    checkpoint = torch.load(Path(spec["repo"]) / "HPS_v2.1_compressed.pt", map_location="cpu")
    model.load_state_dict(checkpoint["state_dict"])
    model.eval()
    tokenizer = oc.get_tokenizer(spec["model"])
    stages = preprocess_val.transforms
    after_to_tensor = Compose(stages[[isinstance(t, ToTensor) for t in stages].index(True) + 1 :])

    def hpsv2_score(image: torch.Tensor, prompt: str) -> torch.Tensor:
        with torch.no_grad():
            outputs = model(image.unsqueeze(0), tokenizer([prompt]))
            return torch.diagonal(outputs["image_features"] @ outputs["text_features"].T)[0]

    rewards = build_rewards({"hpsv2": spec, "hpsv2@float": {**spec, "quantize": False}}, "cpu")
    for h, w, seed in ((64, 96, 1), (97, 64, 2)):  # landscape and portrait: padded on either axis
        x, prompts = images(3, h, w, seed=seed), list(PROMPTS[:3])  # one forward per image upstream: keep it short
        expected = torch.stack([hpsv2_score(preprocess_val(p), t) for p, t in zip(_pil(x), prompts)])
        unquantized = torch.stack([hpsv2_score(after_to_tensor(i), t) for i, t in zip(x, prompts)])
        ours = rewards(x, prompts)
        torch.testing.assert_close(ours[:, 0], expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(ours[:, 1], unquantized, atol=1e-6, rtol=0)
