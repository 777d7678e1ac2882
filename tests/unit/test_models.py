"""The model-family layer (grpo/models/): the family comes from the folder, and only the family layer (and the tiny
worlds' builders) names a diffusers FLUX class."""

from __future__ import annotations

import ast
import json
import re
import shutil

import pytest
import torch

from grpo.errors import ConfigError
from grpo.models import FAMILIES, family_of, family_of_transformer
from grpo.models.flux1 import FLUX1
from grpo.models.flux2 import FLUX2_DEV, FLUX2_KLEIN
from tests import ROOT, TINY

# The classes a family owns: its pipelines, transformers, VAEs (FLUX.1's AutoencoderKL included) and their modules.
FLUX_NAME = re.compile(r"^(Flux\w*|AutoencoderKL|AutoencoderKLFlux2)$")
FLUX_MODULE = re.compile(r"^diffusers\.(pipelines\.flux\w*|models\.transformers\.transformer_flux\w*)")
# The tiny worlds' builders make the diffusers folders (tests compare with diffusers' pipelines on purpose).
ALLOWED = ("grpo/models/", "maintainer/tiny_worlds/")


def _is_flux_class(name: str) -> bool:
    import diffusers

    return bool(FLUX_NAME.match(name)) and name in dir(diffusers)  # FluxSampler, FluxGRPORecipe are ours


def _named_flux(path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("diffusers"):
            if FLUX_MODULE.match(node.module):
                found.append(f"{node.lineno}: from {node.module}")
            found += [f"{node.lineno}: {a.name}" for a in node.names if _is_flux_class(a.name)]
        elif isinstance(node, ast.Attribute) and _is_flux_class(node.attr):
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_flux_class(node.value):
            found.append(f"{node.lineno}: {node.value!r}")  # getattr(diffusers, "FluxPipeline")
    return found


def test_no_flux_class_outside_the_family_layer():
    offenders = {}
    for top in ("grpo", "tools", "recipes", "benchmarks", "maintainer"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if not rel.startswith(ALLOWED) and (hits := _named_flux(path)):
                offenders[rel] = hits
    assert offenders == {}


def test_the_check_catches_each_form(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from diffusers import FluxPipeline\nimport diffusers\ndiffusers.Flux2Transformer2DModel\n"
                 "from diffusers.pipelines.flux.pipeline_flux import calculate_shift\n"
                 "getattr(diffusers, 'AutoencoderKL')\nFluxSampler.x\n")
    assert len(_named_flux(f)) == 4


def _folder(tmp_path, class_name: str | None):
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    if class_name is not None:
        (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    return folder


def test_the_family_comes_from_model_index(tmp_path):
    assert family_of(TINY) is FLUX1
    assert family_of(_folder(tmp_path / "a", "Flux2KleinPipeline")) is FLUX2_KLEIN
    assert family_of(_folder(tmp_path / "b", "Flux2Pipeline")) is FLUX2_DEV
    assert family_of(_folder(tmp_path / "c", "FluxKontextPipeline")).name == "flux1-kontext"


@pytest.mark.parametrize("class_name, words", [
    ("StableDiffusion3Pipeline",
     "is a StableDiffusion3Pipeline; supported pipelines: FluxPipeline, FluxKontextPipeline, Flux2KleinPipeline, "
     "Flux2Pipeline"),
    (None, "model_index.json is missing or has no _class_name"),
])
def test_an_unsupported_folder_is_one_line(tmp_path, class_name, words):
    with pytest.raises(ConfigError) as e:
        family_of(_folder(tmp_path, class_name))
    assert words in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("model.path: ")


def test_an_unsupported_pipeline_is_refused_by_the_start_up_check(tmp_path):
    from grpo.inputs import resolve_model_path

    model = tmp_path / "sd3"
    shutil.copytree(TINY, model)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    with pytest.raises(ConfigError, match="supported pipelines: FluxPipeline"):
        resolve_model_path(str(model))


def test_transformer_configs_name_their_family():
    assert family_of_transformer(json.loads((TINY / "transformer" / "config.json").read_text())) is FLUX1
    assert family_of_transformer({}) is FLUX1
    assert family_of_transformer({"_class_name": "Flux2Transformer2DModel"}).name == "flux2"
    assert family_of_transformer({"_class_name": "Flux3Transformer2DModel"}).name == "flux3"
    with pytest.raises(ConfigError,
                       match="supported: Flux2Transformer2DModel, Flux3Transformer2DModel, FluxTransformer2DModel"):
        family_of_transformer({"_class_name": "SD3Transformer2DModel"})


def test_every_family_serves_distinct_pipelines():
    names = [p for f in FAMILIES for p in f.pipelines]
    assert len(names) == len(set(names))


def test_flux2_latents_round_trip_as_the_pipeline_lays_them_out():
    """Noise drawn patchified [4C, h/2, w/2] -> tokens -> back by ids, as Flux2KleinPipeline packs and unpacks."""
    from diffusers import Flux2KleinPipeline

    noise = torch.randn(2, 32, 4, 4)
    tokens = FLUX2_KLEIN.pack(noise)
    assert tokens.shape == (2, 16, 32)
    ids = FLUX2_KLEIN.image_ids(8, torch.device("cpu"))
    assert torch.equal(ids, Flux2KleinPipeline._prepare_latent_ids(noise)[0])
    back = Flux2KleinPipeline._unpack_latents_with_ids(tokens, ids.expand(2, -1, -1), 4, 4)
    assert torch.equal(back, noise)
    assert FLUX2_KLEIN.noise_shape(8, 8) == (32, 4, 4)


def test_flux2_shift_is_the_empirical_rule():
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    for seq, steps in ((16, 4), (1024, 28), (4096, 50), (8192, 4)):
        assert FLUX2_KLEIN.shift_mu(seq, steps, {}) == compute_empirical_mu(seq, steps)
