"""What a model family is to the trainer: one small interface, implemented once per family (grpo/models/flux1.py,
grpo/models/flux2.py).

The recipe, the sampler, eval, export, the planner and the tools reach diffusers' model classes only through a
:class:`ModelFamily`; the family of a model folder comes from its ``model_index.json`` (grpo.models.family_of).
What stays here is what the families share: their transformers are double-stream blocks then single-stream blocks
(``transformer_blocks``, ``single_transformer_blocks``), so block fetching, checkpointing and regional compilation
are written once.
"""

from __future__ import annotations

import collections
import functools
import gc
import importlib
import inspect
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from grpo import sde
from grpo.errors import ConfigError
from grpo.prompt_sets import row_images

log = logging.getLogger(__name__)


@dataclass
class Conditioning:
    """Transformer inputs that do not change along a trajectory, in the family's own layout."""

    prompt_embeds: torch.Tensor  # [B, L, D]
    txt_ids: torch.Tensor  # [L, 3] (FLUX.1) or [L, 4] (FLUX.2: T, H, W, L)
    img_ids: torch.Tensor  # [S, 3] or [S, 4]
    guidance: torch.Tensor | None  # [B] float32; None for models without a guidance embedding
    pooled: torch.Tensor | None = None  # [B, Dp]: FLUX.1's CLIP pooled projection; FLUX.2 has none
    # Reference images (FLUX.1-Kontext's source image, FLUX.2's reference images): their packed VAE latents,
    # appended after the noisy tokens of every transformer call, and their RoPE ids (Kontext: first coordinate 1;
    # FLUX.2: T = 10, 20, ...); None for text to image.
    ref_latents: torch.Tensor | None = None  # [B, Sr, C] in the model's dtype
    ref_ids: torch.Tensor | None = None  # [Sr, 3] or [Sr, 4], shared by the rows as img_ids is
    # True CFG (sampling.true_cfg): the same rows conditioned on the negative prompt (same ids and reference
    # images, as the pipelines' unconditional branch); None without CFG.
    negative: "Conditioning | None" = None

    def select(self, rows: slice | torch.Tensor) -> "Conditioning":
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return replace(self, prompt_embeds=self.prompt_embeds[rows], guidance=pick(self.guidance),
                       pooled=pick(self.pooled), ref_latents=pick(self.ref_latents),
                       negative=None if self.negative is None else self.negative.select(rows))


