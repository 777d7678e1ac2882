"""HPSv3 (MizzenAI/HPSv3, "Towards Wide-Spectrum Human Preference Score", MIT): Qwen2-VL-7B-Instruct fine-tuned as a
preference model; a reward head on the hidden state of a special <|Reward|> token gives (mu, sigma) of the image's
preference score under an uncertainty-aware ranking loss. The score is mu (inference.py: "miu and sigma. we select
miu as the final output"), about -5..15 (higher = preferred).

Scoring follows the `hpsv3` package (1.0.0): hpsv3/inference.py `HPSv3RewardInferencer.prepare_batch` + `reward`,
hpsv3/model/qwen2vl_trainer.py `Qwen2VLRewardModelBT.forward`, its config HPSv3_7B.yaml:
- the user message is the image then INSTRUCTION.format(text_prompt=prompt) + "...: <|Reward|>\\n\\nEND\\n" (the
  package's dataset/data_collator_qwen.py text, copied in PROMPT below), through the processor's chat template with
  add_generation_prompt; the processor is Qwen2-VL-7B-Instruct's, with the special token <|Reward|> added (so its
  id is the tokenizer's length; the checkpoint's embeddings were resized to it);
- the image is resized as dataset/utils.py `fetch_image` with min_pixels = max_pixels = 256 * 28 * 28: Qwen2-VL's
  smart_resize to sides divisible by 28 and about 200704 pixels, PIL bicubic; then the processor (rescale, OpenAI
  CLIP mean/std, 14 px patches);
- the vision tower's merged tokens replace the <|image_pad|> embeddings; the language model runs on the embeddings
  with position_ids None, i.e. 1-D positions (the package calls the decoder directly and so never computes Qwen2-VL's
  3-D M-RoPE ids: its scores and training used 1-D ones, and so do we);
- rm_head (Linear(h, 1024), ReLU, Dropout, Linear(1024, 16), ReLU, Linear(16, 2): "ranknet" without kwargs), in
  float32, on the <|Reward|> token's state; column 0 (mu) is the score.
The package cannot be imported with this stack (transformers==4.45.2 pin, trl; its forward uses the 4.x module
layout), so the networks are transformers' Qwen2VLModel and the head an nn.Sequential, loaded from its checkpoint.

Weights: HPSv3.safetensors from the hub repo MizzenAI/HPSv3 (the whole model in the transformers 4.45 key layout,
`model.*` / `visual.*` / `lm_head.*` / `rm_head.*`; both layouts load), plus the config and processor of
Qwen/Qwen2-VL-7B-Instruct (Apache-2.0): `hf download MizzenAI/HPSv3 HPSv3.safetensors` and `hf download
Qwen/Qwen2-VL-7B-Instruct config.json preprocessor_config.json tokenizer.json tokenizer_config.json
chat_template.json`. bfloat16 by default as the package runs it (~16 GB); the head stays float32. Many users serve
it on a separate GPU instead: see docs/operations.md (the `remote` reward with `python -m tools.rewards serve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from grpo.errors import ConfigError
from grpo.rewards.base import ModelReward, to_uint8
from grpo.rewards.hub import FileRef, hub_offline, is_local, locate
from grpo.rewards.openclip_loader import first_line
from grpo.rewards.options import DTYPE_NAMES, ModelOptions
from grpo.schema import setting

__all__ = ["HPSv3Reward", "HPSv3Options", "PROMPT", "REWARD_TOKEN", "reward_head", "to_v4_layout"]

REPO = "MizzenAI/HPSv3"
CHECKPOINT = "HPSv3.safetensors"
BASE = "Qwen/Qwen2-VL-7B-Instruct"
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # inference.py prepare_batch: min_pixels = max_pixels
# hpsv3/dataset/data_collator_qwen.py: INSTRUCTION (with {text_prompt}) + prompt_with_special_token, verbatim.
PROMPT = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}



Please provide the overall ratings of this image: <|Reward|>

END
"""


def reward_head(state: dict[str, Tensor]) -> nn.Sequential:
    """Qwen2VLRewardModelBT's "ranknet" head without rm_head_kwargs, sized from its weights (keys 0, 3, 5)."""
    (a, h), (b, _), (out, _) = (state[f"{i}.weight"].shape for i in (0, 3, 5))
    head = nn.Sequential(nn.Linear(h, a), nn.ReLU(), nn.Dropout(0.05), nn.Linear(a, b), nn.ReLU(), nn.Linear(b, out))
    head.load_state_dict(state, strict=True)
    return head


