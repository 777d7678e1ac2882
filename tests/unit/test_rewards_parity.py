"""Parity with the upstream scorers (uint8 inputs, processor configs, QuickGELU of local files) and one-line errors
for broken reward files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

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


def test_open_clip_rewards_equal_open_clip_on_pil(tiny_reward_spec) -> None:
    """clip_score and the aesthetic backbone: open_clip's own loader and transform on PIL images (the reference)."""
    import open_clip

    from grpo.rewards.aesthetic import MLP_FILE, AestheticMLP

    x, prompts = images(len(PROMPTS), 64, 96, seed=1), list(PROMPTS)
    name = "local-dir:" + tiny_reward_spec["clip_score"]["pretrained"]
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    model.eval()
    mlp = AestheticMLP.from_state_dict(
        torch.load(Path(tiny_reward_spec["aesthetic"]["mlp_repo"]) / MLP_FILE, weights_only=True), "test").eval()
    with torch.no_grad():
        img = model.encode_image(torch.stack([preprocess(p) for p in _pil(x)]), normalize=True)
        txt = model.encode_text(open_clip.get_tokenizer(name)(prompts), normalize=True)
        aesthetic = mlp(img).squeeze(-1)
    rewards = build_rewards({k: tiny_reward_spec[k] for k in ("clip_score", "aesthetic")}, "cpu")(x, prompts)
    torch.testing.assert_close(rewards[:, 0], (img * txt).sum(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(rewards[:, 1], aesthetic, atol=1e-6, rtol=0)
