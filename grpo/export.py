"""Reading a checkpoint's trained weights back, and writing diffusers weights.

* :func:`trained_weights`: the fp32 trainable weights of a checkpoint (DeepSpeed's ``zero_to_fp32`` of the optimizer's
  master shards, overlaid with the EMA weights when the checkpoint has them); :func:`apply_weights` puts them into a
  plain transformer. For one process without DeepSpeed: ``python -m tools.export`` and ``python -m tools.eval``.
* :func:`write_lora` / :func:`write_transformer`: a diffusers LoRA file in the model family's format (and/or
  ComfyUI's, grpo/lora_files.py), or a folder of the transformer's own class; the recipe's final and best exports
  write with them.
* :func:`publish`: a complete export folder put in place atomically (the recipe's best/, rewritten at every new best).

Everything written is safetensors. DeepSpeed's reader unpickles its own ``.pt`` files (``weights_only=False``), so
only read checkpoints you trust.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from grpo import checkpoint as ckpt
from grpo.checkpoint.files import _fsync_dir
from grpo.ema import assemble
from grpo.errors import ConfigError
from grpo.lora_files import write_comfyui


def _ema_weights(path: Path, meta: dict) -> dict[str, torch.Tensor]:
    files = [path / ckpt.rank_file(r) for r in range(meta["world_size"])]
    with safe_open(str(files[0]), framework="pt") as f:
        shapes = json.loads(f.metadata()["ema_shapes"])
    return assemble([load_file(str(f)) for f in files], shapes)


def trained_weights(path: Path, weights: str = "auto") -> tuple[dict[str, torch.Tensor], dict]:
    """fp32 trainable weights of a checkpoint (all weights for a full fine-tune, the adapters for LoRA).

    Returns:
        (state dict in the training module's names, meta.json with "weights" set to "ema" or "model").
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    meta = weights_meta(path, weights)
    state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name,
                                                     exclude_frozen_parameters=meta["lora"])
    if meta["weights"] == "ema":
        ema = _ema_weights(path, meta)
        missing = set(ema) - set(state)
        if missing:
            raise ValueError(f"EMA names not in the checkpoint's weights: {sorted(missing)[:3]}")
        state.update(ema)
    if meta["lora"]:
        state = {k: v for k, v in state.items() if "lora_" in k}
    return state, meta


def weights_meta(path: Path, weights: str = "auto") -> dict:
    """A checkpoint's meta.json with "weights" set to the weights `weights` picks ("ema" or "model"), without reading
    them (tools.eval's resumed shards need only this)."""
    meta = ckpt.read_meta(path)
    if weights == "ema" and not meta["ema"]:
        raise ConfigError(f"weights: ema, but {path} has no EMA (trained with ema.decay: null); use model")
    meta["weights"] = "ema" if meta["ema"] and weights in ("auto", "ema") else "model"
    return meta


def lora_metadata(lora: dict) -> dict:
    """The LoraConfig kwargs diffusers reads back from the file (rank, alpha, targets)."""
    return {"r": int(lora["rank"]), "lora_alpha": float(lora["alpha"]), "lora_dropout": 0.0,
            "target_modules": list(lora["target_modules"]), "init_lora_weights": lora.get("init", "gaussian")}


def write_lora(family, state: dict[str, torch.Tensor], lora: dict, out_dir: str | Path,
               formats: list[str] | tuple[str, ...] = ("diffusers",), model_path: str | None = None) -> None:
    """The LoRA files of `formats` in `out_dir`: diffusers' (pytorch_lora_weights.safetensors, for the family
    pipeline's load_lora_weights) and ComfyUI's (comfyui_lora.safetensors, grpo/lora_files.py).

    Args:
        family: the model's grpo.models.ModelFamily (its pipeline writes the diffusers file).
        state: adapter weights in PEFT naming (no adapter name), e.g. from grpo.engine.lora_state_dict.
        lora: the run's `lora:` settings (rank, alpha, target_modules, init).
        out_dir: the folder to write.
        formats: export.formats.
        model_path: the model folder (its transformer's config names and sizes ComfyUI's modules); comfyui only.
    """
    if "diffusers" in formats:
        family.save_lora(out_dir, state, lora_metadata(lora))
    if "comfyui" in formats:
        write_comfyui(state, family.meta_transformer(model_path), lora, out_dir, family)


def write_transformer(state: dict[str, torch.Tensor], class_name: str, transformer_config: dict,
                      out_dir: str | Path, dtype: torch.dtype) -> None:
    """A `class_name` (e.g. FluxTransformer2DModel) folder: config.json + diffusion_pytorch_model*.safetensors."""
    import diffusers
    from huggingface_hub import save_torch_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {"_class_name": class_name, "_diffusers_version": diffusers.__version__,
              **{k: v for k, v in transformer_config.items() if not k.startswith("_")}}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_torch_state_dict({k: _own_storage(v.to(dtype).contiguous()) for k, v in state.items()}, str(out),
                          filename_pattern="diffusion_pytorch_model{suffix}.safetensors", max_shard_size="10GB")


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied when it is a view into a larger buffer, which safetensors refuses to write. DeepSpeed's gathered
    weights are such views on a single CPU process after a universal-checkpoint load (the partitions are re-cut from
    one flat buffer and a 1-process "gather" is a view of the partition)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def _lora_module(transformer: torch.nn.Module, lora: dict) -> None:
    from peft import LoraConfig

    transformer.add_adapter(LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), lora_dropout=0.0,
                                       init_lora_weights=lora.get("init", "gaussian"),
                                       target_modules=list(lora["target_modules"])))


def apply_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], meta: dict) -> None:
    """Put a checkpoint's weights into a plain (non-DeepSpeed) transformer: add the adapter for LoRA."""
    if meta["lora"]:
        _lora_module(model, meta["config"]["lora"])
        params = dict(model.named_parameters())
        missing = [k for k in state if k not in params]
        if missing:
            raise ValueError(f"adapter weights do not fit the model: {missing[:3]}")
        with torch.no_grad():
            for k, v in state.items():
                params[k].copy_(v.to(params[k].dtype))
    else:
        result = model.load_state_dict({k: v.to(model.dtype) for k, v in state.items()}, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(f"checkpoint does not fit the model: missing {result.missing_keys[:3]}, "
                             f"unexpected {result.unexpected_keys[:3]}")


def publish(tmp: Path, final: Path) -> None:
    """Put the complete folder `tmp` in the place of `final` (one process): its files synced, then renamed into place
    as grpo/checkpoint/writer.py does a checkpoint. A folder cannot replace another in one rename: the old one moves
    to ``.old-<name>`` first and is removed after, so a kill leaves `final` whole (the old or the new one), or, between
    the two renames, absent with both whole beside it (``.old-<name>``, and `tmp` in full); never a half-written one."""
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = final.with_name(f".old-{final.name}")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
