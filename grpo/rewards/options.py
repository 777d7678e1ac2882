"""Typed per-reward options, declared like the recipe settings (grpo/schema.py) so errors and --help read the same.

Every reward option has a default: a reward named with just a weight (`hpsv2: 1.0`) means the published model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from grpo import device as _device
from grpo.errors import ConfigError
from grpo.schema import build, setting

__all__ = ["CommonOptions", "ModelOptions", "OpenClipArch", "OpenClipOptions", "validate_options", "parse_dtype",
           "DTYPE_NAMES"]

# The recipe's short dtype names (grpo/device.py's table) and torch's long ones, both accepted by reward models.
DTYPE_NAMES = (*_device._DTYPES, *(str(d).removeprefix("torch.") for d in _device._DTYPES.values()))


@dataclass(kw_only=True)
class CommonOptions:
    weight: float = setting(1.0, help="weight of this reward in the mix (negative allowed, 0 = logged only)")
    batch_size: int | None = setting(32, help="images scored per forward pass; bigger batches are split; null = all")


@dataclass(kw_only=True)
class ModelOptions(CommonOptions):
    """Options every reward backed by a neural network has."""

    dtype: str = setting("float32", choices=DTYPE_NAMES,
                         help="weights dtype of the reward model (LayerNorms stay float32)")
    device: str | None = setting(None, choices=("cpu",), help="null = the rank's device; cpu = keep the model on the CPU")
    offload: bool = setting(False, help="keep the model on the CPU between scoring phases (Rewards.on_device())")
    cache_dir: str | None = setting(None, help="Hugging Face cache folder (default: HF_HUB_CACHE)")
    quantize: bool = setting(True, help="score images rounded to uint8 levels, as upstream scores PIL images; "
                                        "false = the float decode")


@dataclass(kw_only=True)
class OpenClipArch(ModelOptions):
    model: str = setting("ViT-H-14", help="open_clip architecture (ignored when pretrained is hf-hub:/a folder)")
    model_config: str | None = setting(None, help="open_clip model-config JSON registering `model` (custom/tiny)")


@dataclass(kw_only=True)
class OpenClipOptions(OpenClipArch):
    pretrained: str = setting("laion2b_s32b_b79k",
                              help="open_clip tag of `model`, hf-hub:ORG/NAME, local open_clip folder or checkpoint file")
    pretrained_tag: str | None = setting(None, help="open_clip tag of `model` whose weights a local checkpoint file "
                                                    "holds (its QuickGELU and preprocessing); null = from the file")
    quick_gelu: bool | None = setting(None, help="QuickGELU activations; null = as open_clip's tag table says")


def parse_dtype(name: str) -> torch.dtype:
    """A dtype option ('float32', 'bf16', ...) as a torch dtype."""
    if name in _device._DTYPES:
        return _device.resolve_dtype(name)
    return getattr(torch, name)


def validate_options(raw: dict[str, Any], schema: type, setting_name: str) -> dict[str, Any]:
    """Checks `raw` against the reward's options dataclass `schema` and fills in defaults.

    Args:
        raw: the options as written in the preset (YAML -> dict).
        schema: the reward's OPTIONS dataclass.
        setting_name: dotted name used in messages, e.g. "rewards.hpsv2".

    Returns:
        A new dict with every option present (floats as float).

    Raises:
        ConfigError: unknown option (the message lists the valid ones), wrong type or value.
    """
    out = dataclasses.asdict(build(schema, raw, setting_name))
    if out.get("batch_size") is not None and out["batch_size"] < 1:
        raise ConfigError(f"{setting_name}.batch_size: must be >= 1 or null (whole batch at once), "
                          f"got {out['batch_size']}")
    return out
