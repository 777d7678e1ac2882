"""Prompt files and the precomputed prompt-embedding cache (DanceGRPO's preprocessing step).

Training never holds the text encoders: `python -m tools.prompts CONFIG [key=value ...]` encodes the train and eval
prompt files once with the pipeline's own `encode_prompt` (through the model family, grpo.models) into safetensors
files under `data.cache_dir`, named by a hash of (model, max_sequence_length, prompts), so a changed prompt file or
model never reads a stale cache. The prompt files may be datasets with per-sample metadata (grpo/prompt_sets.py);
the metadata is read from the dataset with the cache, never stored in it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from grpo.device import accelerator, resolve_dtype
from grpo.models import family_of
from grpo.models.base import Placement
from grpo.prompt_sets import PromptSet, read_prompt_file, read_prompt_set
from grpo.references import ensure_references, load_references
from grpo.settings import DataConfig, MemoryCaps, SamplingConfig

__all__ = ["PromptCache", "PromptSet", "read_prompt_file", "read_prompt_set", "cache_file", "encode", "save_cache",
           "load_cache", "ensure_cache", "ensure_negative", "ensure_references"]

log = logging.getLogger(__name__)


def cache_file(cache_dir: str | Path, model_path: str, prompts: list[str], max_sequence_length: int,
               stem: str, dtype: str = "fp32") -> Path:
    # The text encoders' file stats are in the key too: a rebuilt model at the same path gets a fresh cache.
    stats = sorted(
        (str(f.relative_to(model_path)), f.stat().st_size, f.stat().st_mtime_ns)
        for sub in family_of(model_path).text_folders
        for f in (Path(model_path) / sub).glob("*")
        if f.is_file()
    )
    # The encoder's dtype joins the key only when it is not fp32, so fp32 caches keep the names they had before
    # data.text_encoder_dtype existed.
    key = json.dumps([model_path, max_sequence_length, prompts, stats, *([dtype] if dtype != "fp32" else [])]).encode()
    return Path(cache_dir) / f"{stem}-{hashlib.sha256(key).hexdigest()[:12]}.safetensors"


@dataclass
class PromptCache:
    """Prompts and their embeddings, in the family's layout (FLUX.1: prompt_embeds [P, L, D] from T5 and pooled
    [P, Dp] from CLIP; FLUX.2: prompt_embeds [P, L, 3D], three hidden-state layers side by side)."""

    prompts: list[str]
    embeds: dict[str, torch.Tensor]
    # Row i's dataset fields other than its prompt (grpo/prompt_sets.py), handed to the rewards with prompt i
    metadata: list[dict] = field(default_factory=list)
    # The distinct source images' packed latents [U, Sr, C] and each prompt's k rows of them [P, k]
    # (grpo/references.py); None for a dataset without images
    references: torch.Tensor | None = None
    reference_index: torch.Tensor | None = None
    # True CFG's negative prompt (sampling.true_cfg.negative_prompt), encoded like the prompts: its embeddings
    # [1, ...], shared by every row; None while sampling.true_cfg is off
    negative: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if len(self.metadata) != len(self.prompts):
            raise ValueError(f"{len(self.metadata)} metadata rows for {len(self.prompts)} prompts")

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, idx: list[int]) -> dict[str, torch.Tensor]:
        """The embeddings of prompts `idx`, and their images' latents as "ref_latents" [B, k Sr, C] (a row's k images
        one after the other) when the dataset has images: a group's G samples of one prompt share them, by index."""
        out = {k: v[idx] for k, v in self.embeds.items()}
        if self.references is not None:
            out["ref_latents"] = self.references[self.reference_index[idx]].flatten(1, 2)
        return out


def encode(model_path: str, prompts: list[str], max_sequence_length: int, device: torch.device,
           batch_size: int = 64, dtype: torch.dtype = torch.float32, placement: Placement | None = None) -> PromptCache:
    """Encode prompts with the pipeline's own text encoders and encode_prompt (see grpo.models), then free them."""
    family = family_of(model_path)
    return PromptCache(prompts, family.encode_prompts(model_path, prompts, max_sequence_length, device,
                                                      batch_size, dtype, placement))