@dataclass
class Parts:
    """The pieces of a pipeline the trainer needs (text encoders are not among them)."""

    family: "ModelFamily"
    transformer: torch.nn.Module
    vae: torch.nn.Module
    scheduler_config: dict
    vae_scale_factor: int

    def latent_size(self, resolution: int) -> int:
        """Side of the VAE latent grid before 2x2 packing; the pipelines' prepare_latents arithmetic."""
        return 2 * (resolution // (self.vae_scale_factor * 2))


@dataclass(frozen=True)
class Placement:
    """How transformers' big-model loading spreads a text encoder (data.text_encoder_device_map).

    Attributes:
        device_map: "auto", "balanced" or "sequential" (transformers' names; auto is balanced there).
        max_memory: accelerate's {accelerator ordinal or "cpu": bytes or "16GiB"}; None = accelerate's defaults.
        offload_folder: where the layers that fit neither the accelerators nor host RAM are written.
    """

    device_map: str
    max_memory: dict | None
    offload_folder: str | None


def describe_encoder(folder: str, encoder: torch.nn.Module, device: torch.device) -> str:
    """One log line: the encoder's class, parameters, dtype and where it is: the modules of its hf_device_map per
    device (accelerate's integer devices are ordinals of `device`'s kind), or the one device of an encoder that was
    not split (transformers sets no map for those)."""
    count = sum(p.numel() for p in encoder.parameters())
    where = getattr(encoder, "hf_device_map", None)
    if where is None:
        placement = f"all on {next(encoder.parameters()).device}"
    else:
        per = collections.Counter(str(torch.device(device.type, d)) if isinstance(d, int) else d
                                  for d in where.values())
        placement = "modules per device: " + ", ".join(f"{d} {n}" for d, n in per.items())
    return f"{folder} ({type(encoder).__name__}): {count:,} parameters, {encoder.dtype}, {placement}"


INDEX_FILES = ("model_index.json", "modular_model_index.json")  # a DiffusionPipeline's save, a ModularPipeline's


def index_file(model_path: str | Path) -> Path:
    """The pipeline index of a diffusers folder: model_index.json, or a modular pipeline's modular_model_index.json
    (FLUX.3 has only a modular pipeline); the first name when neither is there."""
    found = [Path(model_path) / n for n in INDEX_FILES if (Path(model_path) / n).is_file()]
    return (found or [Path(model_path) / INDEX_FILES[0]])[0]


def _diffusers(name: str) -> type:
    import diffusers

    return getattr(diffusers, name)


@functools.cache
def _postprocess():
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(do_normalize=True)


@dataclass(frozen=True)
class ModelFamily:
    """One family of pipelines: FLUX.1 (FluxPipeline) or FLUX.2 (Flux2Pipeline, Flux2KleinPipeline).

    Attributes:
        name: the family's name (flux1, flux2) in logs and errors.
        pipelines: the ``model_index.json`` ``_class_name`` values it serves.
        transformer, vae: the diffusers class names of its transformer and VAE.
        text_folders: subfolders of the text encoders (their file stats key the prompt-embedding cache).
        embed_keys: the tensors one prompt's cache entry holds.
        references: (fewest, most) reference images a dataset row gives (its ``image``/``images`` fields); (0, 0)
            for text-to-image FLUX.1, (1, 1) for FLUX.1-Kontext's one source image, (0, 4) for FLUX.2's optional
            reference images.
        comfyui_modules: ComfyUI's (kohya on Black Forest Labs' module names) LoRA names of the transformer's modules
            (grpo/lora_files.py); None: that format is not written for the family.
    """

    name: str
    pipelines: tuple[str, ...]
    transformer: str
    vae: str
    text_folders: tuple[str, ...]
    embed_keys: tuple[str, ...]
    references: tuple[int, int] = (0, 0)
    comfyui_modules: dict | None = field(default=None, hash=False, compare=False, repr=False)

    # -- loading ------------------------------------------------------------------------------------------------
    def transformer_class(self) -> type:
        return _diffusers(self.transformer)

    def vae_class(self) -> type:
        return _diffusers(self.vae)

    def pipeline_class(self) -> type:
        """The diffusers pipeline of this family's folders (its prompt encoding, static helpers, LoRA format)."""
        return _diffusers(self.pipelines[0])

    def load_transformer(self, path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        return self.transformer_class().from_pretrained(path, subfolder="transformer", dtype=dtype)

    def meta_transformer(self, model_path: str) -> torch.nn.Module:
        """The transformer built from its config.json on the meta device (no weights): LoRA target checks."""
        cls = self.transformer_class()
        config = cls.load_config(Path(model_path) / "transformer")
        with torch.device("meta"):
            return cls.from_config(config)

    def load_parts(self, path: str, vae_dtype: torch.dtype = torch.float32,
                   transformer_dtype: torch.dtype = torch.float32,
                   transformer_loader: Callable[[str, torch.dtype], torch.nn.Module] | None = None) -> Parts:
        """The transformer (to be handed to DeepSpeed), the frozen VAE and the scheduler config.

        `transformer_loader(path, dtype)`: from_pretrained by default; grpo.loading.transformer_loader gives the
        sharded (zero.Init) one.
        """
        transformer = (transformer_loader or self.load_transformer)(path, transformer_dtype)
        vae = self.vae_class().from_pretrained(path, subfolder="vae", dtype=vae_dtype)
        vae.requires_grad_(False).eval()
        scheduler = self.scheduler(path)
        vsf = 2 ** (len(vae.config.block_out_channels) - 1)
        return Parts(self, transformer, vae, dict(scheduler.config), vsf)

    def scheduler(self, path: str):
        """The scheduler the family's pipeline samples with (its scheduler/ folder)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")

    def check_folder(self, model_path: str) -> None:
        """A one-line ConfigError for a folder of this family that the trainer cannot train (read from its configs,
        before any weight); none by default."""

    # -- prompts ------------------------------------------------------------------------------------------------
    def load_text_encoder(self, model_path: str, folder: str, dtype: torch.dtype,
                          placement: Placement) -> torch.nn.Module:
        """The text encoder in `folder` (the transformers class model_index.json names for it), its layers placed by
        transformers' big-model loading (accelerate's infer_auto_device_map and dispatch hooks)."""
        library, name = json.loads(index_file(model_path).read_text())[folder][:2]  # modular: [lib, name, spec]
        cls = getattr(importlib.import_module(library), name)
        return cls.from_pretrained(model_path, subfolder=folder, dtype=dtype, device_map=placement.device_map,
                                   max_memory=placement.max_memory, offload_folder=placement.offload_folder)

    @torch.no_grad()
    def encode_prompts(self, model_path: str, prompts: list[str], max_sequence_length: int, device: torch.device,
                       batch_size: int = 64, dtype: torch.dtype = torch.float32,
                       placement: Placement | None = None) -> dict[str, torch.Tensor]:
        """The pipeline's own prompt encoding of `prompts`: float32 CPU tensors named by `embed_keys`, [P, ...]. The
        text encoders are loaded in `dtype`, on `device` (or spread as `placement` says), and freed after."""
        placed = {folder: self.load_text_encoder(model_path, folder, dtype, placement)
                  for folder in self.text_folders} if placement else {}
        pipe = self.text_pipeline(model_path, dtype, placed)
        for folder in self.text_folders:
            encoder = getattr(pipe, folder)
            if folder not in placed:  # a dispatched model must not be moved: its hooks own the placement
                encoder.to(device)
            log.info("%s", describe_encoder(folder, encoder, device))
        chunks = [self.encode_chunk(pipe, prompts[i : i + batch_size], max_sequence_length, device)
                  for i in range(0, len(prompts), batch_size)]
        del pipe, placed
        gc.collect()  # accelerate's dispatch hooks tie each placed module to itself: only the collector frees them
        return {k: torch.cat([c[k].float().cpu() for c in chunks]) for k in self.embed_keys}

    def text_pipeline(self, model_path: str, dtype: torch.dtype, placed: dict):
        """The family's pipeline with its text encoders only (those of `placed` as given)."""
        return self.pipeline_class().from_pretrained(model_path, transformer=None, vae=None, dtype=dtype, **placed)

    def encode_chunk(self, pipe, prompts: list[str], max_sequence_length: int,
                     device: torch.device) -> dict[str, torch.Tensor]:
        """One call of the pipeline's encode_prompt: the tensors named by `embed_keys`."""
        raise NotImplementedError

    # -- reference images ---------------------------------------------------------------------------------------
    def check_references(self, rows, setting: str, source: str, model_path: str) -> None:
        """Every row of the dataset `rows` (a grpo.prompt_sets.PromptSet) gives as many images as this family takes;
        a one-line ConfigError names the first row that does not, before any model loads."""
        fewest, most = self.references
        pipeline = self.pipelines[0]
        first = None
        for where, meta in zip(rows.rows, rows.metadata):
            n = len(row_images(meta))
            if n and not most:
                raise ConfigError(f"{setting}: {source} {where} gives an image, but model.path {model_path} is a "
                                  f"{pipeline} (text to image), which takes none; drop the image/images fields, or "
                                  f"set model.path to an image-conditioned model (e.g. a FLUX.1-Kontext folder)")
            if n < fewest:
                raise ConfigError(f"{setting}: {source} {where} has no source image, but model.path {model_path} is a "
                                  f"{pipeline}, which edits one; give every row an \"image\" (a path relative to the "
                                  f"dataset)")
            if n > most:
                raise ConfigError(f"{setting}: {source} {where} gives {n} images, but a {pipeline} takes at most "
                                  f"{most}; keep {most} a row")
            first = first or (where, n)
            if n != first[1]:  # a micro-batch is one tensor: every row brings as many reference tokens
                raise ConfigError(f"{setting}: {source} {where} gives {n} images, {first[0]} gives {first[1]}; give "
                                  f"every row the same number of images")

    def vae_pipeline(self, vae: torch.nn.Module):
        """The family's pipeline with its VAE only: its image processor and VAE encoding, nothing else loaded."""
        cls = self.pipeline_class()
        others = [n for n, p in inspect.signature(cls.__init__).parameters.items()
                  if n not in ("self", "vae") and p.default is inspect.Parameter.empty]
        return cls(vae=vae, **dict.fromkeys(others))

    def encode_references(self, vae: torch.nn.Module, paths: list[str], resolution: int,
                          device: torch.device) -> torch.Tensor:
        """The images at `paths` as the pipeline encodes its reference images for `resolution`: packed float32 VAE
        latents [N, Sr, C] on the CPU (grpo/references.py caches them)."""
        raise NotImplementedError(f"{self.name} takes no reference images")

    def reference_tokens(self, image_tokens: int, images: int) -> int:
        """Reference tokens that `images` reference images a row add to `image_tokens` noisy ones (the planner's
        sequence length): each is encoded at the training resolution, as many tokens again."""
        return image_tokens * images

    # -- latents, conditioning, the transformer call ------------------------------------------------------------
    def noise_shape(self, latent_channels: int, latent_size: int) -> tuple[int, ...]:
        """The shape of one sample's starting noise as the pipeline draws it (before packing)."""
        raise NotImplementedError

    def latent_channels(self, transformer_config) -> int:
        """Channels of the VAE latent (before packing) the transformer works on."""
        return transformer_config.in_channels // 4

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's starting noise [B, ...] -> the transformer's tokens [B, S, C]."""
        raise NotImplementedError

    def conditioning(self, embeds: dict[str, torch.Tensor], latent_size: int, guidance: float,
                     guidance_embeds: bool, device: torch.device, dtype: torch.dtype) -> Conditioning:
        raise NotImplementedError

    def with_references(self, cond: Conditioning, embeds: dict[str, torch.Tensor], latent_size: int,
                        device: torch.device, dtype: torch.dtype) -> Conditioning:
        """`cond` with the rows' reference tokens from the cache (`embeds["ref_latents"]`, each image at the training
        resolution, so (latent_size / 2)^2 tokens an image) and the family's ids for them; `cond` as it is for a
        dataset without images (FLUX.2, FLUX.3: text to image and editing in one model)."""
        if "ref_latents" not in embeds:
            return cond
        refs = embeds["ref_latents"]
        images = refs.shape[1] // (latent_size // 2) ** 2
        return replace(cond, ref_latents=refs.to(device=device, dtype=dtype),
                       ref_ids=self.reference_ids(latent_size, images, device))

    def reference_ids(self, latent_size: int, images: int, device: torch.device) -> torch.Tensor:
        """[images Sr, axes] position ids of `images` reference images at the training resolution."""
        raise NotImplementedError

    def velocity(self, model: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor,
                 cond: Conditioning) -> torch.Tensor:
        """One transformer call with the pipeline's argument conventions; returns float32 velocity [B, S, C].

        `timestep` is sigma (diffusers multiplies by 1000 inside); `latents` float32, cast to the model's dtype.
        """
        dtype = cond.prompt_embeds.dtype
        hidden, img_ids = latents.to(dtype), cond.img_ids
        if cond.ref_latents is not None:
            # As FluxKontextPipeline (and Flux2KleinPipeline with reference images) call their transformer: the
            # reference tokens after the noisy ones, their ids after the noisy ids, the output cut back to the
            # noisy tokens. Text-to-image calls skip this, so their inputs and kernels stay what they were.
            hidden = torch.cat([hidden, cond.ref_latents], dim=1)
            img_ids = torch.cat([img_ids, cond.ref_ids], dim=0)
        out = model(hidden_states=hidden, timestep=timestep.to(dtype), guidance=cond.guidance,
                    encoder_hidden_states=cond.prompt_embeds, txt_ids=cond.txt_ids, img_ids=img_ids,
                    return_dict=False, **self.extra_inputs(cond))[0]
        if cond.ref_latents is not None:
            out = out[:, : latents.shape[1]]
        return out.float()

    def extra_inputs(self, cond: Conditioning) -> dict:
        """The family's own transformer inputs beyond the shared ones (none by default)."""
        return {}

    def velocity_of(self, model: torch.nn.Module):
        """:meth:`velocity` bound to `model`: the ``(x, timestep, cond) -> v`` the sampler calls."""
        return functools.partial(self.velocity, model)

    def to_vae_latents(self, vae: torch.nn.Module, packed: torch.Tensor, resolution: int,
                       vae_scale_factor: int) -> torch.Tensor:
        """Packed clean latents -> the VAE decoder's input [B, C, h, w] (unpacked, de-normalised)."""
        raise NotImplementedError

    @torch.no_grad()
    def decode(self, vae: torch.nn.Module, packed: torch.Tensor, resolution: int,
               vae_scale_factor: int) -> torch.Tensor:
        """Packed latents -> images [B, 3, H, W] in [0, 1], exactly as the pipeline (output_type="pt") decodes."""
        latents = self.to_vae_latents(vae, packed, resolution, vae_scale_factor)
        home = next(vae.parameters()).device
        if home != packed.device:  # an offloaded VAE (model.offload_vae) visits the device for this call only
            vae.to(packed.device)
        try:
            image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        finally:
            if home != packed.device:
                vae.to(home)
        return _postprocess().postprocess(image, output_type="pt").float()

    def example_inputs(self, config: dict, batch: int, image_tokens: int, text_tokens: int, dtype: torch.dtype,
                       device: torch.device | str = "meta") -> dict:
        """Keyword arguments of one transformer call with :meth:`velocity`'s shapes (the planner traces them)."""
        raise NotImplementedError

    # -- the schedule ---------------------------------------------------------------------------------------------
    def shift_mu(self, image_seq_len: int, num_steps: int, scheduler_config: dict) -> float:
        """The pipeline's dynamic time-shift parameter mu for `image_seq_len` packed tokens."""
        raise NotImplementedError

    def dynamic_sigmas(self, num_steps: int, image_seq_len: int, scheduler_config: dict) -> torch.Tensor:
        """The sigma schedule [num_steps + 1] the family's pipeline samples with (its dynamic shift)."""
        return sde.dynamic_sigmas(num_steps, self.shift_mu(image_seq_len, num_steps, scheduler_config),
                                  scheduler_config)

    # -- export ---------------------------------------------------------------------------------------------------
    def save_lora(self, out_dir: str | Path, state: dict[str, torch.Tensor], metadata: dict) -> None:
        """A diffusers LoRA file (pytorch_lora_weights.safetensors) for the pipeline's load_lora_weights."""
        self.pipeline_class().save_lora_weights(
            str(out_dir), transformer_lora_layers={k: v.contiguous() for k, v in state.items()},
            transformer_lora_adapter_metadata=metadata, safe_serialization=True)

    # -- blocks: ZeRO-3 fetching, checkpointing, compilation --------------------------------------------------
    @staticmethod
    def blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
        """The repeated blocks, as diffusers names their classes (`_repeated_blocks`, what compile_repeated_blocks
        compiles), in module order: FLUX.1/FLUX.2's double-stream blocks then single-stream blocks; FLUX.3's per-mode
        blocks (image, reference image, text) then its joint single blocks."""
        names = set(transformer._repeated_blocks)
        return [m for m in transformer.modules() if type(m).__name__ in names]
