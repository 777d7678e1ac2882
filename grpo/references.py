"""Reference images (FLUX.1-Kontext's source images) encoded once through the VAE, cached next to the prompt
embeddings and handed to the family's conditioning with each prompt.

A dataset's rows name their images (grpo/prompt_sets.py: "image"/"images", absolute paths once read). Rank 0 encodes
each distinct image once, as the model's pipeline encodes its reference image at the preset's resolution (the
family's `encode_references`), into one safetensors file under `data.cache_dir` per dataset:

    latents [U, Sr, C] float32   the packed latents of the U distinct images (by content)
    index   [P, k] int64         row p's k images (the same k for every row), rows of latents

The file name hashes the images' bytes (not their paths: a moved dataset keeps its cache, an edited image gets a new
one), the VAE's file stats (a rebuilt VAE at the same path gets a fresh cache, as the text encoders' do for the
prompt cache), the family and the resolution. A dataset without images has no reference cache (None); whether the
model folder takes images is checked at start-up (ModelFamily.check_references), so this module never asks.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from grpo.models import ModelFamily, family_of
from grpo.prompt_sets import PromptSet, row_images

__all__ = ["references_file", "ensure_references", "load_references"]

log = logging.getLogger(__name__)


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _distinct(rows: PromptSet) -> tuple[list[str], list[list[str]], list[list[int]]]:
    """(one path per distinct image in first-use order, each row's content hashes, each row's indices into the
    distinct images)."""
    paths, hashes, index, seen = [], [], [], {}
    for meta in rows.metadata:
        images = row_images(meta)
        if len(images) != len(row_images(rows.metadata[0])):  # ModelFamily.check_references refuses it at start-up
            raise RuntimeError("a reference cache needs as many images in every row")
        row = [_digest(image) for image in images]
        for image, digest in zip(images, row):
            if digest not in seen:
                seen[digest] = len(paths)
                paths.append(image)
        hashes.append(row)
        index.append([seen[digest] for digest in row])
    return paths, hashes, index


def references_file(cache_dir: str | Path, model_path: str, family: ModelFamily, hashes: list[list[str]],
                    resolution: int, stem: str) -> Path:
    """The cache file of rows whose images have the content hashes `hashes` (one list a row: the rows' images and
    their order, which the stored index records)."""
    stats = sorted((str(f.relative_to(model_path)), f.stat().st_size, f.stat().st_mtime_ns)
                   for f in (Path(model_path) / "vae").glob("*") if f.is_file())
    key = json.dumps([family.name, resolution, stats, hashes]).encode()
    return Path(cache_dir) / f"{stem}-ref-{hashlib.sha256(key).hexdigest()[:12]}.safetensors"


def ensure_references(model_path: str, prompt_file: str, rows: PromptSet, cache_dir: str | Path, resolution: int,
                      device: torch.device) -> Path | None:
    """The reference cache of dataset `rows` (read from `prompt_file`), encoding it first if it is not there yet;
    None for a dataset without images."""
    if not any(row_images(meta) for meta in rows.metadata):
        return None
    family = family_of(model_path)
    paths, hashes, index = _distinct(rows)
    path = references_file(cache_dir, model_path, family, hashes, resolution, Path(prompt_file).stem)
    if path.is_file():
        return path
    log.info("encoding %d source images of %s into %s", len(paths), prompt_file, path)
    # float32, whatever the model's dtype: encoded once, the cache is cast to the transformer's dtype per call
    vae = family.vae_class().from_pretrained(model_path, subfolder="vae", dtype=torch.float32).to(device).eval()
    latents = torch.cat([family.encode_references(vae, paths[i : i + 16], resolution, device)
                         for i in range(0, len(paths), 16)])
    del vae
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"latents": latents.contiguous(), "index": torch.tensor(index, dtype=torch.int64)}, str(tmp),
              metadata={"resolution": str(resolution)})
    tmp.replace(path)  # atomic: a reader never sees half a cache
    return path


def load_references(path: str | Path, rows: PromptSet) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents [U, Sr, C], index [P, k]) of the cache at `path`, checked against the dataset it is loaded for."""
    tensors = load_file(str(path))
    if len(tensors["index"]) != len(rows):  # the name hashes every row's image: only a bug gets here
        raise RuntimeError(f"{path} holds {len(tensors['index'])} rows, the dataset {len(rows)}")
    return tensors["latents"], tensors["index"]
