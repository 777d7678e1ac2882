"""FLUX.1 (FluxPipeline: FLUX.1-dev, FLUX.1-schnell, the tiny world): CLIP + T5 prompts, 2x2-packed 16-channel
latents with 3-axis RoPE ids, a guidance embedding, the VAE's scaling and shift factors. FLUX.1-Kontext
(FluxKontextPipeline) is the same model family with each sample's source image as reference tokens.

Everything goes through diffusers' own classes and FluxPipeline's static helpers, so a local tiny folder and
black-forest-labs/FLUX.1-dev load and run through exactly the same code.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from grpo.models.base import Conditioning, ModelFamily


# ComfyUI's LoRA names (grpo/lora_files.py): (BFL module, diffusers modules it fuses along its output) per block
# kind; "{i}" is the block index
COMFYUI_MODULES = {
    "double_blocks_{i}_": ("transformer_blocks.{i}.", [
        ("img_attn_proj", ["attn.to_out.0"]),
        ("img_attn_qkv", ["attn.to_q", "attn.to_k", "attn.to_v"]),
        ("img_mlp_0", ["ff.net.0.proj"]), ("img_mlp_2", ["ff.net.2"]), ("img_mod_lin", ["norm1.linear"]),
        ("txt_attn_proj", ["attn.to_add_out"]),
        ("txt_attn_qkv", ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"]),
        ("txt_mlp_0", ["ff_context.net.0.proj"]), ("txt_mlp_2", ["ff_context.net.2"]),
        ("txt_mod_lin", ["norm1_context.linear"])]),
    "single_blocks_{i}_": ("single_transformer_blocks.{i}.", [
        ("linear1", ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]),
        ("linear2", ["proj_out"]), ("modulation_lin", ["norm.linear"])]),
    "": ("", [
        ("img_in", ["x_embedder"]), ("txt_in", ["context_embedder"]),
        ("time_in_in_layer", ["time_text_embed.timestep_embedder.linear_1"]),
        ("time_in_out_layer", ["time_text_embed.timestep_embedder.linear_2"]),
        ("guidance_in_in_layer", ["time_text_embed.guidance_embedder.linear_1"]),
        ("guidance_in_out_layer", ["time_text_embed.guidance_embedder.linear_2"]),
        ("vector_in_in_layer", ["time_text_embed.text_embedder.linear_1"]),
        ("vector_in_out_layer", ["time_text_embed.text_embedder.linear_2"])]),
}


class Flux1(ModelFamily):
    def encode_chunk(self, pipe, prompts, max_sequence_length, device):
        """FluxPipeline.encode_prompt: T5's sequence and CLIP's pooled embedding."""
        embeds, pooled, _ = pipe.encode_prompt(prompts, prompts, device=device, max_sequence_length=max_sequence_length)
        return {"prompt_embeds": embeds, "pooled": pooled}

    def noise_shape(self, latent_channels: int, latent_size: int) -> tuple[int, ...]:
        return (latent_channels, latent_size, latent_size)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> [B, (h/2)(w/2), 4C] (FluxPipeline._pack_latents)."""
        b, c, h, w = latents.shape
        return self.pipeline_class()._pack_latents(latents, b, c, h, w)

    def unpack(self, latents: torch.Tensor, resolution: int, vae_scale_factor: int) -> torch.Tensor:
        """[B, S, 4C] -> [B, C, h, w] (FluxPipeline._unpack_latents)."""
        return self.pipeline_class()._unpack_latents(latents, resolution, resolution, vae_scale_factor)

    def image_ids(self, latent_size: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[S, 3] RoPE positions of the packed image tokens (FluxPipeline._prepare_latent_image_ids)."""
        return self.pipeline_class()._prepare_latent_image_ids(1, latent_size // 2, latent_size // 2, device, dtype)

    def conditioning(self, embeds, latent_size, guidance, guidance_embeds, device, dtype) -> Conditioning:
        prompt_embeds = embeds["prompt_embeds"]
        b, length = prompt_embeds.shape[:2]
        return Conditioning(
            prompt_embeds=prompt_embeds.to(device=device, dtype=dtype),
            pooled=embeds["pooled"].to(device=device, dtype=dtype),
            txt_ids=torch.zeros(length, 3, device=device, dtype=dtype),
            img_ids=self.image_ids(latent_size, device, dtype),
            # FluxPipeline builds guidance in float32 whatever the model dtype; so do we.
            guidance=torch.full((b,), guidance, device=device, dtype=torch.float32) if guidance_embeds else None,
        )

    def extra_inputs(self, cond: Conditioning) -> dict:
        return {"pooled_projections": cond.pooled}  # CLIP's pooled prompt

    def example_inputs(self, config, batch, image_tokens, text_tokens, dtype, device="meta") -> dict:
        t = lambda *shape, dt=dtype: torch.randn(*shape, device=device).to(dt)  # noqa: E731
        return dict(hidden_states=t(batch, image_tokens, config["in_channels"]),
                    encoder_hidden_states=t(batch, text_tokens, config["joint_attention_dim"]),
                    pooled_projections=t(batch, config["pooled_projection_dim"]), timestep=t(batch),
                    guidance=t(batch, dt=torch.float32) if config.get("guidance_embeds") else None,
                    img_ids=t(image_tokens, 3), txt_ids=t(text_tokens, 3), return_dict=False)

    def to_vae_latents(self, vae, packed, resolution, vae_scale_factor) -> torch.Tensor:
        latents = self.unpack(packed, resolution, vae_scale_factor)
        return latents / vae.config.scaling_factor + vae.config.shift_factor

    def shift_mu(self, image_seq_len: int, num_steps: int, scheduler_config: dict) -> float:
        """FluxPipeline's calculate_shift: linear in the token count between the config's two anchors."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        c = scheduler_config
        return calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                               c.get("base_shift", 0.5), c.get("max_shift", 1.15))


