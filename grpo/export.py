"""Export a training checkpoint to plain diffusers weights, offline (one process, no DeepSpeed launch).

    python -m grpo.export CHECKPOINT OUT [--format lora|full] [--weights auto|ema|model] [--dtype fp32|bf16|fp16]

CHECKPOINT is a checkpoint folder (output_dir/checkpoints/step_...) or a run folder (its newest valid checkpoint).
The fp32 weights come from DeepSpeed's ``zero_to_fp32`` (the optimizer's master shards of every rank), overlaid with
the EMA weights when the checkpoint has them (``--weights auto``, the default).

* LoRA run, ``--format lora`` (default): a diffusers LoRA file for ``FluxPipeline.load_lora_weights(OUT)``, with the
  adapter's rank and alpha stored in the safetensors metadata (without them diffusers would assume alpha = rank).
* LoRA run, ``--format full``: the adapter fused into the base transformer (model.path of the run's config).
* Full fine-tune (default ``--format full``): a folder for ``FluxTransformer2DModel.from_pretrained(OUT)``
  (config.json + safetensors shards).

Everything written is safetensors. DeepSpeed's reader unpickles its own ``.pt`` files (``weights_only=False``), so
only export checkpoints you trust; the checkpoint's sha256 list is verified first.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from grpo import checkpoint as ckpt
from grpo.checkpoint import find_checkpoint  # noqa: F401 -- also reached as grpo.export.find_checkpoint (grpo.eval)
from grpo.errors import ConfigError, run_command

log = logging.getLogger(__name__)

ADAPTER = ".default"  # PEFT's adapter name inside the training module's parameter names


def _ema_weights(path: Path, meta: dict) -> dict[str, torch.Tensor]:
    from grpo.ema import assemble

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

    meta = ckpt.read_meta(path)
    if weights == "ema" and not meta["ema"]:
        raise ConfigError(f"weights: ema, but {path} has no EMA (trained with ema.decay: null); use model")
    state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name,
                                                     exclude_frozen_parameters=meta["lora"])
    use_ema = meta["ema"] and weights in ("auto", "ema")
    if use_ema:
        ema = _ema_weights(path, meta)
        missing = set(ema) - set(state)
        if missing:
            raise ValueError(f"EMA names not in the checkpoint's weights: {sorted(missing)[:3]}")
        state.update(ema)
    if meta["lora"]:
        state = {k: v for k, v in state.items() if "lora_" in k}
    meta["weights"] = "ema" if use_ema else "model"
    return state, meta


def peft_lora_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Training names (`...to_q.lora_A.default.weight`) -> PEFT/diffusers names (`...to_q.lora_A.weight`)."""
    return {k.replace(ADAPTER, ""): v for k, v in state.items() if "lora_" in k}


def lora_metadata(lora: dict) -> dict:
    """The LoraConfig kwargs diffusers reads back from the file (rank, alpha, targets)."""
    return {"r": int(lora["rank"]), "lora_alpha": float(lora["alpha"]), "lora_dropout": 0.0,
            "target_modules": list(lora["target_modules"]), "init_lora_weights": lora.get("init", "gaussian")}


def write_lora(state: dict[str, torch.Tensor], lora: dict, out_dir: str | Path) -> None:
    """A diffusers LoRA file (pytorch_lora_weights.safetensors) loadable by FluxPipeline.load_lora_weights.

    Args:
        state: adapter weights in PEFT naming (no adapter name), e.g. from grpo.engine.lora_state_dict.
        lora: the run's `lora:` settings (rank, alpha, target_modules, init).
        out_dir: the folder to write.
    """
    from diffusers import FluxPipeline

    FluxPipeline.save_lora_weights(str(out_dir), transformer_lora_layers={k: v.contiguous() for k, v in state.items()},
                                   transformer_lora_adapter_metadata=lora_metadata(lora), safe_serialization=True)


def write_transformer(state: dict[str, torch.Tensor], transformer_config: dict, out_dir: str | Path,
                      dtype: torch.dtype) -> None:
    """A FluxTransformer2DModel folder: config.json + diffusion_pytorch_model*.safetensors."""
    import diffusers
    from huggingface_hub import save_torch_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {"_class_name": "FluxTransformer2DModel", "_diffusers_version": diffusers.__version__,
              **{k: v for k, v in transformer_config.items() if not k.startswith("_")}}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_torch_state_dict({k: v.to(dtype).contiguous() for k, v in state.items()}, str(out),
                          filename_pattern="diffusion_pytorch_model{suffix}.safetensors", max_shard_size="10GB")


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


def fused_state(state: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """Base transformer (the run's model.path) with the adapter merged: W + (alpha / r) * B @ A."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from grpo.flux import load_transformer
    from grpo.inputs import resolve_model_path

    cfg = meta["config"]["model"]
    model = load_transformer(resolve_model_path(cfg["path"], cfg.get("revision")), torch.float32)
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
    """Write `checkpoint` as a diffusers LoRA (`fmt="lora"`) or transformer folder (`fmt="full"`); returns OUT."""
    from grpo.device import resolve_dtype

    path = find_checkpoint(Path(checkpoint))
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"OUT: {out} is not empty; export into a new folder")
    if weights not in ("auto", "ema", "model"):
        raise ConfigError(f"--weights: {weights!r}; use auto, ema or model")
    torch_dtype = resolve_dtype(dtype)
    state, meta = trained_weights(path, weights)
    fmt = fmt or ("lora" if meta["lora"] else "full")
    if fmt == "lora":
        if not meta["lora"]:
            raise ConfigError(f"--format: lora, but {path} is a full fine-tune; use --format full")
        write_lora({k: v.to(torch_dtype) for k, v in peft_lora_state(state).items()}, meta["config"]["lora"], out)
    elif fmt == "full":
        full = fused_state(state, meta) if meta["lora"] else state
        write_transformer(full, meta["transformer_config"], out, torch_dtype)
    else:
        raise ConfigError(f"--format: {fmt!r}; use lora or full")
    log.info("exported %s (%s weights, step %d) as %s to %s", path, meta["weights"], meta["step"], fmt, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="output_dir/checkpoints/step_... or a run folder")
    parser.add_argument("out", help="folder to write (must be new or empty)")
    parser.add_argument("--format", choices=["lora", "full"], default=None,
                        help="lora (LoRA runs' default) or full (a FluxTransformer2DModel folder)")
    parser.add_argument("--weights", choices=["auto", "ema", "model"], default="auto",
                        help="auto: EMA weights when the checkpoint has them")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    return run_command(lambda: str(export(args.checkpoint, args.out, args.format, args.weights, args.dtype)))


if __name__ == "__main__":
    sys.exit(main())
