"""FLUX.1 (FluxPipeline: FLUX.1-dev, FLUX.1-schnell, the tiny world): CLIP + T5 prompts, 2x2-packed 16-channel
latents with 3-axis RoPE ids, a guidance embedding, the VAE's scaling and shift factors.

Everything goes through diffusers' own classes and FluxPipeline's static helpers, so a local tiny folder and
black-forest-labs/FLUX.1-dev load and run through exactly the same code.
"""

from __future__ import annotations

import torch

from grpo.models.base import Conditioning, ModelFamily


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
              text_folders=("text_encoder", "text_encoder_2"), embed_keys=("prompt_embeds", "pooled"))