def to_v4_layout(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers 5's Qwen2VLForConditionalGeneration keys -> the 4.x ones HPSv3.safetensors was saved with."""
    def rename(key: str) -> str:
        for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if key.startswith(new):
                return old + key[len(new):]
        return key

    return {rename(k): v for k, v in state.items()}


def _split(state: dict[str, Tensor], where: str) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """HPSv3.safetensors (4.x or 5.x layout) -> (Qwen2VLModel state dict, rm_head state dict); lm_head dropped."""
    model, head = {}, {}
    for key, value in state.items():
        if key.startswith("rm_head."):
            head[key.removeprefix("rm_head.")] = value
        elif key.startswith(("visual.", "model.visual.")):
            model["visual." + key.split("visual.", 1)[1]] = value
        elif key.startswith("model."):
            model["language_model." + key.removeprefix("model.").removeprefix("language_model.")] = value
        elif not key.startswith("lm_head."):
            raise ConfigError(f"{where}: unexpected key {key!r}; give {CHECKPOINT} of {REPO}")
    if not head or not model:
        raise ConfigError(f"{where}: no {'rm_head' if not head else 'model'} weights; give {CHECKPOINT} of {REPO}")
    return model, head


@dataclass(kw_only=True)
class HPSv3Options(ModelOptions):
    repo: str = setting(REPO, help="hub id or local folder holding HPSv3.safetensors")
    base: str = setting(BASE, help="hub id or local folder of Qwen2-VL-7B-Instruct's config and processor files")
    dtype: str = setting("bfloat16", choices=DTYPE_NAMES, help="weights dtype (the package runs bfloat16; the reward "
                                                               "head stays float32)")
    batch_size: int | None = setting(8, help="images scored per forward pass; bigger batches are split; null = all")


class HPSv3Reward(ModelReward):
    """HPSv3 preference score (mu) of each image against its prompt."""

    DESCRIPTION = "HPSv3: Qwen2-VL-7B preference model (MizzenAI/HPSv3), mu of its (mu, sigma) head; about -5..15"
    OPTIONS = HPSv3Options

    @classmethod
    def files(cls, options: dict[str, Any], setting: str) -> list[FileRef]:
        return [FileRef(f"{setting}.repo", options["repo"], (CHECKPOINT,), hub_hint=REPO),
                FileRef(f"{setting}.base", options["base"], ("config.json",), hub_hint=BASE),
                FileRef(f"{setting}.base", options["base"], ("preprocessor_config.json", "processor_config.json"),
                        hub_hint=BASE),
                FileRef(f"{setting}.base", options["base"], ("tokenizer.json", "vocab.json"), hub_hint=BASE)]

    def __init__(self, name: str, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(name, device, options)
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoProcessor, Qwen2VLModel

        where = f"rewards.{name}"
        checkpoint = locate(self.files(options, where)[0], self.cache_dir, download=True)
        base = options["base"]
        local = {"cache_dir": self.cache_dir, "local_files_only": is_local(base) or hub_offline()}
        try:
            state = load_file(str(checkpoint))
            self.processor = AutoProcessor.from_pretrained(base, padding_side="right", **local)
            config = AutoConfig.from_pretrained(base, **local)
        except Exception as err:  # safetensors errors, OSError, bad JSON, ...
            raise ConfigError(f"{where}: cannot read {checkpoint} or the processor/config of {base} "
                              f"({first_line(err)})") from err
        weights, head = _split(state, f"{where}.repo")
        # train.py create_model_and_processor: <|Reward|> added as a special token, embeddings resized to the
        # tokenizer's length; the checkpoint's embedding rows must be exactly that.
        tokenizer = self.processor.tokenizer
        tokenizer.add_tokens([REWARD_TOKEN], special_tokens=True)
        self.reward_id = tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        rows = weights["language_model.embed_tokens.weight"].shape[0]
        if rows != len(tokenizer):
            raise ConfigError(f"{where}.repo: the checkpoint's embeddings have {rows} rows, the tokenizer of {base} "
                              f"plus {REWARD_TOKEN} has {len(tokenizer)}; give the base model HPSv3 was trained on")
        config.text_config.vocab_size = rows
        try:
            # Loaded in the scoring dtype: a float32 copy of the 8 B parameters would need 33 GB of host memory.
            self.model = Qwen2VLModel.from_pretrained(None, config=config, state_dict=weights, dtype=self.dtype)
            self.head = reward_head(head)
        except Exception as err:  # shape mismatches
            raise ConfigError(f"{where}.repo: {checkpoint} does not fit the config of {base} "
                              f"({first_line(err)})") from err
        self.image_token_id = config.image_token_id
        self.place()
        self.head.float()  # Qwen2VLRewardModelBT: self.rm_head.to(torch.float32), autocast float32 around it

    def modules(self) -> list[nn.Module]:
        return [self.model, self.head]

    def _images(self, images: Tensor) -> list[Any]:
        """fetch_image's resize on the uint8 PIL images (quantize), or the float decode resized as its tensor branch
        does (torchvision bicubic, antialias) when quantize is false."""
        from PIL import Image
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.functional import resize
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        h, w = smart_resize(images.shape[-2], images.shape[-1], factor=28, min_pixels=PIXELS, max_pixels=PIXELS)
        if not self.quantize:
            return list(resize(images.float(), [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True))
        u8 = to_uint8(images).permute(0, 2, 3, 1).cpu().numpy()
        return [Image.fromarray(a).resize((w, h), Image.BICUBIC) for a in u8]

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        device = images.device
        messages = [[{"role": "user", "content": [{"type": "image"},
                                                  {"type": "text", "text": PROMPT.format(text_prompt=p)}]}]
                    for p in prompts]
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        kwargs = {} if self.quantize else {"images_kwargs": {"do_rescale": False}}
        batch = self.processor(text=text, images=self._images(images), padding=True, return_tensors="pt",
                               **kwargs).to(device)
        ids = batch["input_ids"]
        embeds = self.model.get_input_embeddings()(ids)
        pixels = batch["pixel_values"].to(self.dtype)
        image_embeds = self.model.visual(pixels, grid_thw=batch["image_grid_thw"]).pooler_output
        embeds = embeds.masked_scatter((ids == self.image_token_id)[..., None], image_embeds.to(embeds.dtype))
        hidden = self.model.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"],
                                           use_cache=False).last_hidden_state
        at_reward = ids == self.reward_id
        if not bool((at_reward.sum(1) == 1).all()):
            raise RuntimeError(f"reward {self.name}: expected one {REWARD_TOKEN} token per prompt")
        return self.head(hidden[at_reward].float())[:, 0]