FLUX1 = Flux1(name="flux1", pipelines=("FluxPipeline",), transformer="FluxTransformer2DModel", vae="AutoencoderKL",
              text_folders=("text_encoder", "text_encoder_2"), embed_keys=("prompt_embeds", "pooled"),
              comfyui_modules=COMFYUI_MODULES)


class Flux1Kontext(Flux1):
    """FLUX.1-Kontext: FLUX.1's transformer, prompts and schedule, with the source image's packed VAE latents appended
    after the noisy tokens of every call (ModelFamily.velocity), their RoPE ids those of the noisy grid with the first
    coordinate 1. FluxKontextPipeline's time shift counts the noisy tokens only, so shift_mu is FLUX.1's unchanged.

    The source image is resized to the preset's square resolution (sampling.resolution), so that its tokens are as
    many as the noisy ones and its ids the noisy grid's: the pipeline's own preprocessing (its image processor's
    resize and preprocess) called with _auto_resize=False at that size. FLUX.1-Kontext-dev's preferred square size is
    1024 x 1024, which is what the pipeline's default _auto_resize picks for a square source: at resolution 1024 a
    square source is encoded exactly as the pipeline's defaults encode it. A non-square source is stretched to the
    square (the pipeline would keep its aspect); every row's references then have one shape, and a micro-batch of
    different source images stays one tensor.
    """

    @torch.no_grad()
    def encode_references(self, vae: torch.nn.Module, paths: list[str], resolution: int,
                          device: torch.device) -> torch.Tensor:
        from diffusers.utils import load_image

        pipe = self.vae_pipeline(vae)
        packed = []
        for path in paths:
            # load_image converts to RGB, as a pipeline user's image usually is
            image = pipe.image_processor.resize(load_image(path), resolution, resolution)
            image = pipe.image_processor.preprocess(image, resolution, resolution).to(device=device, dtype=vae.dtype)
            latents = pipe._encode_vae_image(image, generator=None)  # the mode of the posterior, normalised
            b, c, h, w = latents.shape
            packed.append(self.pipeline_class()._pack_latents(latents, b, c, h, w)[0].float().cpu())
        return torch.stack(packed)

    def reference_ids(self, latent_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[Sr, 3]: the noisy grid's ids with the first coordinate 1 (FluxKontextPipeline.prepare_latents)."""
        ids = self.image_ids(latent_size, device, dtype)
        ids[..., 0] = 1
        return ids

    def conditioning(self, embeds, latent_size, guidance, guidance_embeds, device, dtype) -> Conditioning:
        if "ref_latents" not in embeds:
            raise RuntimeError("a FLUX.1-Kontext conditioning without source-image latents: load the prompt cache "
                               "with its references (grpo.prompts.load_cache(..., references=...))")
        cond = super().conditioning(embeds, latent_size, guidance, guidance_embeds, device, dtype)
        return replace(cond, ref_latents=embeds["ref_latents"].to(device=device, dtype=dtype),
                       ref_ids=self.reference_ids(latent_size, device, dtype))


FLUX1_KONTEXT = Flux1Kontext(name="flux1-kontext", pipelines=("FluxKontextPipeline",),
                             transformer="FluxTransformer2DModel", vae="AutoencoderKL",
                             text_folders=("text_encoder", "text_encoder_2"), embed_keys=("prompt_embeds", "pooled"),
                             references=(1, 1), comfyui_modules=COMFYUI_MODULES)
