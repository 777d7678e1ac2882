"""Typed per-reward options: the schema each reward declares, and its validation into ConfigError messages."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from grpo.errors import ConfigError

__all__ = ["Option", "COMMON_OPTIONS", "MODEL_OPTIONS", "validate_options", "parse_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class Option:
    """One option of a reward.

    Attributes:
        kind: accepted Python type: float (ints accepted), int, bool or str.
        default: value used when the option is absent.
        doc: one-line description, shown by `--list` and in error messages.
        nullable: whether None (YAML null) is accepted.
        choices: allowed values, or None for any value of `kind`.
    """

    kind: type
    default: Any
    doc: str
    nullable: bool = False
    choices: tuple[Any, ...] | None = None

    def type_name(self) -> str:
        name = self.kind.__name__
        if self.choices is not None:
            name = " | ".join(repr(c) for c in self.choices)
        return f"{name} or null" if self.nullable else name


COMMON_OPTIONS: dict[str, Option] = {
    "weight": Option(float, 1.0, "weight of this reward in the mix (negative allowed, 0 = logged only)"),
    "batch_size": Option(int, 32, "images scored per forward pass; bigger batches are split", nullable=True),
}

# Options every reward backed by a neural network has.
MODEL_OPTIONS: dict[str, Option] = {
    **COMMON_OPTIONS,
    "dtype": Option(str, "float32", "weights dtype of the reward model", choices=tuple(_DTYPES)),
    "device": Option(str, None, "null = the rank's device; cpu = keep the model on the CPU", nullable=True,
                     choices=("cpu",)),
    "offload": Option(bool, False, "keep the model on the CPU between scoring phases (Rewards.on_device())"),
    "cache_dir": Option(str, None, "Hugging Face cache folder (default: HF_HUB_CACHE)", nullable=True),
}


def parse_dtype(name: str) -> torch.dtype:
    """Maps a dtype option ('float32', 'bf16', ...) to a torch dtype."""
    return _DTYPES[name]


def _type_ok(value: Any, opt: Option) -> bool:
    if value is None:
        return opt.nullable
    if opt.kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if opt.kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, opt.kind)


def validate_options(raw: dict[str, Any], schema: dict[str, Option], setting: str) -> dict[str, Any]:
    """Checks names, types and choices of `raw` against `schema` and fills in defaults.

    Args:
        raw: the options as written in the preset (YAML -> dict).
        schema: the reward's declared options.
        setting: dotted name used in messages, e.g. "rewards.hpsv2".

    Returns:
        A new dict with every schema option present (floats as float).

    Raises:
        ConfigError: unknown option (the message lists the valid ones), wrong type or value.
    """
    unknown = sorted(set(raw) - set(schema))
    if unknown:
        raise ConfigError(
            f"{setting}: unknown option(s) {', '.join(unknown)}; valid options: {', '.join(sorted(schema))}"
        )
    out: dict[str, Any] = {}
    for key, opt in schema.items():
        value = raw.get(key, opt.default)
        if not _type_ok(value, opt):
            raise ConfigError(
                f"{setting}.{key}: expected {opt.type_name()}, got {value!r} ({type(value).__name__}); {opt.doc}"
            )
        if value is not None and opt.choices is not None and value not in opt.choices:
            raise ConfigError(
                f"{setting}.{key}: {value!r} is not one of {', '.join(map(repr, opt.choices))}; {opt.doc}"
            )
        if opt.kind is float and value is not None:
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"{setting}.{key}: must be a finite number, got {value}")
        out[key] = value
    if out.get("batch_size") is not None and out["batch_size"] < 1:
        raise ConfigError(f"{setting}.batch_size: must be >= 1 or null (whole batch at once), got {out['batch_size']}")
    return out
