"""Tiny random-weight stand-ins for every reward model, written like their hub repos, for offline tests and benchmarks.

`write_tiny_reward_files(root)` writes:
  root/open_clip/grpo-tiny-clip.json           open_clip model config (registered by the `model_config` option)
  root/xswu-HPSv2/HPS_v2.1_compressed.pt       {"state_dict": ...} like the HPS checkpoints
  root/tiny-open-clip/                         open_clip hub layout: open_clip_config.json + open_clip_model.safetensors
  root/improved-aesthetic-predictor/sac+logos+ava1-l14-linearMSE.pth   MLP head, keys layers.{0,2,4,6,7}
  root/PickScore_v1/                           a transformers CLIPModel repo: config.json + model.safetensors
  root/CLIP-ViT-H-14-laion2B-s32B-b79K/        the laion processor files: preprocessor_config.json (legacy format),
                                               tokenizer.json/vocab.json/merges.txt, config.json
and returns a rewards spec whose options point at them, so every reward loads through its real loading code.
`write_tiny_imagereward(root)` and `write_tiny_hpsv3(root)` write the larger-model rewards' stand-ins apart (their
parity tests only): root/ImageReward/ (ImageReward.pt + med_config.json) + root/bert-base-uncased/ (vocab.txt), and
root/HPSv3/HPSv3.safetensors + root/Qwen2-VL/ (a tiny Qwen2-VL config and processor).
The tokenizers use CLIP's real vocabulary (open_clip's bundled BPE), so token ids match the real models'.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["TINY_CLIP", "tiny_clip_config", "write_tiny_reward_files", "clip_vocab", "write_tiny_imagereward",
           "write_tiny_hpsv3"]

TINY_CLIP = "grpo-tiny-clip"
VOCAB_SIZE = 49408  # CLIP's BPE: 256 bytes x 2 + 48894 merges + 2 specials


def tiny_clip_config(embed_dim: int = 16, image_size: int = 224, patch_size: int = 32) -> dict[str, Any]:
    """An open_clip ViT config small enough for CPU tests (head_width so that width / head_width >= 1)."""
    return {
        "embed_dim": embed_dim,
        "vision_cfg": {"image_size": image_size, "layers": 1, "width": 32, "head_width": 16, "patch_size": patch_size},
        "text_cfg": {"context_length": 77, "vocab_size": VOCAB_SIZE, "width": 32, "heads": 2, "layers": 1},
    }


def clip_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's BPE vocabulary and merges, rebuilt from open_clip's bundled bpe_simple_vocab_16e6.txt.gz.

    Same construction as open_clip's SimpleTokenizer and OpenAI's CLIP, so ids equal the real tokenizers'.
    """
    from open_clip.tokenizer import bytes_to_unicode, default_bpe

    lines = gzip.open(default_bpe()).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    merges = [tuple(line.split()) for line in lines]
    byte_tokens = list(bytes_to_unicode().values())
    tokens = byte_tokens + [t + "</w>" for t in byte_tokens] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges


def _write_open_clip(root: Path, seed: int) -> tuple[Path, Path, torch.nn.Module]:
    import open_clip
    from safetensors.torch import save_file

    cfg = tiny_clip_config()
    cfg_dir = root / "open_clip"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = cfg_dir / f"{TINY_CLIP}.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    if TINY_CLIP not in open_clip.list_models():
        open_clip.add_model_config(cfg_path)
    torch.manual_seed(seed)
    model = open_clip.CLIP(**cfg)
    hub_dir = root / "tiny-open-clip"
    hub_dir.mkdir(exist_ok=True)
    (hub_dir / "open_clip_config.json").write_text(json.dumps({
        "model_cfg": cfg,
        "preprocess_cfg": {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711],
                           "interpolation": "bicubic", "resize_mode": "shortest"},
    }, indent=1))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(hub_dir / "open_clip_model.safetensors"))
    return cfg_path, hub_dir, model


def _write_hps(root: Path, seed: int) -> Path:
    import open_clip

    torch.manual_seed(seed + 1)
    model = open_clip.CLIP(**tiny_clip_config())
    folder = root / "xswu-HPSv2"
    folder.mkdir(exist_ok=True)
    torch.save({"epoch": 1, "state_dict": model.state_dict()}, folder / "HPS_v2.1_compressed.pt")
    return folder


def _write_aesthetic_mlp(root: Path, in_dim: int, seed: int) -> Path:
    from grpo.rewards.aesthetic import MLP_FILE, AestheticMLP

    torch.manual_seed(seed + 2)
    mlp = AestheticMLP([in_dim, 32, 16, 8, 4, 1])
    folder = root / "improved-aesthetic-predictor"
    folder.mkdir(exist_ok=True)
    torch.save(mlp.state_dict(), folder / MLP_FILE)
    return folder


