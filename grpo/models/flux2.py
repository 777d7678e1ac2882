"""FLUX.2 (Flux2KleinPipeline: [klein] 4B/9B with a Qwen3 text encoder; Flux2Pipeline: [dev] 32B with Mistral-Small):
prompts as a stack of the text encoder's intermediate hidden states, 2x2-patchified latents normalised by the VAE's
batch-norm statistics, 4-axis RoPE ids (T, H, W, L), FLUX.2's empirical time shift; a guidance embedding in [dev]
only ([klein] is called with guidance=None).

All of it is the pipelines' own code (their static helpers, encode_prompt, compute_empirical_mu), so the sampler
reproduces Flux2KleinPipeline and Flux2Pipeline from the same noise and embeddings.

Reference images (the pipelines' `image` argument): a dataset whose rows give images (the same number in every row)
conditions each sample on its row's images, encoded as the pipelines encode them and appended after the noisy tokens
(ModelFamily.velocity), their ids with T = 10, 20, ... (_prepare_image_ids). Without images, nothing changes.
"""

from __future__ import annotations

import torch

from grpo.models.base import Conditioning, ModelFamily


# ComfyUI's LoRA names (grpo/lora_files.py): (BFL module, diffusers modules it fuses along its output) per block
# kind; "{i}" is the block index
COMFYUI_MODULES = {
    "double_blocks_{i}_": ("transformer_blocks.{i}.", [
        ("img_attn_proj", ["attn.to_out.0"]),
        ("img_attn_qkv", ["attn.to_q", "attn.to_k", "attn.to_v"]),
        ("txt_attn_proj", ["attn.to_add_out"]),
        ("txt_attn_qkv", ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"]),
        ("img_mlp_0", ["ff.linear_in"]), ("img_mlp_2", ["ff.linear_out"]),
        ("txt_mlp_0", ["ff_context.linear_in"]), ("txt_mlp_2", ["ff_context.linear_out"])]),
    "single_blocks_{i}_": ("single_transformer_blocks.{i}.", [
        ("linear1", ["attn.to_qkv_mlp_proj"]), ("linear2", ["attn.to_out"])]),
    "": ("", [
        ("img_in", ["x_embedder"]), ("txt_in", ["context_embedder"]),
        ("time_in_in_layer", ["time_guidance_embed.timestep_embedder.linear_1"]),
        ("time_in_out_layer", ["time_guidance_embed.timestep_embedder.linear_2"]),
        ("final_layer_linear", ["proj_out"])]),
}


class Flux2(ModelFamily):
    def encode_chunk(self, pipe, prompts, max_sequence_length, device):
        """The pipeline's encode_prompt (klein: Qwen3 chat template, hidden states of layers 9, 18, 27 stacked; [dev]:
        Mistral3 after the pipeline's system message, layers 10, 20, 30)."""
        embeds, _ = pipe.encode_prompt(prompts, device=device, max_sequence_length=max_sequence_length)
        return {"prompt_embeds": embeds}

    def noise_shape(self, latent_channels: int, latent_size: int) -> tuple[int, ...]:
        # Flux2 pipelines draw the noise already patchified: [4C, h/2, w/2] (prepare_latents).
        return (4 * latent_channels, latent_size // 2, latent_size // 2)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 4C, h/2, w/2] -> [B, (h/2)(w/2), 4C] (Flux2 pipelines' _pack_latents)."""
        return self.pipeline_class()._pack_latents(latents)

    def image_ids(self, latent_size: int, device: torch.device) -> torch.Tensor:
        """[S, 4] (T, H, W, L) positions of the packed image tokens (_prepare_latent_ids), int64 as the pipeline's."""
        grid = torch.empty(1, 1, latent_size // 2, latent_size // 2)
        return self.pipeline_class()._prepare_latent_ids(grid)[0].to(device)

    def conditioning(self, embeds, latent_size, guidance, guidance_embeds, device, dtype) -> Conditioning:
        prompt_embeds = embeds["prompt_embeds"]
        cond = Conditioning(
            prompt_embeds=prompt_embeds.to(device=device, dtype=dtype),
            txt_ids=self.pipeline_class()._prepare_text_ids(prompt_embeds[:1])[0].to(device),
            img_ids=self.image_ids(latent_size, device),
            # Flux2Pipeline ([dev]) builds guidance in float32; Flux2KleinPipeline passes None.
            guidance=(torch.full((len(prompt_embeds),), guidance, device=device, dtype=torch.float32)
                      if guidance_embeds else None),
        )
        return self.with_references(cond, embeds, latent_size, device, dtype)

    def reference_ids(self, latent_size: int, images: int, device: torch.device) -> torch.Tensor:
        """[images Sr, 4] ids of `images` reference images on the noisy grid, T = 10, 20, ... (_prepare_image_ids)."""
        grid = torch.empty(1, 1, latent_size // 2, latent_size // 2)
        return self.pipeline_class()._prepare_image_ids([grid] * images)[0].to(device)

    @torch.no_grad()
    def encode_references(self, vae, paths, resolution, device) -> torch.Tensor:
        """The pipelines' reference encoding at the preset's square resolution: the image processor's preprocess
        with resize_mode="crop" (what the pipeline does to an image of that size; a larger or non-square one is
        resized and centre-cropped to the square here, where the pipeline would keep its size up to 1 megapixel and
        its aspect), the posterior's mode, patchified and batch-norm normalised (_encode_vae_image), packed."""
        from diffusers.utils import load_image

        pipe = self.vae_pipeline(vae)
        packed = []
        for path in paths:
            image = pipe.image_processor.preprocess(load_image(path), height=resolution, width=resolution,
                                                    resize_mode="crop")
            latents = pipe._encode_vae_image(image.to(device=device, dtype=vae.dtype), generator=None)
            packed.append(pipe._pack_latents(latents)[0].float().cpu())
        return torch.stack(packed)

    def example_inputs(self, config, batch, image_tokens, text_tokens, dtype, device="meta") -> dict:
        t = lambda *shape, dt=dtype: torch.randn(*shape, device=device).to(dt)  # noqa: E731
        ids = lambda n: torch.zeros(n, 4, device=device, dtype=torch.int64)  # noqa: E731
        return dict(hidden_states=t(batch, image_tokens, config["in_channels"]),
                    encoder_hidden_states=t(batch, text_tokens, config["joint_attention_dim"]), timestep=t(batch),
                    guidance=t(batch, dt=torch.float32) if config.get("guidance_embeds", True) else None,
                    img_ids=ids(image_tokens), txt_ids=ids(text_tokens), return_dict=False)

    def to_vae_latents(self, vae, packed, resolution, vae_scale_factor) -> torch.Tensor:
        """Scatter the tokens back by their ids, undo the batch-norm normalisation, unpatchify (the pipeline's end)."""
        pipe = self.pipeline_class()
        side = 2 * (resolution // (vae_scale_factor * 2)) // 2
        ids = self.image_ids(2 * side, packed.device).expand(len(packed), -1, -1)
        # Without the grid's height and width, which Flux2Pipeline's version does not take (klein's only uses them to
        # skip reading the ids' maximum back from the device).
        latents = pipe._unpack_latents_with_ids(packed, ids)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                              latents.dtype)
        return pipe._unpatchify_latents(latents * std + mean)

    def shift_mu(self, image_seq_len: int, num_steps: int, scheduler_config: dict) -> float:
        """FLUX.2's empirical mu (compute_empirical_mu): fitted to the token count and the number of steps."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps)


# Up to 4 reference images a row: this project's cap (each one adds the noisy sequence again), not a pipeline limit.
_FLUX2 = dict(name="flux2", transformer="Flux2Transformer2DModel", vae="AutoencoderKLFlux2",
              text_folders=("text_encoder",), embed_keys=("prompt_embeds",), references=(0, 4))
FLUX2_KLEIN = Flux2(pipelines=("Flux2KleinPipeline",), comfyui_modules=COMFYUI_MODULES, **_FLUX2)
FLUX2_DEV = Flux2(pipelines=("Flux2Pipeline",), comfyui_modules=COMFYUI_MODULES, **_FLUX2)
