"""Parity of the imagereward and hpsv3 rewards with their packages' own scoring code (image-reward 1.5, hpsv3 1.0.0:
requirements-test.txt), with identical random weights at tiny sizes, in float32: each package's top-level scoring
call (ImageReward.score, HPSv3RewardInferencer.reward) on the PIL images against build_rewards on the tensors."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from grpo.errors import ConfigError
from grpo.rewards import build_rewards
from grpo.rewards.tiny_models import write_tiny_hpsv3, write_tiny_imagereward

from tests.unit.reward_inputs import PROMPTS, images
from tests.unit.test_rewards_parity import _pil


@pytest.fixture(scope="module")
def tiny_imagereward(tmp_path_factory) -> dict:
    return write_tiny_imagereward(tmp_path_factory.mktemp("imagereward"))


@pytest.fixture(scope="module")
def tiny_hpsv3(tmp_path_factory) -> dict:
    return write_tiny_hpsv3(tmp_path_factory.mktemp("hpsv3"))


def test_imagereward_equals_the_package(tiny_imagereward, image_reward_package, monkeypatch) -> None:
    """ImageReward(med_config).load_state_dict(ImageReward.pt) then score(prompt, PIL image) per image, as
    ImageReward.load() does; only the sizes differ: its ViT-L (hard-coded in BLIP_Pretrain) built at the tiny
    checkpoint's size with the package's own VisionTransformer, and bert-base-uncased's tokenizer read from the
    tiny vocabulary (the package's init_tokenizer adds [DEC] and [ENC] to it as upstream)."""
    pkg, spec = image_reward_package, tiny_imagereward
    from transformers import BertTokenizer

    class LocalBert(BertTokenizer):
        # transformers 4's attribute, read by init_tokenizer for the one extra token it adds
        additional_special_tokens_ids = property(lambda self: self.convert_tokens_to_ids(["[ENC]"]))

        @classmethod
        def from_pretrained(cls, name, *args, **kwargs):
            assert name == "bert-base-uncased"
            return super().from_pretrained(spec["tokenizer"])

    def tiny_vit(vit, image_size, *args):
        assert (vit, image_size) == ("large", 224)
        return pkg.vit.VisionTransformer(img_size=image_size, patch_size=32, embed_dim=64, depth=1, num_heads=1), 64

    monkeypatch.setattr(pkg.blip, "BertTokenizer", LocalBert)
    monkeypatch.setattr(pkg.blip_pretrain, "create_vit", tiny_vit)
    model = pkg.ImageReward.ImageReward(med_config=str(Path(spec["repo"]) / "med_config.json"), device="cpu")
    state = torch.load(Path(spec["repo"]) / "ImageReward.pt", map_location="cpu")
    model.load_state_dict(state, strict=True)  # the tiny file is complete for the package (upstream: strict=False)
    model.eval()

    rewards = build_rewards({"imagereward": spec, "imagereward@float": {**spec, "quantize": False}}, "cpu")
    for h, w, seed in ((64, 96, 1), (300, 256, 2)):  # landscape and portrait; upsampled and downsampled to 224
        x, prompts = images(3, h, w, seed=seed), list(PROMPTS[:3])
        with torch.no_grad():
            expected = torch.tensor([model.score(p, image) for p, image in zip(prompts, _pil(x))])
        ours = rewards(x, prompts)
        torch.testing.assert_close(ours[:, 0], expected, atol=1e-5, rtol=0)
        # The image matters: the same prompt on two images scores apart far beyond the tolerance.
        assert abs(expected[0] - expected[2]) > 1e-3
        # quantize: false, our tensor transform on the float decode: close to the PIL path, not equal.
        torch.testing.assert_close(ours[:, 1], expected, atol=0.05, rtol=0)


def test_imagereward_rejects_a_foreign_checkpoint(tiny_imagereward, tmp_path) -> None:
    folder = tmp_path / "ImageReward"
    folder.mkdir()
    (folder / "med_config.json").write_text((Path(tiny_imagereward["repo"]) / "med_config.json").read_text())
    torch.save({"visual.weight": torch.zeros(2)}, folder / "ImageReward.pt")
    with pytest.raises(ConfigError, match=r"^rewards\.imagereward\.repo: not an ImageReward checkpoint"):
        build_rewards({"imagereward": {**tiny_imagereward, "repo": str(folder)}}, "cpu")


class _Transformers4Layout:
    """Qwen2VLRewardModelBT as its forward expects it (transformers 4.45): `self.model` the decoder with its
    embed_tokens, `self.visual` returning the merged image tokens, config fields at the top level. Built of the
    package model's own transformers 5 modules, so its forward runs unchanged."""

    def __init__(self, model: nn.Module) -> None:
        visual = model.model.visual
        self.config = types.SimpleNamespace(output_attentions=False, output_hidden_states=False,
                                            use_return_dict=True, pad_token_id=model.config.pad_token_id,
                                            image_token_id=model.config.image_token_id,
                                            video_token_id=model.config.video_token_id)
        self.model = model.model.language_model
        self.visual = _Visual(visual)
        self.rm_head, self.reward_token, self.special_token_ids = (model.rm_head, model.reward_token,
                                                                   model.special_token_ids)
        self._forward = type(model).forward

    def __call__(self, mm_token_type_ids=None, **inputs):  # a batch key transformers 5's processor adds
        return self._forward(self, **inputs)


class _Visual:
    def __init__(self, visual: nn.Module) -> None:
        self.visual = visual

    def get_dtype(self) -> torch.dtype:
        return self.visual.dtype

    def __call__(self, pixel_values, grid_thw):
        return self.visual(pixel_values, grid_thw=grid_thw).pooler_output


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")  # its autocast("cuda") around rm_head
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # its decoder call's arguments
def test_hpsv3_equals_the_package(tiny_hpsv3, hpsv3_package) -> None:
    """HPSv3RewardInferencer.reward(PIL images, prompts)[:, 0] (mu) with the model and processor its constructor
    builds (train.py create_model_and_processor with HPSv3_7B.yaml: <|Reward|> added, Qwen2VLRewardModelBT with
    output_dim 2, reward_token "special", rm_head_type "ranknet", embeddings resized, the checkpoint loaded
    strictly), at the tiny size in float32. Its forward is the package's, run on its transformers 4 layout
    (_Transformers4Layout), since HPSv3 pins transformers 4.45."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoProcessor

    from grpo.rewards.hpsv3 import PROMPT, to_v4_layout

    pkg, spec = hpsv3_package, tiny_hpsv3
    assert PROMPT == pkg.INSTRUCTION + pkg.prompt_with_special_token
    processor = AutoProcessor.from_pretrained(spec["base"], padding_side="right")
    processor.tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    special_token_ids = processor.tokenizer.convert_tokens_to_ids(["<|Reward|>"])
    config = AutoConfig.from_pretrained(spec["base"])
    config.hidden_size = config.text_config.hidden_size  # transformers 4.45's Qwen2VLConfig was flat
    model = pkg.Qwen2VLRewardModelBT(config, output_dim=2, reward_token="special",
                                     special_token_ids=special_token_ids, rm_head_type="ranknet", rm_head_kwargs=None)
    model.resize_token_embeddings(len(processor.tokenizer))
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    v4 = load_file(str(Path(spec["repo"]) / "HPSv3.safetensors"))
    v5 = {to_v4_layout({k: None}).popitem()[0]: k for k in model.state_dict()}  # 4.x name -> this model's name
    assert sorted(v5) == sorted(v4)
    model.load_state_dict({v5[k]: v for k, v in v4.items()}, strict=True)
    model.eval()
    inferencer = object.__new__(pkg.HPSv3RewardInferencer)
    inferencer.model, inferencer.processor, inferencer.device = _Transformers4Layout(model), processor, "cpu"
    inferencer.use_special_tokens = True

    reward = build_rewards({"hpsv3": spec}, "cpu")["hpsv3"]
    x, prompts = images(3, 96, 64, seed=3), [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    with torch.no_grad():
        expected = inferencer.reward(_pil(x), prompts)[:, 0]
    torch.testing.assert_close(reward(x, prompts), expected, atol=1e-5, rtol=0)
    assert abs(expected[0] - expected[2]) > 1e-3  # same prompt, another image


def test_hpsv3_served_remotely_scores_as_in_process(tiny_hpsv3) -> None:
    """docs/operations.md's recipe for a separate reward GPU: `python -m tools.rewards serve` holding hpsv3, the
    training ranks' `remote` reward asking it (here a real server in a thread, as tests/unit/test_rewards_remote.py)."""
    from tests.unit.test_rewards_remote import serving

    x, prompts = images(2, 64, 64, seed=4), list(PROMPTS[:2])
    with serving({"hpsv3": tiny_hpsv3}) as (url, batcher):
        remote = build_rewards({"remote@hpsv3": {"url": url, "reward": "hpsv3", "retries": 1}}, "cpu")
        torch.testing.assert_close(remote(x, prompts)[:, 0], batcher.rewards(x, prompts)[:, 0], atol=1e-6, rtol=0)


def test_imagereward_checkpoint_keys(tiny_imagereward, tmp_path, caplog) -> None:
    """Keys the score does not use are ignored with a warning (the package loads with strict=False); a missing
    weight is a one-line ConfigError (the package would score with a random one)."""
    source = Path(tiny_imagereward["repo"])
    state = torch.load(source / "ImageReward.pt")
    x, prompts = images(2, 64, 64, seed=5), list(PROMPTS[:2])
    expected = build_rewards({"imagereward": tiny_imagereward}, "cpu")(x, prompts)
    for name, change in (("extra", {"blip.itm_head.weight": torch.zeros(2, 768)}), ("missing", None)):
        folder = tmp_path / name
        shutil.copytree(source, folder)
        edited = {**state, **change} if change else {k: v for k, v in state.items() if "layer_norm" not in k
                                                      and "norm1" not in k}
        torch.save(edited, folder / "ImageReward.pt")
        spec = {"imagereward": {**tiny_imagereward, "repo": str(folder)}}
        if change:
            with caplog.at_level("WARNING", logger="grpo.rewards.imagereward"):
                torch.testing.assert_close(build_rewards(spec, "cpu")(x, prompts), expected, atol=0, rtol=0)
            assert "1 checkpoint keys the score does not use were ignored (blip.itm_head.weight" in caplog.text
        else:
            with pytest.raises(ConfigError, match=r"^rewards\.imagereward\.repo: .* does not fit med_config.json "
                                                  r"and BLIP's ViT \(KeyError: .*missing") as err:
                build_rewards(spec, "cpu")
            assert "\n" not in str(err.value)