def _write_pickscore(root: Path, seed: int, image_size: int = 224) -> tuple[Path, Path]:
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    vocab, merges = clip_vocab()
    proc_dir = root / "CLIP-ViT-H-14-laion2B-s32B-b79K"
    proc_dir.mkdir(exist_ok=True)
    CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77).save_pretrained(proc_dir)
    (proc_dir / "vocab.json").write_text(json.dumps(vocab))
    (proc_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    # The laion repo's preprocessor_config.json, legacy format (int sizes): shortest side 224, centre crop 224,
    # bicubic (PIL code 3), OpenAI mean/std.
    (proc_dir / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": image_size, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_processor_type": "CLIPImageProcessor",
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3, "size": image_size,
    }, indent=1))

    torch.manual_seed(seed + 3)
    config = CLIPConfig(
        text_config={"vocab_size": VOCAB_SIZE, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 77, "bos_token_id": 49406,
                     "eos_token_id": 49407, "pad_token_id": 49407},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": image_size, "patch_size": 32},
        projection_dim=16,
    )
    model_dir = root / "PickScore_v1"
    model_dir.mkdir(exist_ok=True)
    # What save_pretrained writes, without it (it imports deepspeed through accelerate: seconds for nothing).
    config.save_pretrained(model_dir)
    state = {k: v.contiguous() for k, v in CLIPModel(config).state_dict().items()}
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    # The laion repo is a whole CLIPModel repo; transformers' AutoTokenizer reads its config.json.
    config.save_pretrained(proc_dir)
    return model_dir, proc_dir


def write_tiny_reward_files(root: str | Path, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Writes tiny stand-ins of every reward model under `root` (about 40 MB) and returns a spec that uses them.

    Args:
        root: output folder (created).
        seed: weights seed.

    Returns:
        {reward name: options} for hpsv2, pickscore, clip_score, aesthetic, tiny_world, jpeg_compressibility,
        jpeg_incompressibility; weights 1.0.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    cfg_path, clip_dir, clip_model = _write_open_clip(root, seed)
    hps_dir = _write_hps(root, seed)
    mlp_dir = _write_aesthetic_mlp(root, clip_model.visual.output_dim, seed)
    pick_model, pick_proc = _write_pickscore(root, seed)
    return {
        "hpsv2": {"weight": 1.0, "repo": str(hps_dir), "model": TINY_CLIP, "model_config": str(cfg_path)},
        "pickscore": {"weight": 1.0, "model": str(pick_model), "processor": str(pick_proc)},
        "clip_score": {"weight": 1.0, "pretrained": str(clip_dir)},
        "aesthetic": {"weight": 1.0, "pretrained": str(clip_dir), "mlp_repo": str(mlp_dir)},
        "tiny_world": {"weight": 1.0},
        "jpeg_compressibility": {"weight": 1.0},
        "jpeg_incompressibility": {"weight": 1.0},
    }


# BERT's special tokens at their bert-base-uncased ids' order, then the words of the tests' prompts and the letters
# (WordPiece falls back to them): a vocabulary small enough for a tiny embedding table.
_BERT_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz",
               *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"), "red", "green", "blue", "cyan", "magenta", "yellow",
               "circle", "square", "triangle", "on", "background", "cat", "dog", "photo", "of"]


def write_tiny_imagereward(root: str | Path, seed: int = 0) -> dict[str, Any]:
    """A tiny ImageReward checkpoint in the package's layout: BLIP ViT (width 64, one block, patch 32, 224 px), a
    one-layer text encoder of width 768 (the package's MLP(768) is fixed), random MLP; and a BERT vocab.

    Returns:
        the `imagereward` reward's options (weight 1.0) pointing at them.
    """
    from transformers import BertTokenizer
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    from grpo.rewards.aesthetic import AestheticMLP
    from grpo.rewards.imagereward import CHECKPOINT, MED_CONFIG, _text_config, _vision_config, to_package_keys

    root = Path(root)
    tok_dir, repo = root / "bert-base-uncased", root / "ImageReward"
    tok_dir.mkdir(parents=True, exist_ok=True)
    repo.mkdir(exist_ok=True)
    (tok_dir / "vocab.txt").write_text("\n".join(_BERT_WORDS) + "\n")
    BertTokenizer(str(tok_dir / "vocab.txt")).save_pretrained(tok_dir)
    # med_config.json as BLIP's (a BertConfig with cross-attention), at tiny depth; + 2 for [DEC] and [ENC].
    med = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
           "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 128,
           "layer_norm_eps": 1e-12, "max_position_embeddings": 64, "model_type": "bert", "num_attention_heads": 12,
           "num_hidden_layers": 1, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": len(_BERT_WORDS) + 2,
           "encoder_width": 64, "add_cross_attention": True}
    (repo / MED_CONFIG).write_text(json.dumps(med, indent=1))
    torch.manual_seed(seed + 4)
    grid, patch, width = 7, 32, 64
    vision = BlipVisionModel(_vision_config({
        "embeddings.class_embedding": torch.zeros(1, 1, width),
        "embeddings.patch_embedding.weight": torch.zeros(width, 3, patch, patch),
        "embeddings.position_embedding": torch.zeros(1, grid * grid + 1, width),
        "encoder.layers.0.mlp.fc1.weight": torch.zeros(4 * width, width)}))
    text = BlipTextModel(_text_config(med, width), add_pooling_layer=False)
    mlp = AestheticMLP([768, 1024, 128, 64, 16, 1])
    state = to_package_keys(vision.state_dict(), text.state_dict(), mlp.state_dict())
    state = _unit_gain(state)
    # BLIP_Pretrain's contrastive projections are in the real file too (unused by the score).
    state["blip.vision_proj.weight"], state["blip.vision_proj.bias"] = torch.randn(256, width), torch.zeros(256)
    state["blip.text_proj.weight"], state["blip.text_proj.bias"] = torch.randn(256, 768), torch.zeros(256)
    # med.py registers its position ids as a persistent buffer, so BLIP checkpoints carry them.
    state["blip.text_encoder.embeddings.position_ids"] = torch.arange(med["max_position_embeddings"])[None]
    torch.save({k: v.contiguous() for k, v in state.items()}, repo / CHECKPOINT)
    return {"weight": 1.0, "repo": str(repo), "tokenizer": str(tok_dir)}


