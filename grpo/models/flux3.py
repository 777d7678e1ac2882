"""FLUX.3 (Flux3ModularPipeline, diffusers 0.42): prompts as a stack of eight Qwen3-VL hidden states, one prompt per
text-encoder call right-padded to a multiple of 80 tokens, the VAE's 2x2-patchified latents flattened to tokens
(no helper: `latents.flatten(2).transpose(1, 2)`), 4-axis RoPE ids (T, H, W, L) with the image's H and W scaled by
0.5 and the text advancing along L, a constant time shift of 6.93 on the scheduler, true CFG through the pipeline's
`ClassifierFreeGuidance` guider, no guidance embedding.

FLUX.3 has no classic DiffusionPipeline: a folder is the modular pipeline's save (`modular_model_index.json`, the
components in subfolders, the scheduler and the guider built from the blocks' own specs), and everything here is
that pipeline's own code: its blocks' static helpers (`Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds`,
`Flux3TextRoPEInputsStep._prepare_text_ids`, `before_denoise._prepare_image_ids`, `Flux3DecodeStep._unpatchify_
latents`) and their configured constants (the image RoPE scale, the shift), so the sampler reproduces the pipeline
from the same noise and embeddings (tests/unit/test_flux3.py).

Prompt length: the pipeline pads each prompt to the next multiple of 80 of its own length; a micro-batch is one tensor,
so here every prompt is padded to data.max_sequence_length (the same function with pad_multiple set to it). That is
the pipeline's encoding whenever max_sequence_length is the prompt's own multiple of 80 (80 for every world prompt of
the tiny FLUX.3); a longer setting only adds pad tokens, as the pipeline adds them to longer prompts.

Reference images (editing, the transformer's `image_cond_hidden_states` mode): each encoded by the pipeline's own
Flux3VaeEncoderStep at the preset's square resolution, packed as Flux3PrepareImageCondLatentsStep packs them, with
its ids (L = -1, -2, ... one value a reference) beside the noisy tokens' L = 0; up to 4 a row (this project's cap, as
FLUX.2's; BFL: up to 10). The step-distilled flow map (Flux3DistilledModularPipeline, `flow_map: true`) is refused in
one line: its transformer also takes the timestep each step jumps to, so it is not the velocity field the objectives'
math assumes.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from grpo import sde
from grpo.errors import ConfigError
from grpo.models.base import Conditioning, ModelFamily


@functools.cache
def _steps():
    """The blocks whose helpers and configured constants the family reuses (one instance each)."""
    from diffusers.modular_pipelines.flux3 import before_denoise, decoders, encoders

    return dict(text=encoders.Flux3TextEncoderStep(), latents=before_denoise.Flux3PrepareLatentsStep(),
                decode=decoders.Flux3DecodeStep(), image_ids=before_denoise._prepare_image_ids,
                text_ids=before_denoise.Flux3TextRoPEInputsStep)


class Flux3(ModelFamily):
    # -- loading ------------------------------------------------------------------------------------------------
    def check_folder(self, model_path: str) -> None:
        """The flow map (step-distilled FLUX.3) refused in one line, before any weight is read."""
        if self.transformer_class().load_config(Path(model_path) / "transformer").get("flow_map", False):
            raise ConfigError(f"model.path: {model_path} is the step-distilled FLUX.3 (transformer flow_map: true), a "
                              "flow map that also takes the timestep each step jumps to, not the velocity field the "
                              "objectives assume; train the FLUX.3 base (flow_map: false)")

    def modular_pipeline(self, model_path: str):
        """The folder's Flux3ModularPipeline, no component loaded (the from-config ones, scheduler and guider, are
        built from the blocks' specs)."""
        return self.pipeline_class().from_pretrained(model_path)

    def scheduler(self, model_path: str):
        """The scheduler the pipeline samples with: the folder's, or the one Flux3SetTimestepsStep's spec builds
        (FlowMatchEulerDiscreteScheduler with shift 6.93) when the folder saved none."""
        pipe = self.modular_pipeline(model_path)
        if pipe.scheduler is None:
            pipe.load_components(names=["scheduler"])
        return pipe.scheduler

    def text_pipeline(self, model_path: str, dtype: torch.dtype, placed: dict):
        pipe = self.modular_pipeline(model_path)
        pipe.load_components(names=[f for f in ("text_encoder", "tokenizer") if f not in placed], dtype=dtype)
        if placed:
            pipe.update_components(**placed)
        return pipe

    # -- prompts ------------------------------------------------------------------------------------------------
    def encode_chunk(self, pipe, prompts, max_sequence_length, device):
        """Flux3TextEncoderStep's encoding (chat template, hidden states of layers 4, 8, ..., 32 stacked), one prompt
        a call as the step does, padded to max_sequence_length (module docstring)."""
        encode = _steps()["text"]._get_qwen3_vl_prompt_embeds
        return {"prompt_embeds": torch.cat([
            encode(pipe.text_encoder, pipe.tokenizer, p, device=device, max_sequence_length=max_sequence_length,
                   pad_multiple=max_sequence_length) for p in prompts])}

    # -- latents, conditioning, the transformer call ------------------------------------------------------------
    def noise_shape(self, latent_channels: int, latent_size: int) -> tuple[int, ...]:
        # Flux3PrepareLatentsStep draws (in_channels, h/2, w/2): the patchified latent, as FLUX.2 does.
        return (4 * latent_channels, latent_size // 2, latent_size // 2)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 4C, h/2, w/2] -> [B, (h/2)(w/2), 4C] (Flux3PrepareLatentsStep: `latents.flatten(2).transpose(1, 2)`)."""
        return latents.flatten(2).transpose(1, 2)

    def image_ids(self, latent_size: int, device: torch.device) -> torch.Tensor:
        """[S, 4] float32 (T, H, W, L) of the noisy tokens: _prepare_image_ids at the step's image_rope_scale."""
        side = latent_size // 2
        return _steps()["image_ids"](side, side, _steps()["latents"].image_rope_scale).to(device)

    def conditioning(self, embeds, latent_size, guidance, guidance_embeds, device, dtype) -> Conditioning:
        prompt_embeds = embeds["prompt_embeds"]
        cond = Conditioning(prompt_embeds=prompt_embeds.to(device=device, dtype=dtype),
                            txt_ids=_steps()["text_ids"]._prepare_text_ids(prompt_embeds[:1]).to(device),
                            img_ids=self.image_ids(latent_size, device), guidance=None)  # no guidance embedding
        return self.with_references(cond, embeds, latent_size, device, dtype)

    def reference_ids(self, latent_size: int, images: int, device: torch.device) -> torch.Tensor:
        """[images Sr, 4] ids of the references on the noisy grid, the i-th at L = -(1 + i)
        (Flux3PrepareImageCondLatentsStep)."""
        side = latent_size // 2
        scale = _steps()["latents"].image_rope_scale
        return torch.cat([_steps()["image_ids"](side, side, scale, l_coord=-(1 + i)) for i in range(images)]).to(device)

    @torch.no_grad()
    def encode_references(self, vae, paths, resolution, device) -> torch.Tensor:
        """[N, Sr, C] float32 on the CPU: each image resized and centre-cropped to the preset's square resolution (the
        image processor's own resize; an image of that size is left as the pipeline leaves it, a larger or non-square
        one the pipeline would keep whole on its own canvas), then the pipeline's Flux3VaeEncoderStep (posterior mode,
        patchified, batch-norm normalised) and Flux3PrepareImageCondLatentsStep's packing."""
        from diffusers.image_processor import VaeImageProcessor
        from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep
        from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
        from diffusers.utils import load_image

        processor = Flux3ImageProcessor()
        # the base class's preprocess at a fixed size: Flux3ImageProcessor's own one picks the size from the image
        images = [VaeImageProcessor.preprocess(processor, load_image(p), height=resolution, width=resolution,
                                               resize_mode="crop") for p in paths]
        encoder = Flux3VaeEncoderStep().init_pipeline()
        encoder.update_components(vae=vae)
        latents = encoder(condition_images=[i.to(device) for i in images], output="image_cond_latents")
        return torch.cat([self.pack(z) for z in latents]).float().cpu()

    def velocity(self, model, latents, timestep, cond) -> torch.Tensor:
        """Flux3LoopDenoiser's call: timestep in [0, 1], no guidance input (CFG is the sampler's, as the guider's);
        the reference tokens, if any, in their own mode (`image_cond_hidden_states`), not appended to the noisy ones."""
        dtype = cond.prompt_embeds.dtype
        refs = {} if cond.ref_latents is None else dict(image_cond_hidden_states=cond.ref_latents,
                                                          image_cond_ids=cond.ref_ids)
        return model(hidden_states=latents.to(dtype), encoder_hidden_states=cond.prompt_embeds,
                     timestep=timestep.to(dtype), img_ids=cond.img_ids, txt_ids=cond.txt_ids, **refs,
                     return_dict=False)[0].float()

    def example_inputs(self, config, batch, image_tokens, text_tokens, dtype, device="meta") -> dict:
        t = lambda *shape: torch.randn(*shape, device=device).to(dtype)  # noqa: E731
        ids = lambda n: torch.zeros(n, 4, device=device)  # noqa: E731 -- float32 ids, as the pipeline's
        return dict(hidden_states=t(batch, image_tokens, config["in_channels"]),
                    encoder_hidden_states=t(batch, text_tokens, config["joint_attention_dim"]), timestep=t(batch),
                    img_ids=ids(image_tokens), txt_ids=ids(text_tokens), return_dict=False)

    def to_vae_latents(self, vae, packed, resolution, vae_scale_factor) -> torch.Tensor:
        """Tokens back on their grid (Flux3UnpackLatentsStep), the batch-norm normalisation undone and unpatchified
        (Flux3DecodeStep)."""
        side = resolution // (vae_scale_factor * 2)
        latents = packed.view(len(packed), side, side, packed.shape[-1]).permute(0, 3, 1, 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                              latents.dtype)
        return _steps()["decode"]._unpatchify_latents(latents * std + mean)

    # -- the schedule ---------------------------------------------------------------------------------------------
    def shift_mu(self, image_seq_len: int, num_steps: int, scheduler_config: dict) -> float:
        """No dynamic shift: the scheduler's constant `shift` (6.93, Flux3SetTimestepsStep's spec), as the mu with
        exp(mu) = shift; the scheduler (use_dynamic_shifting false) ignores mu and shifts by its own `shift`."""
        return math.log(scheduler_config["shift"])

    def dynamic_sigmas(self, num_steps: int, image_seq_len: int, scheduler_config: dict) -> torch.Tensor:
        """Flux3SetTimestepsStep's schedule: sigmas linspace(1, 1/N, N) through the constant-shift scheduler."""
        if scheduler_config.get("use_dynamic_shifting"):
            raise ConfigError("model.path: a FLUX.3 scheduler with use_dynamic_shifting; Flux3ModularPipeline shifts "
                              "by the constant `shift`")
        return sde.dynamic_sigmas(num_steps, self.shift_mu(image_seq_len, num_steps, scheduler_config),
                                  scheduler_config)


FLUX3 = Flux3(name="flux3", pipelines=("Flux3ModularPipeline", "Flux3DistilledModularPipeline"), transformer="Flux3Transformer2DModel",
              vae="AutoencoderKLFlux2", text_folders=("text_encoder",), embed_keys=("prompt_embeds",),
              references=(0, 4))  # up to 4 reference images a row: this project's cap, as FLUX.2's
