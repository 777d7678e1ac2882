"""Export a training checkpoint to plain diffusers weights, offline (one process, no DeepSpeed launch).

    python -m tools.export CHECKPOINT OUT [--format lora|comfyui|full] [--weights auto|ema|model]
                                          [--dtype fp32|bf16|fp16]

CHECKPOINT is a checkpoint folder (output_dir/checkpoints/step_...) or a run folder (its newest valid checkpoint).
The fp32 weights come from DeepSpeed's ``zero_to_fp32`` (the optimizer's master shards of every rank), overlaid with
the EMA weights when the checkpoint has them (``--weights auto``, the default).

* LoRA run, ``--format lora`` (default): a diffusers LoRA file for the pipeline's ``load_lora_weights(OUT)``
  (FluxPipeline's, Flux2KleinPipeline's), with the adapter's rank and alpha stored in the safetensors metadata
  (without them diffusers would assume alpha = rank).
* LoRA run, ``--format comfyui``: ComfyUI's native LoRA file (kohya/BFL keys, q/k/v fused where BFL's modules fuse
  them; grpo/lora_files.py), ``OUT/comfyui_lora.safetensors``, for ComfyUI/models/loras/.
* LoRA run, ``--format full``: the adapter fused into the base transformer (model.path of the run's config).
* Full fine-tune (default ``--format full``): a folder for the transformer class's ``from_pretrained(OUT)``
  (FluxTransformer2DModel, Flux2Transformer2DModel: config.json + safetensors shards).

Everything written is safetensors. DeepSpeed's reader unpickles its own ``.pt`` files (``weights_only=False``), so
only export checkpoints you trust; the checkpoint's sha256 list is verified first.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from grpo.checkpoint import find_checkpoint
from grpo.device import resolve_dtype
from grpo.errors import ConfigError, run_command
from grpo.export import apply_weights, trained_weights, write_lora, write_transformer
from grpo.inputs import resolve_model_path
from grpo.models import ModelFamily, family_of

log = logging.getLogger(__name__)

ADAPTER = ".default"  # PEFT's adapter name inside the training module's parameter names


def peft_lora_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Training names (`...to_q.lora_A.default.weight`) -> PEFT/diffusers names (`...to_q.lora_A.weight`)."""
    return {k.replace(ADAPTER, ""): v for k, v in state.items() if "lora_" in k}


def base_model(meta: dict) -> tuple[str, ModelFamily]:
    """The run's model.path as a local folder, and its family."""
    cfg = meta["config"]["model"]
    path = resolve_model_path(cfg["path"], cfg.get("revision"))
    return path, family_of(path)


def fused_state(state: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """Base transformer (the run's model.path) with the adapter merged: W + (alpha / r) * B @ A."""
    path, family = base_model(meta)
    model = family.load_transformer(path, torch.float32)
    apply_weights(model, state, meta)
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    out = {}
    for k, v in model.state_dict().items():
        if "lora_" in k:
            continue
        out[k.replace(".base_layer", "")] = v.detach().clone()
    return out


def export(checkpoint: str | Path, out: str | Path, fmt: str | None = None, weights: str = "auto",
           dtype: str = "fp32") -> Path:
    """Write `checkpoint` as a diffusers LoRA (`fmt="lora"`), a ComfyUI LoRA (`fmt="comfyui"`) or a transformer folder
    (`fmt="full"`); returns OUT."""
    path = find_checkpoint(Path(checkpoint))
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"OUT: {out} is not empty; export into a new folder")
    if weights not in ("auto", "ema", "model"):
        raise ConfigError(f"--weights: {weights!r}; use auto, ema or model")
    torch_dtype = resolve_dtype(dtype)
    state, meta = trained_weights(path, weights)
    fmt = fmt or ("lora" if meta["lora"] else "full")
    family = base_model(meta)[1]
    if fmt in ("lora", "comfyui"):
        if not meta["lora"]:
            raise ConfigError(f"--format: {fmt}, but {path} is a full fine-tune; use --format full")
        write_lora(family, {k: v.to(torch_dtype) for k, v in peft_lora_state(state).items()},
                   meta["config"]["lora"], out, ["diffusers" if fmt == "lora" else "comfyui"], base_model(meta)[0])
    elif fmt == "full":
        full = fused_state(state, meta) if meta["lora"] else state
        write_transformer(full, family.transformer_class().__name__, meta["transformer_config"], out, torch_dtype)
    else:
        raise ConfigError(f"--format: {fmt!r}; use lora, comfyui or full")
    log.info("exported %s (%s weights, step %d) as %s to %s", path, meta["weights"], meta["step"], fmt, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="output_dir/checkpoints/step_... or a run folder")
    parser.add_argument("out", help="folder to write (must be new or empty)")
    parser.add_argument("--format", choices=["lora", "comfyui", "full"], default=None,
                        help="lora (LoRA runs' default: diffusers' file), comfyui (ComfyUI's native file, "
                             "OUT/comfyui_lora.safetensors) or full (a transformer folder)")
    parser.add_argument("--weights", choices=["auto", "ema", "model"], default="auto",
                        help="auto: EMA weights when the checkpoint has them")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    return run_command(lambda: str(export(args.checkpoint, args.out, args.format, args.weights, args.dtype)))


if __name__ == "__main__":
    sys.exit(main())