# Qwen2-VL-7B-Instruct's chat_template.json (the processor's template HPSv3 formats its messages with).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]


def _unit_gain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Random weights whose signals neither vanish nor explode through a tiny stack (the libraries' inits, std 0.02,
    would leave an image's effect on a score below float32 noise): matrices and kernels ~ N(0, 1/fan_in), tensors
    with a leading 1 (class/position embeddings) N(0, 0.5^2), vectors N(0, 0.1^2) (+1 for norm gains, ".weight")."""
    out = {}
    for key, value in state.items():
        if not value.is_floating_point():
            out[key] = value
        elif value.dim() == 1:
            out[key] = float(key.endswith(".weight")) + 0.1 * torch.randn_like(value)
        else:
            out[key] = torch.randn_like(value) * (0.5 if value.shape[0] == 1 else value[0].numel() ** -0.5)
    return out


def write_tiny_hpsv3(root: str | Path, seed: int = 0) -> dict[str, Any]:
    """A tiny HPSv3: root/Qwen2-VL/ (a Qwen2-VL config of width 32, one layer each, and a processor: byte-level BPE
    tokenizer with Qwen's special tokens, Qwen2-VL's image processor and chat template) and root/HPSv3/
    HPSv3.safetensors (the whole model + rm_head in the 4.x key layout, embeddings resized for <|Reward|>).

    Returns:
        the `hpsv3` reward's options (weight 1.0, float32) pointing at them.
    """
    from safetensors.torch import save_file
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (Qwen2Tokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    from grpo.rewards.hpsv3 import CHECKPOINT, REWARD_TOKEN, to_v4_layout

    root = Path(root)
    base, repo = root / "Qwen2-VL", root / "HPSv3"
    base.mkdir(parents=True, exist_ok=True)
    repo.mkdir(exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}  # the 256 byte symbols, no merges
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], pad_token="<|endoftext|>", eos_token="<|im_end|>",
                               unk_token=None, bos_token=None)
    tokenizer.add_tokens(_QWEN_SPECIALS, special_tokens=True)
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    image_processor = Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056, patch_size=14,
                                            temporal_patch_size=2, merge_size=2, image_mean=mean, image_std=std)
    video_processor = Qwen2VLVideoProcessor(image_mean=mean, image_std=std)  # required by the processor, unused
    Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                     chat_template=QWEN2_VL_CHAT_TEMPLATE).save_pretrained(base)
    image_processor.save_pretrained(base)  # preprocessor_config.json, as the Qwen2-VL repo has it
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_SPECIALS}
    config = Qwen2VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 8192,
                     "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    config.save_pretrained(base)
    torch.manual_seed(seed + 5)
    # train.py: <|Reward|> added after loading the base, embeddings (and lm_head) resized to the new length.
    config.text_config.vocab_size = len(tokenizer) + 1
    state = Qwen2VLForConditionalGeneration(config).state_dict()
    head = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    state.update({f"rm_head.{k}": v for k, v in head.state_dict().items()})
    state = _unit_gain(to_v4_layout(state))
    save_file({k: v.contiguous() for k, v in state.items()}, str(repo / CHECKPOINT), metadata={"format": "pt"})
    assert REWARD_TOKEN not in vocab
    return {"weight": 1.0, "repo": str(repo), "base": str(base), "dtype": "float32"}
