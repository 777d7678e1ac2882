"""Start-up checks of a preset against this machine, shared by the recipe and launch/*.sh.

Batch arithmetic for the world size, the model folder, the DeepSpeed JSON, prompt files, rewards and output_dir, each
failing with one line that names the setting and the fix. It imports neither diffusers nor DeepSpeed, so the
launchers run it (``python -m tools.check``) in a few seconds before torchrun, which would turn the recipe's exit
code 2 into 1.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from grpo import checkpoint, metrics, prompts
from grpo.config import RecipeConfig
from grpo.layout import Layout, derive_layout
from grpo.errors import ConfigError
from grpo.rewards import check_rewards


@dataclass
class Inputs:
    layout: Layout
    model_path: str  # a local diffusers folder
    ds_config: dict  # the DeepSpeed config with the batch fields filled


def resolve_model_path(path: str, revision: str | None = None) -> str:
    """Return a local folder for `path` (a local folder or a hub id), or raise a one-line ConfigError.

    Hub ids resolve through the local Hugging Face cache; with HF_HUB_OFFLINE=1 nothing is downloaded.
    """
    if Path(path).is_dir():
        if not (Path(path) / "model_index.json").is_file():
            raise ConfigError(
                f"model.path: {path} has no model_index.json; point it at a diffusers FLUX folder "
                "(e.g. assets/tiny-flux or a downloaded black-forest-labs/FLUX.1-dev)"
            )
        return path
    if path.count("/") != 1 or path.startswith((".", "/")):
        raise ConfigError(f"model.path: {path} is not a folder; give a local diffusers folder or a hub id such as "
                          "black-forest-labs/FLUX.1-dev")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    try:
        return snapshot_download(path, revision=revision, local_files_only=offline,
                                 allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except Exception as e:  # noqa: BLE001 -- any hub failure becomes one actionable line
        raise ConfigError(
            f"model.path: {path} is not a local folder and could not be found in the Hugging Face cache "
            f"({type(e).__name__}); run `hf download {path}` on a machine with access, "
            "or set model.path to a local folder"
        ) from None


_FILLED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


def load_ds_config(path: str, cfg: RecipeConfig, layout: Layout) -> dict:
    """Read a ds_configs/*.json file, check it, and fill the fields the recipe owns."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"deepspeed.config: {path} does not exist; use one of ds_configs/*.json")
    try:
        ds = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed.config: {path} is not valid JSON (line {e.lineno}); fix the syntax") from None
    stage = ds.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise ConfigError(f"deepspeed.config: {path} has zero_optimization.stage={stage}; these recipes need 3")
    clash = [k for k in _FILLED if k in ds]
    if clash:
        raise ConfigError(
            f"deepspeed.config: {path} sets {clash[0]}; remove it, the recipe derives it from batch.* and optim.*"
        )
    if "optimizer" in ds or "scheduler" in ds:
        raise ConfigError(f"deepspeed.config: {path} declares an optimizer/scheduler; remove it, set optim.* instead")
    ds.update(
        train_micro_batch_size_per_gpu=layout.micro_batch_size,
        gradient_accumulation_steps=layout.grad_accum_steps,
        train_batch_size=layout.ds_train_batch_size,
        gradient_clipping=cfg.optim.max_grad_norm,
    )
    return ds


def check_inputs(cfg: RecipeConfig, world_size: int) -> Inputs:
    """The recipe's start-up checks that need no model, accelerator or process group.

    Batch arithmetic for `world_size`, the model folder (or hub cache), the DeepSpeed JSON, prompt files, rewards
    (names, options, model files), wandb, and an empty output_dir for a new run.
    """
    layout = derive_layout(cfg, world_size)
    model_path = resolve_model_path(cfg.model.path, cfg.model.revision)
    ds_config = load_ds_config(cfg.deepspeed.config, cfg, layout)
    prompts.read_prompt_file(cfg.data.train_prompts, "data.train_prompts")
    if cfg.data.eval_prompts:
        prompts.read_prompt_file(cfg.data.eval_prompts, "data.eval_prompts")
    check_rewards(cfg.rewards)
    metrics.check_wandb(cfg.logging.wandb)
    # Only a new run's output_dir: resuming verifies every checkpoint file's hash (minutes for FLUX.1-dev), a job the
    # recipe's ranks share, and `auto` may move a broken checkpoint aside, which a check must not do.
    if cfg.checkpoint.resume is None:
        checkpoint.resume_point(cfg, world_size)
    return Inputs(layout, model_path, ds_config)
