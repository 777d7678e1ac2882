"""FLUX plumbing: loading the pipeline parts, latent packing, ids, the transformer call and VAE decoding.

Everything goes through diffusers' own classes and FluxPipeline's static helpers, so a local tiny folder and
black-forest-labs/FLUX.1-dev load and run through exactly the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.image_processor import VaeImageProcessor


@dataclass
class FluxParts:
    """The pieces of a FLUX pipeline the trainer needs (text encoders are not among them)."""

    transformer: FluxTransformer2DModel
    vae: AutoencoderKL
    scheduler_config: dict
    vae_scale_factor: int

    def latent_size(self, resolution: int) -> int:
        """Side of the (unpacked) VAE latent grid; FluxPipeline.prepare_latents' arithmetic."""
        return 2 * (resolution // (self.vae_scale_factor * 2))


def load_transformer(path: str, dtype: torch.dtype = torch.float32) -> FluxTransformer2DModel:
    return FluxTransformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)


def load_parts(path: str, vae_dtype: torch.dtype = torch.float32, transformer_dtype: torch.dtype = torch.float32,
               transformer_loader=load_transformer) -> FluxParts:
    """Load the transformer (to be handed to DeepSpeed), the frozen VAE and the scheduler config.

    `transformer_loader(path, dtype)`: from_pretrained by default; grpo.loading.transformer_loader gives the sharded
    (zero.Init) one.
    """
    transformer = transformer_loader(path, transformer_dtype)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=vae_dtype)
    vae.requires_grad_(False).eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
    vsf = 2 ** (len(vae.config.block_out_channels) - 1)
    return FluxParts(transformer, vae, dict(scheduler.config), vsf)


def checkpointed_blocks(transformer: torch.nn.Module, every: bool | int) -> list[torch.nn.Module]:
    """The transformer blocks whose activations are recomputed: all (True or 1), every k-th (k), none (False/0).

    Blocks are counted double blocks first, then single blocks, and block 0 is always among them (k >= 1).
    """
    k = int(every)
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    return [b for i, b in enumerate(blocks) if k > 0 and i % k == 0]


def enable_checkpointing(transformer: torch.nn.Module, every: bool | int) -> None:
    """Activation checkpointing of the update's forward for all blocks (True) or every k-th block (k).

    diffusers calls `_gradient_checkpointing_func(block, *args)` for every block when checkpointing is on; ours
    recomputes the chosen blocks with torch's non-reentrant checkpoint (diffusers' default) and runs the others
    plainly, so k trades memory (~1/k of the blocks' activations kept) for recompute (~1/k of a forward).
    """
    from torch.utils.checkpoint import checkpoint

    chosen = {id(b) for b in checkpointed_blocks(transformer, every)}
    if not chosen:
        return

    def checkpoint_some(block: torch.nn.Module, *args):
        if id(block) in chosen:
            return checkpoint(block.__call__, *args, use_reentrant=False)
        return block(*args)

    transformer.enable_gradient_checkpointing(checkpoint_some)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C] (FluxPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, b, c, h, w)


def unpack(latents: torch.Tensor, resolution: int, vae_scale_factor: int) -> torch.Tensor:
    """[B, S, 4C] -> [B, C, h, w] (FluxPipeline._unpack_latents)."""
    return FluxPipeline._unpack_latents(latents, resolution, resolution, vae_scale_factor)


def image_ids(latent_size: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[S, 3] RoPE positions of the packed image tokens (FluxPipeline._prepare_latent_image_ids)."""
    return FluxPipeline._prepare_latent_image_ids(1, latent_size // 2, latent_size // 2, device, dtype)


@dataclass
class Conditioning:
    """Transformer inputs that do not change along a trajectory."""

    prompt_embeds: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor  # [B, Dp]
    txt_ids: torch.Tensor  # [L, 3]
    img_ids: torch.Tensor  # [S, 3]
    guidance: torch.Tensor | None  # [B] float32, None for models without a guidance embedding

    def select(self, rows: slice | torch.Tensor) -> "Conditioning":
        guidance = None if self.guidance is None else self.guidance[rows]
        return Conditioning(self.prompt_embeds[rows], self.pooled[rows], self.txt_ids, self.img_ids, guidance)


def make_conditioning(prompt_embeds: torch.Tensor, pooled: torch.Tensor, latent_size: int, guidance: float,
                      guidance_embeds: bool, device: torch.device, dtype: torch.dtype) -> Conditioning:
    b, length = prompt_embeds.shape[:2]
    return Conditioning(
        prompt_embeds=prompt_embeds.to(device=device, dtype=dtype),
        pooled=pooled.to(device=device, dtype=dtype),
        txt_ids=torch.zeros(length, 3, device=device, dtype=dtype),
        img_ids=image_ids(latent_size, device, dtype),
        # FluxPipeline builds guidance in float32 whatever the model dtype; so do we.
        guidance=torch.full((b,), guidance, device=device, dtype=torch.float32) if guidance_embeds else None,
    )


def velocity(model: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor,
             cond: Conditioning) -> torch.Tensor:
    """One transformer call, with FluxPipeline's argument conventions; returns float32 velocity [B, S, 4C].

    `timestep` is sigma (diffusers multiplies by 1000 inside); `latents` float32, cast to the model's dtype.
    """
    dtype = cond.prompt_embeds.dtype
    out = model(
        hidden_states=latents.to(dtype),
        timestep=timestep.to(dtype),
        guidance=cond.guidance,
        pooled_projections=cond.pooled,
        encoder_hidden_states=cond.prompt_embeds,
        txt_ids=cond.txt_ids,
        img_ids=cond.img_ids,
        return_dict=False,
    )[0]
    return out.float()


_POSTPROCESS = VaeImageProcessor(do_normalize=True)


@torch.no_grad()
def decode(vae: AutoencoderKL, packed: torch.Tensor, resolution: int, vae_scale_factor: int) -> torch.Tensor:
    """Packed latents -> images [B, 3, H, W] in [0, 1], exactly as FluxPipeline(output_type="pt") decodes."""
    latents = unpack(packed, resolution, vae_scale_factor)
    latents = latents / vae.config.scaling_factor + vae.config.shift_factor
    home = next(vae.parameters()).device
    if home != packed.device:  # an offloaded VAE (model.offload_vae) visits the device for this call only
        vae.to(packed.device)
    try:
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    finally:
        if home != packed.device:
            vae.to(home)
    return _POSTPROCESS.postprocess(image, output_type="pt").float()


def compile_blocks(transformer: torch.nn.Module, enabled: bool) -> None:
    """Regional compilation (model.compile): torch.compile every double and single block in place, the way
    diffusers' compile_repeated_blocks does it. Blocks of one class share their compiled code (torch inlines the
    module's parameters as graph inputs), so compile time is that of two blocks, not of the whole model, and the
    model keeps its own forward, hooks (DeepSpeed's gather/release, diffusers' checkpointing) and state_dict names.
    Compilation happens lazily, on the first forward of each shape and grad mode (see compile_seconds)."""
    if enabled:
        transformer.compile_repeated_blocks()


def compile_seconds() -> float:
    """Seconds spent compiling in this process so far (dynamo tracing + inductor codegen), for time/compile_s."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", ()))
