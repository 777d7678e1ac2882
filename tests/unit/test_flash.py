"""Flash-GRPO (Shredded-Pork/Flash-GRPO@4211013 scripts/train_wanx2_1_flash.py) against its source: one SDE step per
trajectory shared by the prompt's group (grpo/windows.py placement "group"), and the temporal gradient rescale
(grpo/sde.py log_prob_gain, the grpo objective's timestep_rescale)."""

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.loss import grpo_loss
from grpo.objectives import objective_of
from grpo.rollout_plan import RolloutPlan
from grpo.sde import SDE_KINDS, log_prob_gain, sde_step, shifted_sigmas
from grpo.windows import rollout_window, trainable_range
from tests import ROOT

PRESET = ROOT / "recipes/configs/tiny/flashgrpo_lora.yaml"


def _cfg(*overrides: str):
    return load_config(PRESET, list(overrides))


# --- the shared timestep -------------------------------------------------------------------------------------------


def test_a_group_shares_one_sde_step_and_groups_draw_their_own():
    cfg = _cfg()
    s = cfg.sampling
    g = s.group_size
    for step in range(20):
        windows = [rollout_window(s, cfg.seed, step, i) for i in range(16 * g)]
        for group in range(16):
            assert len(set(windows[group * g:(group + 1) * g])) == 1  # iso-temporal
        assert all(len(w) == 1 and 0 <= w.start < s.window.high for w in windows)
        # a pure function of (seed, step, group): the same on every call, rank and resume
        assert windows == [rollout_window(s, cfg.seed, step, i) for i in range(16 * g)]
    starts = {rollout_window(s, cfg.seed, step, i * g).start for step in range(20) for i in range(16)}
    assert starts == set(range(s.window.high))  # the draw covers [0, high - size], uniform like the source's
    per_step = [{rollout_window(s, cfg.seed, 0, i * g).start for i in range(16)}]
    assert len(per_step[0]) > 1  # one draw per group, not per step (Flow-GRPO-Fast's)


def test_the_other_placements_ignore_the_sample():
    cfg = load_config(ROOT / "recipes/configs/tiny/flowgrpo_fast_lora.yaml")
    assert {rollout_window(cfg.sampling, cfg.seed, 3, i) for i in range(64)} == {rollout_window(cfg.sampling,
                                                                                               cfg.seed, 3)}


def test_the_cost_is_one_trained_transition():
    plan = RolloutPlan.of(_cfg())
    assert plan.trained_per_trajectory == 1
    assert plan.forwards_per_image(0) == 6 + 3  # the rollout's 6 calls, one forward and backward
    assert trainable_range(_cfg().sampling, 5) == range(3)


@pytest.mark.parametrize("overrides, match", [
    (["batch.micro_batch_size=3", "batch.prompts_per_step=3"], "rollout_micro_batch_size: 3 .* group"),
    (["sampling.window.stride=1"], "stride: not read by placement group"),
    (["sampling.window.high=null"], "high: required with placement group"),
    (["sampling.window.high=6"], "high: 6"),
    (["sampling.tail=dpm2", "sampling.compress_ratio=0.5"], "tail: dpm2 .* group"),
    (["grpo.ratio_norm=true", "sampling.sde=flow"], "timestep_rescale"),
])
def test_bad_settings_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        _cfg(*overrides)
    assert "\n" not in str(e.value)


def test_rollout_micro_batches_of_whole_groups_are_accepted():
    assert _cfg("batch.micro_batch_size=2").batch.rollout_micro_batch == 2  # inside a group
    assert _cfg("batch.micro_batch_size=8").batch.rollout_micro_batch == 8  # two whole groups


# --- the rescale ---------------------------------------------------------------------------------------------------


def _source_value(sigma: float, sigma_next: float, std_dev_t: float) -> float:
    """The quantity the source's comment names (train_wanx2_1_flash.py:983), dt = sigma_next - sigma < 0."""
    dt = sigma_next - sigma
    return math.sqrt(-dt) / std_dev_t + std_dev_t * math.sqrt(-dt) * (1 - sigma) / (2 * sigma)


