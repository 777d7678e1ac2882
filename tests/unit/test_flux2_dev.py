"""The sampler on FLUX.2 [dev] against diffusers' own Flux2Pipeline (Mistral3 text encoder with a system message,
a guidance embedding), through the same model-family layer and preset path the recipe uses, on the untrained tiny
[dev] folder (the `tiny_flux2_dev` fixture)."""

import pytest
import torch
from diffusers import Flux2Pipeline

from grpo.config import load_config
from grpo.models import family_of
from grpo.models.flux2 import FLUX2_DEV
from grpo.prompts import PromptCache
from grpo.rollout import FluxSampler
from tests import ROOT
from maintainer.tiny_worlds.flux2 import DEV_GUIDANCE, DEV_MAX_SEQUENCE_LENGTH

PROMPTS = ["a red circle on a blue background", "a green square on a yellow background",
           "a cyan triangle on the left on a magenta background"]


def dev_config(folder, *extra: str):
    """The tiny FLUX.2 preset on the [dev] folder: guidance into the embedding, and a text length that keeps the
    prompt after the pipeline's system message (at the preset's 32 it would be cut to one token)."""
    return load_config(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml",
                       [f"model.path={folder}", f"sampling.guidance={DEV_GUIDANCE}", "sampling.shift=dynamic",
                        f"data.max_sequence_length={DEV_MAX_SEQUENCE_LENGTH}", *extra])


@pytest.fixture(scope="module")
def setup(tiny_flux2_dev):
    folder = str(tiny_flux2_dev)
    cfg = dev_config(folder)
    parts = FLUX2_DEV.load_parts(folder)
    sampler = FluxSampler.from_parts(parts, parts.vae, cfg.sampling, cfg.seed, torch.device("cpu"), torch.float32)
    cache = PromptCache(PROMPTS, FLUX2_DEV.encode_prompts(folder, PROMPTS, cfg.data.max_sequence_length,
                                                          torch.device("cpu")))
    pipe = Flux2Pipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return cfg, parts, sampler, cache, pipe


def test_the_folder_is_flux2_dev(tiny_flux2_dev):
    assert family_of(tiny_flux2_dev) is FLUX2_DEV


def test_the_encoding_is_the_pipelines_at_the_presets_length(setup):
    cfg, parts, sampler, cache, pipe = setup
    embeds, text_ids = pipe.encode_prompt(PROMPTS, device=torch.device("cpu"),
                                          max_sequence_length=cfg.data.max_sequence_length)
    assert embeds.shape == (3, DEV_MAX_SEQUENCE_LENGTH, parts.transformer.config.joint_attention_dim)
    assert torch.equal(cache.embeds["prompt_embeds"], embeds)
    # The prompts survive the system message: their encodings differ.
    assert not torch.equal(embeds[0], embeds[1])
    cond = sampler.conditioning(cache, [0, 1])
    assert torch.equal(cond.txt_ids, text_ids[0]) and cond.pooled is None
    # As Flux2Pipeline builds it: the guidance scale for every sample, in float32 whatever the model's dtype.
    assert torch.equal(cond.guidance, torch.full((2,), DEV_GUIDANCE, dtype=torch.float32))


def _pipeline_images(pipe, cfg, cache, noise, guidance: float) -> torch.Tensor:
    with torch.no_grad():
        return pipe(prompt_embeds=cache.embeds["prompt_embeds"], latents=noise, height=64, width=64,
                    num_inference_steps=cfg.sampling.num_steps, guidance_scale=guidance, output_type="pt").images


def test_ode_rollout_reproduces_flux2_pipeline_with_its_guidance(setup):
    cfg, parts, sampler, cache, pipe = setup
    ids = list(range(len(PROMPTS)))
    init = sampler.initial_latents(0, ids)
    traj = sampler.sample(parts.transformer, sampler.conditioning(cache, ids), init, eta=0.0)
    ours = sampler.decode(traj.x0)
    # The pipeline draws its noise patchified, [B, 4C, h/2, w/2]: the same numbers, unpacked.
    side = sampler.latent_size // 2
    noise = init.cpu().permute(0, 2, 1).reshape(len(ids), -1, side, side)
    expected = _pipeline_images(pipe, cfg, cache, noise, DEV_GUIDANCE)
    assert ours.shape == expected.shape == (3, 3, 64, 64)
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)
    # The guidance embedding acts: another guidance gives another image, so a guidance lost on the way would fail.
    other = _pipeline_images(pipe, cfg, cache, noise, 1.0)
    assert (other - expected).abs().max() > 1e-3


def test_the_guidance_embedding_takes_a_guidance(tiny_flux2_dev):
    from grpo.inputs import check_guidance

    check_guidance(str(tiny_flux2_dev), DEV_GUIDANCE)
    check_guidance(str(tiny_flux2_dev), 1.0)


def test_ode_rollout_with_a_reference_image_reproduces_flux2_pipeline(setup):
    """Flux2Pipeline(image=...), as Flux2KleinPipeline's: the reference image's tokens after the noisy ones."""
    from diffusers.utils import load_image

    from tests import EDITS

    cfg, parts, sampler, cache, pipe = setup
    path = str(EDITS.parent / "tiny_edit" / "000.png")
    refs = FLUX2_DEV.encode_references(parts.vae, [path], 64, torch.device("cpu"))
    cache = PromptCache(cache.prompts[:1], {k: v[:1] for k, v in cache.embeds.items()}, references=refs,
                        reference_index=torch.zeros(1, 1, dtype=torch.int64))
    init = sampler.initial_latents(0, [0])
    ours = sampler.decode(sampler.sample(parts.transformer, sampler.conditioning(cache, [0]), init, eta=0.0).x0)
    side = sampler.latent_size // 2
    noise = init.cpu().permute(0, 2, 1).reshape(1, -1, side, side)
    with torch.no_grad():
        expected = pipe(image=[load_image(path)], prompt_embeds=cache.embeds["prompt_embeds"], latents=noise,
                        height=64, width=64, num_inference_steps=cfg.sampling.num_steps, guidance_scale=DEV_GUIDANCE,
                        output_type="pt").images
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)
    assert (_pipeline_images(pipe, cfg, cache, noise, DEV_GUIDANCE) - expected).abs().max() > 1e-3  # no image
