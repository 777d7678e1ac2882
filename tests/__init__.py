"""Tests in two tiers: unit/ (in-process, fast; unit/test_tiers.py checks that none starts a process) and recipe/
(everything that starts one: real runs through torchrun, launch/*.sh or the CLIs, fresh interpreters, bash; their one
launch helper is tests/recipe/launch.py)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(os.environ.get("GRPO_TINY_MODEL", ROOT / "assets" / "tiny-flux"))
# the FLUX.2 [klein] tiny world (python -m maintainer.tiny_worlds --family flux2)
TINY_FLUX2 = ROOT / "assets" / "tiny-flux2"
# the FLUX.3 tiny world, a Flux3ModularPipeline folder (python -m maintainer.tiny_worlds --family flux3)
TINY_FLUX3 = Path(os.environ.get("GRPO_TINY_FLUX3", ROOT / "assets" / "tiny-flux3"))
# assets/tiny-flux under FluxKontextPipeline (python -m maintainer.tiny_worlds --family flux1-kontext)
TINY_KONTEXT = ROOT / "assets" / "tiny-flux-kontext"
EDITS = ROOT / "assets" / "prompts" / "tiny_edit_train.jsonl"  # its edit set (python -m maintainer.tiny_worlds.prompts)
EDITS_HELDOUT = ROOT / "assets" / "prompts" / "tiny_edit_heldout.jsonl"


def snapshot(path: Path) -> dict | None:
    """Everything under `path` (names, sizes, mtimes, contents of small files); None if it does not exist. Tests
    compare two snapshots to show a run left a folder untouched."""
    if not path.exists():
        return None
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
            for p in sorted(path.rglob("*"))}


def tiny_flux_transformer():
    """diffusers' own tiny FluxTransformer2DModel test config (diffusers
    tests/models/transformers/test_models_transformer_flux.py), random weights from seed 0."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                  axes_dims_rope=[4, 4, 8])


def attention_backends(model) -> dict[str, str]:
    """{processor class: attention backend} over every attention module of a diffusers model: what
    grpo.device.set_attention_backend reached (model.attention_backend, e.g. _native_npu on Ascend)."""
    return {type(m.processor).__name__: str(getattr(m.processor._attention_backend, "value",
                                                    m.processor._attention_backend))
            for m in model.modules() if hasattr(m, "processor")}


def true_cfg_sampler(cfg, parts, cache, model_path: Path, tmp_path: Path, scale: float):
    """A sampler of `cfg`'s settings with true CFG at `scale` (sampling.true_cfg, negative prompt "") and `cache`
    reloaded with the negative prompt's embeddings encoded by the recipe's own path (grpo.prompts.ensure_negative into
    a cache under `tmp_path`), as the recipe loads them: what the parity tests hold against the pipelines' CFG."""
    import dataclasses

    import torch

    from grpo.prompts import ensure_negative, load_cache, save_cache
    from grpo.rollout import FluxSampler
    from grpo.settings import TrueCFGConfig

    s = dataclasses.replace(cfg.sampling, true_cfg=TrueCFGConfig(scale=scale))
    sampler = FluxSampler.from_parts(parts, parts.vae, s, cfg.seed, torch.device("cpu"), torch.float32)
    data = dataclasses.replace(cfg.data, cache_dir=str(tmp_path))
    save_cache(cache, tmp_path / "prompts.safetensors")
    guided = load_cache(tmp_path / "prompts.safetensors",
                        negative=ensure_negative(str(model_path), s, data, torch.device("cpu")))
    assert guided.negative["prompt_embeds"].shape == (1, *cache.embeds["prompt_embeds"].shape[1:])
    return sampler, guided
