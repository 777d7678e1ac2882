"""Recipe configuration: the recipe's settings assembled from the registry, YAML presets, dotted overrides and start-up
validation.

The sections live in grpo/settings.py, a leaf any module can annotate with; here RecipeConfig adds one section per
objective of the registry (grpo/objectives/), so a new objective is its module and one registry line, and nothing
below the registry imports this module. Every check here runs before any model is loaded, and every error is one
line naming the setting and the fix.

The schema is the single source of truth: each field's help text, whether it may change when a run is resumed,
and whether it names a file (grpo/schema.py's `setting`). `python -m tools.check --help` lists every setting.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from grpo.checks import validate
from grpo.errors import ConfigError
from grpo.objectives import OBJECTIVES
from grpo.schema import build, describe, fields_along, parse_value, read_preset, set_dotted, setting
from grpo.settings import FREE, RecipeSettings

# What `lora.rank=16` on a full fine-tune preset fills in for the LoRA keys it does not give.
LORA_SWITCH_DEFAULTS = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "init": "gaussian",
                        "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}

# `algorithm` takes the registry's names (RecipeSettings' field again with its choices: a field declared again keeps its
# place among the settings), and each objective has an optional section named after it: exactly the one `algorithm`
# names is given.
_ALGORITHM = next(f for f in dataclasses.fields(RecipeSettings) if f.name == "algorithm")
RecipeConfig = dataclasses.make_dataclass(
    "RecipeConfig",
    [("algorithm", str, setting(**{**_ALGORITHM.metadata, "choices": tuple(OBJECTIVES)})),
     *[(name, objective.Settings | None, setting(None, help=objective.help))
       for name, objective in OBJECTIVES.items()]],
    bases=(RecipeSettings,), kw_only=True,
    namespace={"__module__": __name__, "__doc__": "The recipe's settings: RecipeSettings, the objectives' sections."})


# ----------------------------------------------------------------------------------------------------------------
# Loading: YAML -> dict -> typed dataclasses, unknown, missing and mistyped keys rejected, then validate().


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RecipeConfig:
    """Load a YAML preset, apply `key.sub=value` overrides, check every setting (:func:`validate`) and return it.

    Unknown or missing keys, wrong types, malformed overrides and bad values raise a one-line ConfigError.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        raw = read_preset(path)  # the preset with its `extends:` chain merged in; overrides apply after
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected key=value, e.g. max_steps=10")
        key, text = item.split("=", 1)
        value = parse_value(text)
        if key == "lora" and value is not None and not isinstance(value, dict):
            raise ConfigError("lora: expected null (full fine-tune) or a mapping of LoRA settings")
        if key.startswith("lora.") and raw.get("lora", "absent") is None:
            raw["lora"] = {**LORA_SWITCH_DEFAULTS}  # lora.rank=16 on a full preset switches LoRA on
        set_dotted(raw, key, value)
    cfg = build(RecipeConfig, raw, source=str(path) if path is not None else None)
    validate(cfg)
    return cfg


def resume_free(dotted: str) -> bool:
    """Whether a setting (a flattened key such as `logging.eval_every`) may differ when a checkpoint is resumed."""
    return any(f.metadata.get("resume") == FREE for f in fields_along(RecipeConfig, dotted))


def is_path(dotted: str) -> bool:
    """Whether a setting names a file or folder (compared by the place it names, not its spelling)."""
    along = fields_along(RecipeConfig, dotted)
    return len(along) == len(dotted.split(".")) and bool(along[-1].metadata.get("path"))


def describe_settings() -> str:
    """Every recipe setting with its type, default (or "required") and help, for --help."""
    return "\n".join(["Settings (YAML keys; override with key.sub=value):", *describe(RecipeConfig)])


def to_dict(cfg: RecipeConfig) -> dict[str, Any]:
    """The settings as plain data, the objective's section right after `algorithm`, the others left out."""
    d = dataclasses.asdict(cfg)
    sections = {name: d.pop(name) for name in OBJECTIVES}
    out = {}
    for k, v in d.items():
        out[k] = v
        if k == "algorithm":
            out[v] = sections[v]
    return out


def dump_config(cfg: RecipeConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