@pytest.mark.parametrize("eta", [0.3, 0.7])
def test_the_flow_gain_is_the_sources_formula(eta):
    sig = shifted_sigmas(10, 3.0).tolist()
    for i in range(9):
        g = eta * math.sqrt(sig[i] / (1 - (sig[1] if sig[i] == 1 else sig[i])))  # Flow-GRPO's std_dev_t
        got = log_prob_gain(sig[i], sig[i + 1], eta=eta, kind="flow", sigma_max=sig[1])
        assert got == pytest.approx(_source_value(sig[i], sig[i + 1], g), rel=1e-5)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_the_gain_is_the_log_probs_own_gradient_in_v(kind):
    """d log_prob / d v of a stored sample mean + std·eps is gain·eps / D elementwise (up to the sign of the mean's
    slope): the gain is what the log-prob code itself does, for every SDE kind."""
    sig = shifted_sigmas(6, 3.0).tolist()
    eta = 0.7
    g = torch.Generator().manual_seed(0)
    x, eps = torch.randn(1, 16, generator=g), torch.randn(1, 16, generator=g)
    for i in range(5):
        v = torch.randn(1, 16, generator=g)
        out = sde_step(x, v, sig[i], sig[i + 1], eta=eta, kind=kind, sigma_max=sig[1], noise=eps)
        v_grad = v.clone().requires_grad_(True)
        lp = sde_step(x, v_grad, sig[i], sig[i + 1], eta=eta, kind=kind, sigma_max=sig[1],
                      prev_sample=out.prev_sample).log_prob
        (grad,) = torch.autograd.grad(lp.sum(), v_grad)
        gain = log_prob_gain(sig[i], sig[i + 1], eta=eta, kind=kind, sigma_max=sig[1])
        torch.testing.assert_close(grad.abs(), gain * eps.abs() / eps.numel(), rtol=1e-4, atol=1e-8)


def test_the_sources_table_is_one_over_its_gain():
    """The source's c_t table (train_wanx2_1_flash.py:984) is 1 / value on Wan2.1's schedule (UniPC flow sigmas,
    shift 3, 20 steps; its std sigma_min + (sigma_max - sigma_min)·sigma), within 0.3%: the rescale divides by the
    gain, so every timestep's gradient has one scale."""
    from diffusers import UniPCMultistepScheduler

    table = [7.4770, 7.0414, 6.6112, 6.1867, 5.7682, 5.3559, 4.9502, 4.5513, 4.1596, 3.7754]
    s = UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    s.set_timesteps(20)
    sig = s.sigmas.double().tolist()
    for i, c in enumerate(table):
        std = sig[-1] + (sig[1] - sig[-1]) * sig[i]
        assert 1 / _source_value(sig[i], sig[i + 1], std) == pytest.approx(c, rel=3e-3)


def test_the_weights_average_one_and_even_out_the_timesteps():
    cfg = _cfg()
    objective = objective_of(cfg)

    class Sampler:
        sigmas = shifted_sigmas(cfg.sampling.num_steps, float(cfg.sampling.shift))

    weights = objective._timestep_weights(Sampler)
    assert sorted(weights) == [0, 1, 2]
    assert sum(weights.values()) / 3 == pytest.approx(1.0)
    s, sig = cfg.sampling, Sampler.sigmas.tolist()
    pulls = {j: w * log_prob_gain(sig[j], sig[j + 1], eta=s.eta, kind=s.sde, sigma_max=sig[1])
             for j, w in weights.items()}
    assert max(pulls.values()) == pytest.approx(min(pulls.values()), rel=1e-6)
    assert max(weights.values()) / min(weights.values()) > 1.2  # not a no-op on this schedule


def test_the_weight_scales_the_policy_term_only():
    lp = torch.tensor([0.1, -0.2, 0.3], requires_grad=True)
    old, adv, kl = torch.tensor([0.1, -0.1, 0.2]), torch.tensor([1.0, -1.0, 0.5]), torch.tensor([0.2, 0.1, 0.3])
    base, st = grpo_loss(lp, old, adv, clip_range=0.5, kl=kl, kl_coef=0.5)
    scaled, st2 = grpo_loss(lp, old, adv, clip_range=0.5, kl=kl, kl_coef=0.5, weight=1.7)
    assert float(scaled) == pytest.approx(1.7 * float(st["policy_loss"]) + 0.5 * float(kl.mean()))
    assert float(base) == pytest.approx(float(st["policy_loss"]) + 0.5 * float(kl.mean()))
