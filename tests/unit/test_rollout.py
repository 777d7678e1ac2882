"""Our sampler against diffusers' own FluxPipeline, and per-trajectory independence from the batch."""

import pytest
import torch
from diffusers import FluxPipeline

from grpo.flux import decode, load_parts, make_conditioning, pack
from grpo.rollout import SDEParams, sample, transition
from grpo.sde import dynamic_sigmas
from tests import TINY

pytestmark = pytest.mark.skipif(not (TINY / "model_index.json").exists(), reason="tiny model not built")
RES, STEPS = 64, 6


@pytest.fixture(scope="module")
def pipe():
    return FluxPipeline.from_pretrained(str(TINY), torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def inputs(pipe):
    torch.manual_seed(0)
    prompts = ["a red circle on a blue background", "a green square on a yellow background", "a cyan triangle on a "
               "magenta background"]
    embeds, pooled, _ = pipe.encode_prompt(prompts, prompts, max_sequence_length=32)
    parts = load_parts(str(TINY))
    size = parts.latent_size(RES)
    noise = torch.randn(len(prompts), parts.transformer.config.in_channels // 4, size, size)
    cond = make_conditioning(embeds, pooled, size, 3.5, True, torch.device("cpu"), torch.float32)
    return parts, embeds, pooled, noise, cond


def test_ode_rollout_reproduces_flux_pipeline(pipe, inputs):
    parts, embeds, pooled, noise, cond = inputs
    expected = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=pack(noise), height=RES, width=RES,
                    num_inference_steps=STEPS, guidance_scale=3.5, output_type="pt").images
    sigmas = dynamic_sigmas(STEPS, (parts.latent_size(RES) // 2) ** 2, parts.scheduler_config)
    traj = sample(parts.transformer, cond, pack(noise), sigmas, SDEParams(0.0, "dance"))
    ours = decode(parts.vae, traj.x0, RES, parts.vae_scale_factor)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)
    assert traj.log_probs is None


@pytest.mark.parametrize("kind", ["dance", "flow"])
def test_sde_trajectory_does_not_depend_on_its_batch(inputs, kind):
    """Each trajectory draws its own noise, so it is the same alone or in a batch (up to kernel rounding)."""
    parts, _, _, noise, cond = inputs
    sigmas = dynamic_sigmas(STEPS, (parts.latent_size(RES) // 2) ** 2, parts.scheduler_config)
    sde = SDEParams(0.7, kind)
    gens = lambda ids: [torch.Generator().manual_seed(100 + i) for i in ids]  # noqa: E731
    full = sample(parts.transformer, cond, pack(noise), sigmas, sde, gens([0, 1, 2]))
    alone = sample(parts.transformer, cond.select(slice(1, 2)), pack(noise[1:2]), sigmas, sde, gens([1]))
    torch.testing.assert_close(alone.latents[0], full.latents[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone.log_probs[0], full.log_probs[1], atol=1e-5, rtol=1e-5)


def test_recomputed_log_prob_equals_rollout_log_prob_exactly(inputs):
    """Same micro-batch, same stored latents and timesteps: the update's log-prob is bit-identical."""
    parts, _, _, noise, cond = inputs
    sigmas = dynamic_sigmas(STEPS, (parts.latent_size(RES) // 2) ** 2, parts.scheduler_config)
    sde = SDEParams(0.3, "dance")
    traj = sample(parts.transformer, cond, pack(noise), sigmas, sde, [torch.Generator().manual_seed(i)
                                                                          for i in range(3)])
    for j in range(STEPS - 1):
        out = transition(parts.transformer, cond, traj.latents, sigmas, j, sde)
        assert torch.equal(out.log_prob, traj.log_probs[:, j])
