"""Our sampler against diffusers' own FluxPipeline, and per-trajectory independence from the batch."""

import pytest
import torch
from diffusers import FluxPipeline

from grpo.config import load_config
from grpo.models.flux1 import FLUX1
from grpo.rollout import FluxSampler, SDEParams, sample, timestep, transition
from grpo.sde import predicted_x0, sde_step, shifted_sigmas
from grpo.solvers import dpm_solver_pp_sample, flash_sigmas
from tests import ROOT, TINY

pytestmark = pytest.mark.skipif(not (TINY / "model_index.json").exists(), reason="tiny model not built")
RES, STEPS = 64, 6


@pytest.fixture(scope="module")
def pipe():
    return FluxPipeline.from_pretrained(str(TINY), dtype=torch.float32)


@pytest.fixture(scope="module")
def inputs(pipe):
    torch.manual_seed(0)
    prompts = ["a red circle on a blue background", "a green square on a yellow background", "a cyan triangle on a "
               "magenta background"]
    embeds, pooled, _ = pipe.encode_prompt(prompts, prompts, max_sequence_length=32)
    parts = FLUX1.load_parts(str(TINY))
    size = parts.latent_size(RES)
    noise = torch.randn(len(prompts), parts.transformer.config.in_channels // 4, size, size)
    cond = FLUX1.conditioning({"prompt_embeds": embeds, "pooled": pooled}, size, 3.5, True, torch.device("cpu"),
                              torch.float32)
    return parts, embeds, pooled, noise, cond


def test_ode_rollout_reproduces_flux_pipeline(pipe, inputs):
    parts, embeds, pooled, noise, cond = inputs
    expected = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=FLUX1.pack(noise), height=RES, width=RES,
                    num_inference_steps=STEPS, guidance_scale=3.5, output_type="pt").images
    sigmas = FLUX1.dynamic_sigmas(STEPS, (parts.latent_size(RES) // 2) ** 2, parts.scheduler_config)
    traj = sample(FLUX1.velocity_of(parts.transformer), cond, FLUX1.pack(noise), sigmas, SDEParams(0.0, "dance"))
    ours = FLUX1.decode(parts.vae, traj.x0, RES, parts.vae_scale_factor)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)
    assert traj.log_probs is None


@pytest.mark.parametrize("kind", ["dance", "flow"])
def test_sde_trajectory_does_not_depend_on_its_batch(inputs, kind):
    """Each trajectory draws its own noise, so it is the same alone or in a batch (up to kernel rounding)."""
    parts, _, _, noise, cond = inputs
    sigmas = FLUX1.dynamic_sigmas(STEPS, (parts.latent_size(RES) // 2) ** 2, parts.scheduler_config)
    sde = SDEParams(0.7, kind)
    gens = lambda ids: [torch.Generator().manual_seed(100 + i) for i in ids]  # noqa: E731
    full = sample(FLUX1.velocity_of(parts.transformer), cond, FLUX1.pack(noise), sigmas, sde, gens([0, 1, 2]))
    alone = sample(FLUX1.velocity_of(parts.transformer), cond.select(slice(1, 2)), FLUX1.pack(noise[1:2]), sigmas, sde, gens([1]))
    torch.testing.assert_close(alone.latents[0], full.latents[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone.log_probs[0], full.log_probs[1], atol=1e-5, rtol=1e-5)


def test_recomputed_log_prob_equals_rollout_log_prob_exactly(inputs):
    """Same micro-batch, same stored latents and timesteps: the update's log-prob is bit-identical."""
    parts, _, _, noise, cond = inputs
    sigmas = FLUX1.dynamic_sigmas(STEPS, (parts.latent_size(RES) // 2) ** 2, parts.scheduler_config)
    sde = SDEParams(0.3, "dance")
    traj = sample(FLUX1.velocity_of(parts.transformer), cond, FLUX1.pack(noise), sigmas, sde, [torch.Generator().manual_seed(i)
                                                                          for i in range(3)])
    for j in range(STEPS - 1):
        out = transition(FLUX1.velocity_of(parts.transformer), cond, traj.latents, sigmas, j, sde)
        assert torch.equal(out.log_prob, traj.log_probs[:, j])
        # the velocity it stepped with comes back with it (grpo's drift stats), the one that makes this log-prob
        assert torch.equal(sde.step(traj.latents[:, j], out.velocity, sigmas, j,
                                    prev_sample=traj.latents[:, j + 1]).log_prob, out.log_prob)


def _gens(n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(200 + i) for i in range(n)]


@pytest.mark.parametrize("kind", ["flow", "cps"])
def test_window_sdes_inside_and_euler_outside(inputs, kind):
    """MixGRPO / Flow-GRPO-Fast: SDE steps only inside the window. Before it the trajectory is the ODE one; inside it
    is the full-SDE one given the same x_start (the noise stream does not depend on the window); outside, the step
    is the deterministic Euler step and records no log-prob. Every window step's log-prob recomputes exactly."""
    parts, _, _, noise, cond = inputs
    sigmas = shifted_sigmas(STEPS, 3.0)
    sde, win = SDEParams(0.7, kind), range(2, 4)
    traj = sample(FLUX1.velocity_of(parts.transformer), cond, FLUX1.pack(noise), sigmas, sde, _gens(3), window=win)
    ode = sample(FLUX1.velocity_of(parts.transformer), cond, FLUX1.pack(noise), sigmas, SDEParams(0.0, kind))
    full = sample(FLUX1.velocity_of(parts.transformer), cond, FLUX1.pack(noise), sigmas, sde, _gens(3))
    assert torch.equal(traj.latents[:, : win.start + 1], ode.latents[:, : win.start + 1])
    assert not torch.equal(traj.latents[:, win.stop], ode.latents[:, win.stop])
    # Step 2 from the same x_2 with the same (3rd) noise draw as the full-SDE rollout's step 2:
    redo = sde_step(traj.latents[:, 2], FLUX1.velocity(parts.transformer, traj.latents[:, 2],
                                                 timestep(sigmas, 2, 3), cond), float(sigmas[2]), float(sigmas[3]),
                    eta=0.7, kind=kind, noise=torch.stack([_noise_draw(200 + i, 2, noise.shape) for i in range(3)]),
                    sigma_max=float(sigmas[1]))
    assert torch.equal(redo.prev_sample, traj.latents[:, 3])
    for i in range(STEPS):
        if i in win:
            out = transition(FLUX1.velocity_of(parts.transformer), cond, traj.latents, sigmas, i, sde)
            assert torch.equal(out.log_prob, traj.log_probs[:, i])
        else:
            assert (traj.log_probs[:, i] == 0).all()
            v = FLUX1.velocity(parts.transformer, traj.latents[:, i], timestep(sigmas, i, 3), cond)
            assert torch.equal(traj.latents[:, i + 1], traj.latents[:, i] + (sigmas[i + 1] - sigmas[i]) * v)
    assert traj.nfe == STEPS and full.nfe == STEPS


def _noise_draw(seed: int, k: int, shape) -> torch.Tensor:
    """The k-th (0-based) per-step noise a trajectory's generator draws (packed latent shape)."""
    g = torch.Generator().manual_seed(seed)
    packed = (shape[2] // 2 * shape[3] // 2, shape[1] * 4)
    for _ in range(k):
        torch.randn(packed, generator=g)
    return torch.randn(packed, generator=g)


def test_dpm2_tail_after_the_window_and_recorded_means(inputs):
    """MixGRPO-Flash: after window [0, 2) the rollout runs DPM-Solver++(2M) on a compressed tail to sigma 0: the
    stored trajectory ends at x_{L+1}, the nfe counts the tail, and x0 equals running the tail from x_{L+1} with the
    window's last x0-prediction as history. keep_means records the SDE means the update recomputes."""
    parts, _, _, noise, cond = inputs
    sigmas = shifted_sigmas(STEPS, 3.0)
    sde, win = SDEParams(0.7, "flow"), range(0, 2)
    tail = flash_sigmas(sigmas, win[-1], 0.5, 3.0)[win[-1] + 1:]
    traj = sample(FLUX1.velocity_of(parts.transformer), cond, FLUX1.pack(noise), sigmas, sde, _gens(3), window=win, tail=tail,
                  keep_means=True)
    assert traj.latents.shape[1] == win[-1] + 2 and traj.nfe == win[-1] + 1 + len(tail) - 1 < STEPS
    assert float(tail[-1]) == 0.0 and float(tail[0]) == float(sigmas[win[-1] + 1])
    x_last = traj.latents[:, win[-1]]
    x0_prev = predicted_x0(x_last, FLUX1.velocity(parts.transformer, x_last, timestep(sigmas, win[-1], 3), cond),
                           float(sigmas[win[-1]]))

    def x0_of(x, k):
        return predicted_x0(x, FLUX1.velocity(parts.transformer, x, timestep(tail, k, 3), cond), float(tail[k]))

    expected = dpm_solver_pp_sample(traj.latents[:, -1], x0_of, tail, x0_prev=x0_prev, sigma_prev=float(sigmas[1]))
    assert torch.equal(traj.x0, expected)
    for j in win:
        assert torch.equal(transition(FLUX1.velocity_of(parts.transformer), cond, traj.latents, sigmas, j, sde).mean, traj.means[:, j])


def test_ode_rollouts_with_a_dpm2_tail_and_evals_on_the_schedule(inputs):
    """nft/awm with sampling.tail: dpm2 (DiffusionNFT's rollout solver): a training rollout (eta None) takes the grid's
    Euler step from sigma 1 (where DPM-Solver++'s lambda is -inf), then DPM-Solver++(2M) on the compressed tail: 3
    transformer calls instead of 6. A held-out eval (eta 0) keeps the schedule's own 6 Euler steps, so held-out
    rewards stay comparable between strategies."""
    parts, _, _, noise, cond = inputs
    s = load_config(ROOT / "recipes/configs/tiny/nft_lora.yaml",
                    ["sampling.tail=dpm2", "sampling.compress_ratio=0.5"]).sampling
    sampler = FluxSampler.from_parts(parts, parts.vae, s, 42, torch.device("cpu"), torch.float32)
    rollout = sampler.sample(parts.transformer, cond, FLUX1.pack(noise))
    evaluated = sampler.sample(parts.transformer, cond, FLUX1.pack(noise), eta=0.0)
    sigmas = sampler.sigmas
    euler = sample(FLUX1.velocity_of(parts.transformer), cond, FLUX1.pack(noise), sigmas, SDEParams(0.0, s.sde))
    assert torch.equal(evaluated.x0, euler.x0) and evaluated.nfe == STEPS
    tail = flash_sigmas(sigmas, 0, 0.5, 3.0)[1:]
    assert rollout.nfe == len(tail) == 3 and rollout.log_probs is None
    assert torch.equal(rollout.latents[:, 1], euler.latents[:, 1])
    x0_first = predicted_x0(FLUX1.pack(noise), FLUX1.velocity(parts.transformer, FLUX1.pack(noise), timestep(sigmas, 0, 3), cond),
                            float(sigmas[0]))

    def x0_of(x, k):
        return predicted_x0(x, FLUX1.velocity(parts.transformer, x, timestep(tail, k, 3), cond), float(tail[k]))

    expected = dpm_solver_pp_sample(euler.latents[:, 1], x0_of, tail, x0_prev=x0_first, sigma_prev=float(sigmas[0]))
    assert torch.equal(rollout.x0, expected)


def test_evals_on_their_own_steps_are_the_presets_evals(inputs):
    """sampling.eval_num_steps (Flow-GRPO's denoising reduction): rollouts on 4 steps, held-out evals on 6 give
    exactly the evals of the 6-step preset (the same schedule, the same ODE), so held-out rewards stay comparable
    between runs with different rollout steps; unset, the eval sampler is the rollout's."""
    parts, _, _, noise, cond = inputs
    preset = ROOT / "recipes/configs/tiny/awm_lora.yaml"
    six = FluxSampler.from_parts(parts, parts.vae, load_config(preset).sampling, 42, torch.device("cpu"),
                                 torch.float32)
    four = FluxSampler.from_parts(parts, parts.vae, load_config(preset, ["sampling.num_steps=4",
                                                                         "sampling.eval_num_steps=6"]).sampling,
                                  42, torch.device("cpu"), torch.float32)
    assert six.for_eval() is six and len(four.sigmas) == 4 + 1
    assert torch.equal(four.for_eval().sigmas, six.sigmas)
    evaluated = four.for_eval().sample(parts.transformer, cond, FLUX1.pack(noise), eta=0.0)
    expected = six.sample(parts.transformer, cond, FLUX1.pack(noise), eta=0.0)
    assert evaluated.nfe == STEPS and torch.equal(evaluated.x0, expected.x0)
    assert four.sample(parts.transformer, cond, FLUX1.pack(noise)).nfe == 4  # the rollout keeps its own steps