def max_memory(caps: MemoryCaps | None) -> dict | None:
    """accelerate's max_memory for data.text_encoder_max_memory: the device cap on every accelerator accelerate sees,
    the cpu cap on host RAM. A cap left null keeps accelerate's default for it (the free memory); no caps at all
    leave accelerate its own defaults (auto and balanced keep 10% of a lone accelerator free for the activations)."""
    if caps is None:
        return None
    from accelerate.utils import get_max_memory

    # Accelerate counts the accelerators itself (torch.cuda or torch.npu, honouring CUDA_/ASCEND_RT_VISIBLE_DEVICES)
    # and names them by ordinal; on Ascend its dispatch hooks turn ordinal i into npu:i, the device tools.prompts
    # encodes on being npu:0. A max_memory that named only the capped keys would give the others nothing.
    return {key: (caps.cpu if key == "cpu" else caps.device) or free for key, free in get_max_memory().items()}


def save_cache(cache: PromptCache, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in cache.embeds.items()}, str(tmp),
              metadata={"prompts": json.dumps(cache.prompts)})
    tmp.replace(path)  # atomic: a reader never sees half a cache


def load_cache(path: str | Path, rows: PromptSet | None = None, references: str | Path | None = None,
               negative: str | Path | None = None) -> PromptCache:
    """The cache at `path`, with the metadata of `rows` (the dataset it was encoded from) when given, the source
    images' latents of the reference cache `references` (grpo.references.ensure_references; None: no images) and the
    negative prompt's embeddings of the cache `negative` (:func:`ensure_negative`; None: CFG off)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        prompts = json.loads(f.metadata()["prompts"])
    if rows is not None and rows.prompts != prompts:  # the cache name hashes the prompts: only a bug gets here
        raise RuntimeError(f"{path} holds other prompts than the dataset it is loaded for")
    cache = PromptCache(prompts, load_file(str(path)), rows.metadata if rows is not None else [])
    if references is not None:
        cache.references, cache.reference_index = load_references(references, rows)
    if negative is not None:
        cache.negative = load_file(str(negative))
    return cache


def ensure_cache(model_path: str, prompt_file: str, setting: str, data: DataConfig, device: torch.device,
                 rows: PromptSet | None = None) -> Path:
    """Return the cache file for `prompt_file` under the preset's `data:` settings, encoding it first if it is not
    there yet. `rows`: the dataset already read from `prompt_file` (else it is read here)."""
    prompts = (rows or read_prompt_set(prompt_file, setting)).prompts
    return _ensure(model_path, prompts, Path(prompt_file).stem, prompt_file, data, device)


def ensure_negative(model_path: str, sampling: SamplingConfig, data: DataConfig, device: torch.device) -> Path | None:
    """The cache of true CFG's negative prompt, a one-prompt cache encoded like the prompts (Flux2KleinPipeline
    encodes its "" with the prompts' encode_prompt and max_sequence_length), encoding it first if it is not there
    yet; None while neither the rollouts (sampling.true_cfg) nor the evals (sampling.eval_cfg_scale) guide."""
    if sampling.negative_prompt is None:
        return None
    return _ensure(model_path, [sampling.negative_prompt], "negative", "sampling.true_cfg.negative_prompt", data,
                   device)


def _ensure(model_path: str, prompts: list[str], stem: str, source: str, data: DataConfig,
            device: torch.device) -> Path:
    path = cache_file(data.cache_dir, model_path, prompts, data.max_sequence_length, stem, data.text_encoder_dtype)
    if not path.is_file():
        log.info("encoding %d prompts of %s into %s", len(prompts), source, path)
        with _placement(data) as placement:
            save_cache(encode(model_path, prompts, data.max_sequence_length, device,
                              dtype=resolve_dtype(data.text_encoder_dtype), placement=placement), path)
    return path


@contextlib.contextmanager
def _placement(data: DataConfig) -> Iterator[Placement | None]:
    """data.text_encoder_device_map's placement, with a folder for the layers that fit neither the accelerators nor
    host RAM, removed after the encoding; None (the whole encoder on the recipe's device) when it is null.

    transformers reads disk-placed weights straight from the checkpoint's safetensors files (cast to the dtype as
    they are read), so the folder usually stays empty; it writes there only weights it cannot read in place (a .bin
    checkpoint, weights its loader converts), a copy of no use once the cache exists. It lies under data.cache_dir,
    the place chosen for large files, rather than in /tmp, often a RAM-backed tmpfs or a small root partition.
    """
    if data.text_encoder_device_map is None:
        yield None
        return
    Path(data.cache_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="offload-", dir=data.cache_dir) as offload:
        yield Placement(data.text_encoder_device_map, max_memory(data.text_encoder_max_memory), offload)
    # The recipe's rank 0 encodes a missing cache while the other ranks wait beside it: what its allocator kept cached
    # on their devices would be lost to them for the whole run.
    accelerator().empty_cache()
