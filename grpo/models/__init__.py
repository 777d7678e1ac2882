"""Model families: everything FLUX.1- or FLUX.2-specific lives behind :class:`grpo.models.base.ModelFamily`.

    family = family_of(model_path)        # from <model_path>/model_index.json's _class_name
    parts = family.load_parts(model_path)  # transformer, VAE, scheduler config

The family is read from the folder, never set in a preset: a FLUX.2 folder cannot be trained with FLUX.1's prompt
encoding or latent layout by mistake.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo.errors import ConfigError
from grpo.models.base import Conditioning, ModelFamily, Parts, index_file
from grpo.models.flux1 import FLUX1, FLUX1_KONTEXT
from grpo.models.flux2 import FLUX2_DEV, FLUX2_KLEIN
from grpo.models.flux3 import FLUX3

__all__ = ["FAMILIES", "Conditioning", "ModelFamily", "Parts", "family_of", "family_of_pipeline",
           "family_of_transformer", "index_file", "pipeline_of"]

FAMILIES: tuple[ModelFamily, ...] = (FLUX1, FLUX1_KONTEXT, FLUX2_KLEIN, FLUX2_DEV, FLUX3)
_BY_PIPELINE = {name: f for f in FAMILIES for name in f.pipelines}


def pipeline_of(model_path: str | Path) -> str:
    """The ``_class_name`` of `model_path`'s model_index.json or modular_model_index.json (the diffusers pipeline the
    folder was saved by)."""
    index = index_file(model_path)
    try:
        return str(json.loads(index.read_text())["_class_name"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"model.path: {index} is missing or has no _class_name; point model.path at a diffusers "
                          "pipeline folder (e.g. assets/tiny-flux)") from None


def family_of_transformer(config: dict) -> ModelFamily:
    """The family of a transformer config.json (its ``_class_name``; FLUX.1's when absent), for the planner's
    configs that come without a pipeline folder."""
    name = config.get("_class_name", "FluxTransformer2DModel")
    for family in FAMILIES:
        if family.transformer_class().__name__ == name:
            return family
    known = sorted({f.transformer_class().__name__ for f in FAMILIES})
    raise ConfigError(f"model.path: a {name} transformer; supported: {', '.join(known)}")


def family_of(model_path: str | Path) -> ModelFamily:
    """The family that trains the pipeline saved at `model_path`; a one-line ConfigError for any other pipeline."""
    family = family_of_pipeline(pipeline_of(model_path), model_path)
    family.check_folder(str(model_path))
    return family


def family_of_pipeline(name: str, model_path: str | Path) -> ModelFamily:
    """The family of the pipeline class `name` (a model_index.json's _class_name) of `model_path`."""
    if name not in _BY_PIPELINE:
        raise ConfigError(f"model.path: {model_path} is a {name}; supported pipelines: {', '.join(_BY_PIPELINE)}")
    return _BY_PIPELINE[name]
