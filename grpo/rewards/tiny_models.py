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
The tokenizers use CLIP's real vocabulary (open_clip's bundled BPE), so token ids match the real models'.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["TINY_CLIP", "tiny_clip_config", "write_tiny_reward_files", "clip_vocab"]

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
